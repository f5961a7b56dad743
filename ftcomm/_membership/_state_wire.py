"""A training state as data: its description (JSON), and its strict parse. No I/O.

Owns: :func:`describe` (a state taken apart: what a state may hold), the
description's JSON form (:class:`Described`, :class:`TensorSpec`) and its
strict :func:`parse`. The state copy, ``_state_copy``, moves the bytes;
where each tensor of a description lands on a receiver is
``_state_land``'s. See docs/membership.md, "State".
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

VERSION = 1
MAX_DEPTH = 100
"""How deep a state may nest."""
MAX_BYTES = 1 << 30
"""The cap on a description received: 1 GiB, far above any state's (~150
bytes a tensor)."""
_MAX_DIMS = 64

_DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "complex128",
    "complex64",
    "complex32",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name)
}
"""The tensor dtypes a state may hold, by name (``torch.<name>``)."""
_NAME_OF = {dtype: name for name, dtype in DTYPES.items()}

Node: TypeAlias = list[Any]
"""One node of a description's tree, JSON-shaped: ``[tag, ...]``.

``["T", i]`` tensor ``i``; ``["N"]`` None; ``["B", bool]``; ``["I", int]``;
``["F", float | "nan" | "inf" | "-inf"]``; ``["S", str]``; ``["Y", hex]``
bytes; ``["L", [node...]]`` list; ``["U", [node...]]`` tuple;
``["D", [[key, node]...]]`` dict; ``["O", [[key, node]...], meta]``
OrderedDict (``meta``: its ``_metadata`` as a node, or None). A key is a
node of a plain value (``S``, ``I``, ``B``, ``F``, ``N``).
"""
PLAIN_TAGS = frozenset("NBIFSY")
_NONFINITE = ("nan", "inf", "-inf")
_KEY_TAGS = frozenset("NBIFS")
CONTAINERS = (dict, OrderedDict, list, tuple)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a description."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    """The layout of its bytes on the wire (dense): the sender's strides
    where its tensor is dense (no overlap, no gaps: its bytes go in the
    order of its storage, with no copy, and a new tensor gets these
    strides), else row-major."""
    offset: int
    """The sender's storage offset (what its bytes were read from)."""
    nbytes: int
    on_group: bool
    """On the group's device at the sender (a new tensor is made there too;
    else on the CPU)."""
    same_as: int | None = None
    """The index of an earlier tensor that is the same view of the same
    storage (tied weights): its bytes go once."""

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": _NAME_OF[self.dtype],
            "shape": list(self.shape),
            "stride": list(self.stride),
            "offset": self.offset,
            "nbytes": self.nbytes,
            "on_group": self.on_group,
            "same_as": self.same_as,
        }


@dataclass
class Described:
    """A state taken apart: its tree, one spec per tensor, and (on the member
    that described it) the tensors themselves and what each leaf was (a
    ``DTensor`` is kept as the leaf; its local shard is the tensor)."""

    tree: Node
    specs: list[TensorSpec]
    tensors: list[torch.Tensor]
    leaves: list[object]

    def encode(self) -> bytes:
        body = {"version": VERSION, "tree": self.tree, "tensors": [s.to_json() for s in self.specs]}
        return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


# -- describing a state -------------------------------------------------------
def describe(state: object, device: torch.device) -> Described:
    """Take ``state`` apart; ``device``: the group's.

    A state is a tree of containers (``dict``, ``OrderedDict`` with a module
    ``state_dict``'s ``_metadata``, ``list``, ``tuple``) whose leaves are
    tensors (``Parameter`` and ``DTensor`` included: a ``DTensor`` is its
    local shard) or plain values (``None``, ``bool``, ``int``, ``float``,
    ``str``, ``bytes``). Its description is JSON, never a pickle: a tree of
    tagged nodes, and one :class:`TensorSpec` per tensor.

    Raises:
        ValueError: the state holds what cannot be copied (named with its place).
    """
    out = Described([], [], [], [])
    seen: dict[tuple[Any, ...], int] = {}
    out.tree = _node(state, "state", 0, device, out, seen)
    return out


def _node(
    value: object,
    path: str,
    depth: int,
    device: torch.device,
    out: Described,
    seen: dict[tuple[Any, ...], int],
) -> Node:
    if depth > MAX_DEPTH:
        raise ValueError(f"{path}: the state nests deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if isinstance(value, torch.Tensor):
        return ["T", _tensor(value, path, device, out, seen)]
    if kind in (dict, OrderedDict):
        assert isinstance(value, dict)
        items = [
            [_key(k, path), _node(v, f"{path}[{k!r}]", depth + 1, device, out, seen)]
            for k, v in value.items()
        ]
        if kind is dict:
            return ["D", items]
        meta = getattr(value, "_metadata", None)
        meta_node = (
            None if meta is None else _node(meta, f"{path}._metadata", depth + 1, device, out, seen)
        )
        if meta_node is not None and _has_tensor(meta_node):
            raise ValueError(f"{path}._metadata: holds a tensor (plain values only)")
        return ["O", items, meta_node]
    if kind in (list, tuple):
        assert isinstance(value, list | tuple)
        nodes = [
            _node(v, f"{path}[{i}]", depth + 1, device, out, seen) for i, v in enumerate(value)
        ]
        return ["L" if kind is list else "U", nodes]
    plain = _plain(value)
    if plain is None:
        raise ValueError(
            f"{path}: a {type_name(value)} cannot be copied (a state holds tensors, "
            "dict/OrderedDict/list/tuple, and None, bool, int, float, str, bytes)"
        )
    return plain


def _plain(value: object) -> Node | None:
    kind = type(value)
    if value is None:
        return ["N"]
    if kind is bool:
        return ["B", value]
    if kind is int:
        return ["I", value]
    if kind is float:
        assert isinstance(value, float)
        if math.isnan(value):
            return ["F", "nan"]
        if math.isinf(value):
            return ["F", "inf" if value > 0 else "-inf"]
        return ["F", value]
    if kind is str:
        return ["S", value]
    if kind is bytes:
        assert isinstance(value, bytes)
        return ["Y", value.hex()]
    return None


def _key(key: object, path: str) -> Node:
    node = _plain(key)
    if node is None or node[0] not in _KEY_TAGS:
        raise ValueError(
            f"{path}: a key of type {type_name(key)} (keys are str, int, float, bool or None)"
        )
    if node[0] == "F" and isinstance(node[1], str) and node[1] == "nan":
        raise ValueError(f"{path}: a key that is NaN (no NaN equals another: it cannot be matched)")
    return node


def type_name(value: object) -> str:
    kind = type(value)
    return (
        kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    )


def local_tensor(value: torch.Tensor, path: str) -> torch.Tensor:
    """The tensor whose bytes a leaf holds (a ``DTensor``'s local shard).

    Raises: ValueError: a kind of tensor that cannot be copied."""
    kind = type(value)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter:
        from torch.distributed.tensor import DTensor  # imported with the first DTensor

        if not isinstance(value, DTensor):
            raise ValueError(f"{path}: a tensor subclass {type_name(value)} cannot be copied")
        value = value._local_tensor
        if type(value) is not torch.Tensor and type(value) is not torch.nn.Parameter:
            raise ValueError(
                f"{path}: a DTensor whose local shard is a {type_name(value)} cannot be copied"
            )
    if value.is_nested or value.layout != torch.strided:
        what = "nested" if value.is_nested else str(value.layout)
        raise ValueError(f"{path}: a {what} tensor cannot be copied (dense tensors only)")
    if value.is_quantized or value.dtype not in _NAME_OF:
        raise ValueError(f"{path}: a tensor of dtype {value.dtype} cannot be copied")
    if value.is_meta:
        raise ValueError(f"{path}: a tensor on the meta device has no data to copy")
    if value.numel():
        reach = value.storage_offset() + sum(
            (size - 1) * stride for size, stride in zip(value.shape, value.stride(), strict=True)
        )
        if (reach + 1) * value.element_size() > value.untyped_storage().nbytes():
            raise ValueError(
                f"{path}: a tensor whose storage does not hold its values (freed or resized, "
                "as FSDP does with a parameter it has sharded)"
            )
    return value


def _tensor(
    value: torch.Tensor,
    path: str,
    device: torch.device,
    out: Described,
    seen: dict[tuple[Any, ...], int],
) -> int:
    t = local_tensor(value, path)
    shape, stride = tuple(t.shape), tuple(t.stride())
    numel = t.numel()
    index = len(out.specs)
    same_as = None
    if numel:
        view = (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            shape,
            stride,
            t.dtype,
            t.device,
        )
        same_as = seen.setdefault(view, index)
        same_as = None if same_as == index else same_as
    wire = stride if plain_bytes(t) else contiguous_stride(shape)
    out.specs.append(
        TensorSpec(
            t.dtype,
            shape,
            wire,
            int(t.storage_offset()),
            numel * t.element_size(),
            on_device(t, device),
            same_as,
        )
    )
    out.tensors.append(t)
    out.leaves.append(value)
    return index


def on_device(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t`` lives on ``device`` (``cpu`` and ``cpu:0`` are one)."""
    here = t.device
    if here.type != device.type:
        return False
    return here.type == "cpu" or device.index is None or here.index == device.index


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def is_dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a layout covers its storage span exactly once (no overlap, no gaps)."""
    if any(size == 0 for size in shape):
        return True
    expected = 1
    for st, size in sorted((st, size) for size, st in zip(shape, stride, strict=True) if size != 1):
        if st != expected:
            return False
        expected *= size
    return True


def plain_bytes(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage span holds exactly its values, as they read
    (dense, not a lazy conjugate or negative view)."""
    return is_dense(tuple(t.shape), tuple(t.stride())) and not (t.is_conj() or t.is_neg())


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a dense ``t``'s storage span, as a 1-D uint8 view (no copy)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    flat = torch.as_strided(t.detach(), (t.numel(),), (1,), t.storage_offset())
    return flat.view(torch.uint8)


def _has_tensor(node: Node) -> bool:
    return any(n[0] == "T" for n in walk(node))


def walk(node: Node) -> Iterator[Node]:
    """Every node below ``node``, itself first (pre-order; keys are not nodes
    of the tree, an OrderedDict's ``_metadata`` comes after its items)."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        tag = n[0]
        if tag in ("L", "U"):
            stack.extend(reversed(n[1]))
        elif tag in ("D", "O"):
            children = [v for _, v in n[1]]
            if tag == "O" and n[2] is not None:
                children.append(n[2])
            stack.extend(reversed(children))


def plain_value(node: Node) -> Any:
    tag = node[0]
    if tag == "N":
        return None
    if tag == "F" and isinstance(node[1], str):
        return float(node[1])
    if tag == "Y":
        return bytes.fromhex(node[1])
    return node[1]


# -- parsing a description ----------------------------------------------------
def parse(data: bytes) -> tuple[Node, list[TensorSpec]]:
    """A description's tree and specs, checked field by field: every field's
    type and range, as the frame codec does.

    Raises: ValueError: not a description this module wrote.
    """
    if len(data) > MAX_BYTES:
        raise ValueError(f"a state description of {len(data)} bytes (over {MAX_BYTES})")
    try:
        body = json.loads(data.decode(), parse_constant=_no_constant, object_pairs_hook=_object)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"the state description is not JSON: {exc}") from exc
    body = _exact(body, "the description", {"version", "tree", "tensors"})
    if body["version"] != VERSION or type(body["version"]) is not int:
        raise ValueError(
            f"a state description of version {body['version']!r} (this one reads {VERSION})"
        )
    if type(body["tensors"]) is not list:
        raise ValueError("the description's tensors are not a list")
    specs = [_spec(entry, i) for i, entry in enumerate(body["tensors"])]
    for i, spec in enumerate(specs):
        if spec.same_as is not None:
            first = specs[spec.same_as]
            if (first.dtype, first.shape, first.stride, first.same_as) != (
                spec.dtype,
                spec.shape,
                spec.stride,
                None,
            ):
                raise ValueError(f"tensor {i} of the description is not the same as its same_as")
    tree = body["tree"]
    used: set[int] = set()
    _check_node(tree, 0, len(specs), used)
    if used != set(range(len(specs))):
        raise ValueError("the description's tree and its tensors do not agree")
    return tree, specs


def _no_constant(name: str) -> object:
    raise ValueError(f"the state description holds {name}")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        raise ValueError("the state description repeats a field of an object")
    return found


def _exact(value: object, what: str, names: set[str]) -> dict[str, Any]:
    if type(value) is not dict or set(value) != names:
        raise ValueError(f"{what} is not an object with exactly the fields {sorted(names)}")
    return value


def _int(value: object, what: str, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{what} is not an int in {lo}..{hi}: {value!r}")
    return value


def _ints(value: object, what: str) -> tuple[int, ...]:
    if type(value) is not list or len(value) > _MAX_DIMS:
        raise ValueError(f"{what} is not a list of at most {_MAX_DIMS} ints")
    return tuple(_int(v, what) for v in value)


def _spec(entry: object, i: int) -> TensorSpec:
    what = f"tensor {i} of the description"
    fields = _exact(
        entry, what, {"dtype", "shape", "stride", "offset", "nbytes", "on_group", "same_as"}
    )
    dtype = DTYPES.get(fields["dtype"]) if type(fields["dtype"]) is str else None
    if dtype is None:
        raise ValueError(f"{what}: an unknown dtype {fields['dtype']!r}")
    shape, stride = (
        _ints(fields["shape"], f"{what}'s shape"),
        _ints(fields["stride"], f"{what}'s stride"),
    )
    if len(shape) != len(stride) or not is_dense(shape, stride):
        raise ValueError(f"{what}: strides {stride} are not a dense layout of shape {shape}")
    numel = math.prod(shape)
    nbytes = _int(fields["nbytes"], f"{what}'s nbytes")
    if nbytes != numel * dtype.itemsize:
        raise ValueError(f"{what}: {nbytes} bytes for {numel} values of {dtype}")
    if type(fields["on_group"]) is not bool:
        raise ValueError(f"{what}: on_group is not a bool")
    same_as = fields["same_as"]
    if same_as is not None:
        _int(same_as, f"{what}'s same_as", 0, i - 1)
    return TensorSpec(
        dtype,
        shape,
        stride,
        _int(fields["offset"], f"{what}'s offset"),
        nbytes,
        fields["on_group"],
        same_as,
    )


def _check_node(node: object, depth: int, count: int, used: set[int]) -> None:
    if depth > MAX_DEPTH + 1:
        raise ValueError(f"the description's tree nests deeper than {MAX_DEPTH} levels")
    if type(node) is not list or not node or type(node[0]) is not str:
        raise ValueError(f"the description's tree holds {node!r}, not a node")
    tag, args = node[0], node[1:]
    if tag == "T":
        if len(args) != 1:
            raise ValueError("a tensor node with extra fields")
        index = _int(args[0], "a tensor node's index", 0, count - 1)
        if index in used:
            raise ValueError(f"tensor {index} is named twice in the description's tree")
        used.add(index)
    elif tag in PLAIN_TAGS:
        _check_plain(node)
    elif tag in ("L", "U"):
        if len(args) != 1 or type(args[0]) is not list:
            raise ValueError(f"a {tag} node without its list")
        for child in args[0]:
            _check_node(child, depth + 1, count, used)
    elif tag in ("D", "O"):
        if len(args) != (1 if tag == "D" else 2) or type(args[0]) is not list:
            raise ValueError(f"a {tag} node without its items")
        for item in args[0]:
            if type(item) is not list or len(item) != 2:
                raise ValueError("a mapping's item is not a [key, value] pair")
            key, value = item
            _check_plain(key)
            if key[0] not in _KEY_TAGS:
                raise ValueError(f"a mapping's key of tag {key[0]!r}")
            if key == ["F", "nan"]:
                raise ValueError("a mapping's key that is NaN")
            _check_node(value, depth + 1, count, used)
        keys = [plain_value(k) for k, _ in args[0]]
        if len(set(keys)) != len(keys):
            raise ValueError("a mapping of the description repeats a key")
        if tag == "O" and args[1] is not None:
            before = set(used)
            _check_node(args[1], depth + 1, count, used)
            if used != before:
                raise ValueError("an OrderedDict's _metadata names a tensor")
    else:
        raise ValueError(f"a node of unknown tag {tag!r}")


def _check_plain(node: object) -> None:
    if type(node) is not list or not node or node[0] not in PLAIN_TAGS:
        raise ValueError(f"{node!r} is not a plain value's node")
    tag, args = node[0], node[1:]
    if tag == "N":
        ok = not args
    else:
        value = args[0] if len(args) == 1 else None
        kind = type(value)
        ok = len(args) == 1 and (
            (tag == "B" and kind is bool)
            or (tag == "I" and kind is int)
            or (tag == "F" and kind is float and math.isfinite(value))  # type: ignore[arg-type]
            or (tag == "F" and kind is str and value in _NONFINITE)
            or (tag in "SY" and kind is str)
        )
        if ok and tag == "Y":
            try:
                bytes.fromhex(value)  # type: ignore[arg-type]
            except ValueError:
                ok = False
    if not ok:
        raise ValueError(f"{node!r} is not a plain value's node")
