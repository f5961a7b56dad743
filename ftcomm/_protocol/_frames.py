"""The parent <-> worker frame codec: bytes in, frames out, no I/O.

Owns the header, the frame kinds and their payloads (:class:`Kind`, one class
each), :class:`TensorDesc`, :class:`Decoder`, :func:`encode` and
:func:`encode_op`. A header is judged from its 16 bytes alone; a payload is
JSON data with a fixed set of typed fields, never a pickle; a decoder that
raised :class:`~ftcomm.errors.ProtocolError` stays broken, since its stream
can no longer be trusted. The format, field by field: docs/protocol.md.
"""

from __future__ import annotations

import enum
import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar, TypeAlias, cast

from ..errors import ProtocolError

MAGIC = b"FT"
VERSION = 1
HEADER = struct.Struct(">2sBBQI")
"""magic, version, kind, op id, payload length: 16 bytes."""
MAX_PAYLOAD = 1 << 20
"""The default cap on a payload (1 MiB): tensors never travel in frames."""
MAX_OP_ID = (1 << 64) - 1

DTYPES = frozenset(
    {
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
        "complex128",
    }
)
"""The tensor dtypes a descriptor may name (``torch.<name>``)."""

_DEVICE = re.compile(r"(cpu|cuda|xpu)(:[0-9]{1,4})?\Z")
_HEX = re.compile(r"(?:[0-9a-f]{2}){1,512}\Z")
_MAX_TEXT = 1 << 16  # one string field (a traceback is the longest)
_MAX_DIMS = 64


class Kind(enum.IntEnum):
    """What a frame is; the header's kind byte."""

    READY = 1  # worker -> parent: up and listening
    CONFIGURE = 2  # parent -> worker: build the group
    OP = 3  # parent -> worker: run one collective
    DONE = 4  # worker -> parent: the op (or configure) with this id succeeded
    FAILED = 5  # worker -> parent: ... failed
    ABORT = 6  # parent -> worker: drop the group, fail what is in flight
    SHUTDOWN = 7  # parent -> worker: exit


Scalar: TypeAlias = int | float | str | bool | tuple[int, ...] | None


# -- field checks ----------------------------------------------------------------------
def _int(value: object, name: str, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"{name} must be an integer in [{lo}, {hi}], got {value!r:.80}")
    return value


def _opt_int(value: object, name: str) -> int | None:
    return None if value is None else _int(value, name)


def _float(value: object, name: str) -> float:
    if type(value) is int or type(value) is float:
        number = float(value)
        if math.isfinite(number) and number >= 0:
            return number
    raise ProtocolError(f"{name} must be a finite number >= 0, got {value!r:.80}")


def _text(value: object, name: str, *, empty: bool = True) -> str:
    if type(value) is not str or len(value) > _MAX_TEXT or (not empty and not value):
        raise ProtocolError(f"{name} must be a string of at most {_MAX_TEXT} characters")
    return value


def _ints(value: object, name: str, lo: int = 0) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > 1 << 16:
        raise ProtocolError(f"{name} must be a list of integers")
    return tuple(_int(v, f"{name}[{i}]", lo=lo) for i, v in enumerate(value))


def _opt_ints(value: object, name: str) -> tuple[int, ...] | None:
    return None if value is None else _ints(value, name)


# -- payload types ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TensorDesc:
    """Where a tensor lives, for the other side to map it: never its data."""

    handle: str
    """The shared-memory segment's name (or an IPC handle, hex)."""
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int = 0
    """Storage offset, in elements."""
    device: str = "cpu"

    def __post_init__(self) -> None:
        _text(self.handle, "tensor handle", empty=False)
        if self.dtype not in DTYPES:
            raise ProtocolError(f"unknown tensor dtype {self.dtype!r:.40}")
        object.__setattr__(self, "shape", _ints(self.shape, "shape"))
        object.__setattr__(self, "stride", _ints(self.stride, "stride"))
        if len(self.shape) != len(self.stride) or len(self.shape) > _MAX_DIMS:
            raise ProtocolError("shape and stride must have the same length (at most 64)")
        _int(self.offset, "offset")
        if type(self.device) is not str or not _DEVICE.match(self.device):
            raise ProtocolError(f"device must be cpu, cuda[:N] or xpu[:N], got {self.device!r:.40}")

    def to_json(self) -> dict[str, Any]:
        return {
            "handle": self.handle,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "stride": list(self.stride),
            "offset": self.offset,
            "device": self.device,
        }

    @classmethod
    def from_json(cls, value: object) -> TensorDesc:
        body = _exact(value, "tensor", {f.name for f in fields(cls)})
        return cls(**body)


def _exact(value: object, what: str, names: set[str]) -> dict[str, Any]:
    if type(value) is not dict:
        raise ProtocolError(f"{what} must be a JSON object")
    if set(value) != names:
        missing, extra = sorted(names - set(value)), sorted(set(value) - names)
        raise ProtocolError(f"{what}: missing fields {missing}, unknown fields {extra}")
    return value


def _option(key: str, value: object) -> Scalar:
    if value is None or type(value) in (bool, str):
        return value if type(value) is not str else _text(value, f"option {key}")  # type: ignore[return-value]
    if type(value) is int:
        return _int(value, f"option {key}", lo=-(1 << 63))
    if type(value) is float:
        if not math.isfinite(value):
            raise ProtocolError(f"option {key} must be finite")
        return value
    if type(value) in (list, tuple):
        return _ints(value, f"option {key}")
    raise ProtocolError(f"option {key} has an unsupported type {type(value).__name__}")


# -- frames ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ready:
    """The worker is up (``pid``) and reads frames."""

    kind: ClassVar[Kind] = Kind.READY
    pid: int
    op_id: int = 0

    def __post_init__(self) -> None:
        _int(self.pid, "pid", lo=1)


@dataclass(frozen=True, slots=True)
class Configure:
    """Build the group; the reply is ``Done``/``Failed`` with the same op id."""

    kind: ClassVar[Kind] = Kind.CONFIGURE
    op_id: int
    store: str
    rank: int
    world_size: int
    timeout: float
    replica_id: str = "0"
    quorum_id: int | None = None
    group_rank: int | None = None
    group_world_size: int | None = None
    global_ranks: tuple[int, ...] | None = None
    device: int | None = None
    """The accelerator device index the group uses (NCCL/XCCL)."""

    def __post_init__(self) -> None:
        _text(self.store, "store", empty=False)
        _int(self.world_size, "world_size", lo=1, hi=(1 << 31) - 1)
        _int(self.rank, "rank", hi=self.world_size - 1)
        object.__setattr__(self, "timeout", _float(self.timeout, "timeout"))
        _text(self.replica_id, "replica_id")
        for name in ("quorum_id", "group_rank", "group_world_size", "device"):
            _opt_int(getattr(self, name), name)
        object.__setattr__(self, "global_ranks", _opt_ints(self.global_ranks, "global_ranks"))


@dataclass(frozen=True, slots=True)
class Op:
    """Run collective ``op`` on ``tensors`` with ``options`` (scalars only)."""

    kind: ClassVar[Kind] = Kind.OP
    op_id: int
    op: str
    tensors: tuple[TensorDesc, ...] = ()
    options: Mapping[str, Scalar] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _text(self.op, "op", empty=False)
        if type(self.tensors) not in (list, tuple) or len(self.tensors) > 1 << 12:
            raise ProtocolError("tensors must be a list of tensor descriptors")
        descs = tuple(
            t if isinstance(t, TensorDesc) else TensorDesc.from_json(t) for t in self.tensors
        )
        object.__setattr__(self, "tensors", descs)
        if not isinstance(self.options, Mapping) or len(self.options) > 64:
            raise ProtocolError("options must be an object of at most 64 fields")
        opts = {
            _text(k, "option name", empty=False): _option(k, v) for k, v in self.options.items()
        }
        object.__setattr__(self, "options", MappingProxyType(opts))  # shared when cached


@dataclass(frozen=True, slots=True)
class Done:
    """The op (or configure) with this id succeeded."""

    kind: ClassVar[Kind] = Kind.DONE
    op_id: int
    event: str = ""
    """For an op on accelerator tensors: the IPC handle (hex) of an event
    recorded on the worker's stream after the op, which the caller's stream
    waits on. Empty otherwise, and then the payload is ``{}``."""

    def __post_init__(self) -> None:
        if type(self.event) is not str or (self.event and not _HEX.match(self.event)):
            raise ProtocolError("event must be an even-length lowercase hex string")


@dataclass(frozen=True, slots=True)
class Failed:
    """The op (or configure) with this id failed: the error as data."""

    kind: ClassVar[Kind] = Kind.FAILED
    op_id: int
    type: str
    message: str
    traceback: str = ""

    def __post_init__(self) -> None:
        _text(self.type, "error type", empty=False)
        _text(self.message, "error message")
        _text(self.traceback, "traceback")


@dataclass(frozen=True, slots=True)
class Abort:
    """Drop the group; fail every op in flight."""

    kind: ClassVar[Kind] = Kind.ABORT
    op_id: int = 0


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Exit."""

    kind: ClassVar[Kind] = Kind.SHUTDOWN
    op_id: int = 0


Frame: TypeAlias = Ready | Configure | Op | Done | Failed | Abort | Shutdown
_BY_KIND: dict[int, type[Any]] = {
    cls.kind: cls for cls in (Ready, Configure, Op, Done, Failed, Abort, Shutdown)
}


def _payload(frame: Frame) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for f in fields(frame):
        if f.name == "op_id":
            continue
        value = getattr(frame, f.name)
        if f.name == "tensors":
            value = [t.to_json() for t in value]
        elif f.name == "options":
            value = {k: list(v) if isinstance(v, tuple) else v for k, v in value.items()}
        elif isinstance(value, tuple):
            value = list(value)
        body[f.name] = value
    return body


_EMPTY = b"{}"
_NO_FIELDS = (Abort, Shutdown)
_CACHED = 256
"""How many distinct OP payloads an encoder or decoder remembers.

A training loop sends the same few payloads over and over (the same op on
the same pooled segment, with the same timeout): only the op id, which is in
the header, changes. Checking and (de)serialising such a payload once, not
per op, is most of what a small op costs in Python."""
_op_payloads: dict[tuple[object, ...], bytes] = {}


def _frame_bytes(kind: int, op_id: int, payload: bytes) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, op_id, len(payload)) + payload


def encode(frame: Frame) -> bytes:
    """The bytes of ``frame``: header, then its JSON payload.

    Raises:
        ProtocolError: the op id is out of range, or the payload exceeds
            :data:`MAX_PAYLOAD` (the peer would refuse it).
    """
    _int(frame.op_id, "op_id", hi=MAX_OP_ID)
    if isinstance(frame, _NO_FIELDS) or (isinstance(frame, Done) and not frame.event):
        return _frame_bytes(frame.kind, frame.op_id, _EMPTY)
    payload = json.dumps(_payload(frame), separators=(",", ":"), allow_nan=False).encode()
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError(f"a {frame.kind.name} payload of {len(payload)} bytes is over the cap")
    return _frame_bytes(frame.kind, frame.op_id, payload)


def encode_op(
    op_id: int, op: str, tensors: tuple[TensorDesc, ...], options: Mapping[str, Scalar]
) -> bytes:
    """``encode(Op(op_id, op, tensors, options))``, checking a payload seen
    before only by a dictionary lookup.

    Raises:
        ProtocolError: as :class:`Op` and :func:`encode`.
    """
    _int(op_id, "op_id", hi=MAX_OP_ID)
    try:
        # True, 1 and 1.0 (or 0.0 and -0.0) are equal keys but different
        # payloads: key on each value's type and repr.
        key = (op, tensors, *((k, type(v), repr(v)) for k, v in options.items()))
        payload = _op_payloads.get(key)
    except TypeError:  # an unhashable option value: let Op() name it
        key, payload = None, None
    if payload is None:
        payload = encode(Op(0, op, tensors, options))[HEADER.size :]
        if key is not None:
            if len(_op_payloads) >= _CACHED:
                _op_payloads.clear()
            _op_payloads[key] = payload
    return _frame_bytes(Kind.OP, op_id, payload)


def _reject_constant(name: str) -> object:
    raise ProtocolError(f"payload holds {name}, which is not a number")


def _with_op_id(frame: Op, op_id: int) -> Op:
    """A copy of a checked ``frame`` under another op id, without checking it again."""
    copy = object.__new__(Op)
    object.__setattr__(copy, "op_id", op_id)
    object.__setattr__(copy, "op", frame.op)
    object.__setattr__(copy, "tensors", frame.tensors)
    object.__setattr__(copy, "options", frame.options)
    return copy


def _decode_payload(kind: int, op_id: int, payload: bytes) -> Frame:
    if payload == _EMPTY and kind == Kind.DONE:
        return Done(op_id)
    try:
        body = json.loads(payload.decode("utf-8"), parse_constant=_reject_constant)
    except ProtocolError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"payload is not JSON: {exc}") from None
    cls = _BY_KIND[kind]
    names = {f.name for f in fields(cls)} - {"op_id"}
    if kind == Kind.DONE and body == {}:
        names = set()  # the event is optional: {} (the usual payload) has none
    body = _exact(body, cls.__name__, names)
    try:
        frame: Frame = cls(op_id=op_id, **body)
    except ProtocolError:
        raise
    except (TypeError, ValueError, RecursionError) as exc:  # defensive: a field we did not vet
        raise ProtocolError(f"malformed {cls.__name__} payload: {exc}") from None
    if isinstance(frame, Done) and not frame.event:  # one encoding only: {}
        raise ProtocolError("a DONE without an event has the payload {}")
    return frame


class Decoder:
    """Turns a byte stream into frames (sans-IO: the caller moves the bytes).

    Args:
        max_payload: the largest payload accepted, in bytes.
    """

    def __init__(self, max_payload: int = MAX_PAYLOAD) -> None:
        self.max_payload = _int(max_payload, "max_payload", hi=(1 << 32) - 1)
        self._buffer = bytearray()
        self._header: tuple[int, int, int] | None = None  # kind, op id, length
        self._broken: ProtocolError | None = None
        self._ops: dict[bytes, Op] = {}  # OP payloads already checked (see _CACHED)

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Frame]:
        """Take ``data`` (any split of the stream); return the frames it completes.

        Raises:
            ProtocolError: the stream is malformed (and stays so: every later
                ``feed`` raises it again).
        """
        if self._broken is not None:
            raise self._broken
        self._buffer += data
        frames: list[Frame] = []
        try:
            while True:
                frame = self._next()
                if frame is None:
                    return frames
                frames.append(frame)
        except ProtocolError as exc:
            self._broken = exc
            self._buffer.clear()
            raise

    def _next(self) -> Frame | None:
        if self._header is None:
            if len(self._buffer) < HEADER.size:
                return None
            magic, version, kind, op_id, length = HEADER.unpack_from(self._buffer)
            if magic != MAGIC:
                raise ProtocolError(f"bad magic {bytes(magic)!r}: not an ftcomm stream")
            if version != VERSION:
                raise ProtocolError(f"protocol version {version}, expected {VERSION}")
            if kind not in _BY_KIND:
                raise ProtocolError(f"unknown frame kind {kind}")
            if length > self.max_payload:
                raise ProtocolError(f"payload of {length} bytes is over the {self.max_payload} cap")
            del self._buffer[: HEADER.size]
            self._header = (kind, op_id, length)
        kind, op_id, length = self._header
        if len(self._buffer) < length:
            return None
        payload = bytes(self._buffer[:length])
        del self._buffer[:length]
        self._header = None
        if kind != Kind.OP:
            return _decode_payload(kind, op_id, payload)
        seen = self._ops.get(payload)
        if seen is not None:
            return _with_op_id(seen, op_id)
        frame = cast(Op, _decode_payload(kind, op_id, payload))
        if len(self._ops) >= _CACHED:
            self._ops.clear()
        self._ops[payload] = frame
        return frame
