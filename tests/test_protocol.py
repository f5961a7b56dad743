"""The frame codec, with no process or socket: round trips, any split of a
stream, and a fuzz run whose one rule is h11's: input decodes to frames or
raises ``ProtocolError``, nothing else."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftcomm._protocol import (
    DTYPES,
    HEADER,
    MAGIC,
    MAX_PAYLOAD,
    VERSION,
    Abort,
    Configure,
    Decoder,
    Done,
    Failed,
    Frame,
    Kind,
    Op,
    Ready,
    Shutdown,
    TensorDesc,
    encode,
)
from ftcomm.errors import ProtocolError

FAST = settings(max_examples=150, deadline=None, database=None)
FUZZ = settings(
    max_examples=1500,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# -- strategies -------------------------------------------------------------------------
names = st.text(min_size=1, max_size=24)
texts = st.text(max_size=64)
u63 = st.integers(0, 2**63 - 1)
op_ids = st.integers(0, 2**64 - 1)


@st.composite
def tensor_descs(draw: st.DrawFn) -> TensorDesc:
    dims = draw(st.integers(0, 6))
    return TensorDesc(
        handle=draw(names),
        dtype=draw(st.sampled_from(sorted(DTYPES))),
        shape=tuple(draw(st.lists(u63, min_size=dims, max_size=dims))),
        stride=tuple(draw(st.lists(u63, min_size=dims, max_size=dims))),
        offset=draw(u63),
        device=draw(st.sampled_from(["cpu", "cuda", "cuda:3", "xpu", "xpu:0"])),
    )


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    texts,
    st.lists(u63, max_size=6).map(tuple),
)


@st.composite
def configures(draw: st.DrawFn) -> Configure:
    world = draw(st.integers(1, 2**31 - 1))
    return Configure(
        op_id=draw(op_ids),
        store=draw(names),
        rank=draw(st.integers(0, world - 1)),
        world_size=world,
        timeout=draw(st.floats(0, 1e9, allow_nan=False)),
        replica_id=draw(texts),
        quorum_id=draw(st.none() | u63),
        group_rank=draw(st.none() | u63),
        group_world_size=draw(st.none() | u63),
        global_ranks=draw(st.none() | st.lists(u63, max_size=8).map(tuple)),
    )


frames: st.SearchStrategy[Frame] = st.one_of(
    st.builds(Ready, pid=st.integers(1, 2**31), op_id=op_ids),
    configures(),
    st.builds(
        Op,
        op_id=op_ids,
        op=names,
        tensors=st.lists(tensor_descs(), max_size=4).map(tuple),
        options=st.dictionaries(names, scalars, max_size=6),
    ),
    st.builds(Done, op_id=op_ids),
    st.builds(Failed, op_id=op_ids, type=names, message=texts, traceback=texts),
    st.builds(Abort, op_id=op_ids),
    st.builds(Shutdown, op_id=op_ids),
)


def header(
    kind: int, length: int, op_id: int = 1, *, magic: bytes = MAGIC, version: int = VERSION
) -> bytes:
    return HEADER.pack(magic, version, kind, op_id, length)


def raw_frame(kind: Kind, payload: object, op_id: int = 1) -> bytes:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return header(kind, len(body), op_id) + body


# -- round trips and splits -----------------------------------------------------------
@FAST
@given(frames)
def test_every_frame_round_trips(frame: Frame) -> None:
    assert Decoder().feed(encode(frame)) == [frame]


@FAST
@given(st.lists(frames, min_size=1, max_size=6), st.data())
def test_any_split_of_a_stream_decodes_the_same(frames_: list[Frame], data: st.DataObject) -> None:
    stream = b"".join(encode(f) for f in frames_)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    decoder = Decoder()
    got: list[Frame] = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        got += decoder.feed(stream[start:end])
    assert got == frames_
    assert decoder.buffered == 0


@FAST
@given(st.lists(frames, min_size=1, max_size=3))
def test_one_byte_at_a_time_decodes_the_same(frames_: list[Frame]) -> None:
    stream = b"".join(encode(f) for f in frames_)
    decoder = Decoder()
    got: list[Frame] = []
    for i in range(len(stream)):
        got += decoder.feed(stream[i : i + 1])
    assert got == frames_


# -- fuzz: frames or ProtocolError, nothing else --------------------------------------
def _decode_or_protocol_error(data: bytes, decoder: Decoder | None = None) -> list[Frame]:
    try:
        return (decoder or Decoder()).feed(data)
    except ProtocolError:
        return []


@FUZZ
@given(st.binary(max_size=256))
def test_arbitrary_bytes_give_frames_or_protocol_error(data: bytes) -> None:
    for frame in _decode_or_protocol_error(data):
        assert Decoder().feed(encode(frame)) == [frame]  # whatever decoded is a valid frame


@FUZZ
@given(st.sampled_from(list(Kind)), st.binary(max_size=200))
def test_arbitrary_payloads_give_frames_or_protocol_error(kind: Kind, body: bytes) -> None:
    _decode_or_protocol_error(header(kind, len(body)) + body)


@FUZZ
@given(frames, st.data())
def test_corrupted_frames_give_frames_or_protocol_error(frame: Frame, data: st.DataObject) -> None:
    stream = bytearray(encode(frame))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(stream) - 1))
        stream[i] = data.draw(st.integers(0, 255))
    _decode_or_protocol_error(bytes(stream))


@FUZZ
@given(
    st.sampled_from(list(Kind)),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    ),
)
def test_arbitrary_json_gives_frames_or_protocol_error(kind: Kind, payload: object) -> None:
    _decode_or_protocol_error(raw_frame(kind, json.dumps(payload).encode()))


# -- the header is judged before the payload ------------------------------------------
def test_a_length_over_the_cap_is_refused_from_the_header_alone() -> None:
    decoder = Decoder()
    with pytest.raises(ProtocolError, match="over the"):
        decoder.feed(header(Kind.DONE, 2**32 - 1))
    assert decoder.buffered == 0  # nothing kept, nothing waited for
    small = Decoder(max_payload=8)
    with pytest.raises(ProtocolError, match="over the 8 cap"):
        small.feed(header(Kind.DONE, 9))
    assert Decoder(max_payload=2).feed(raw_frame(Kind.DONE, {})) == [Done(op_id=1)]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (header(Kind.DONE, 2, magic=b"XX") + b"{}", "bad magic"),
        (header(Kind.DONE, 2, version=VERSION + 1) + b"{}", "version"),
        (header(0, 2) + b"{}", "unknown frame kind 0"),
        (header(99, 2) + b"{}", "unknown frame kind 99"),
    ],
    ids=["magic", "version", "kind0", "kind99"],
)
def test_a_bad_header_is_refused(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        Decoder().feed(data[: HEADER.size])  # the header alone is enough


@pytest.mark.parametrize(
    ("kind", "payload", "match"),
    [
        (Kind.DONE, b"{", "not JSON"),
        (Kind.DONE, b"\xff\xfe", "not JSON"),
        (Kind.DONE, b"[]", "JSON object"),
        (Kind.DONE, {"extra": 1}, "unknown fields"),
        (Kind.READY, {}, "missing fields"),
        (Kind.READY, {"pid": True}, "pid"),
        (Kind.READY, {"pid": 0}, "pid"),
        (Kind.READY, {"pid": 1.5}, "pid"),
        (Kind.FAILED, {"type": "", "message": "m", "traceback": ""}, "error type"),
        (
            Kind.CONFIGURE,
            {
                "store": "s",
                "rank": 2,
                "world_size": 2,
                "timeout": 1,
                "replica_id": "0",
                "quorum_id": None,
                "group_rank": None,
                "group_world_size": None,
                "global_ranks": None,
            },
            "rank",
        ),
        (
            Kind.CONFIGURE,
            b'{"store":"s","rank":0,"world_size":1,"timeout":NaN,"replica_id":"0",'
            b'"quorum_id":null,"group_rank":null,"group_world_size":null,'
            b'"global_ranks":null}',
            "NaN",
        ),
        (
            Kind.CONFIGURE,
            {
                "store": "s",
                "rank": 0,
                "world_size": 1,
                "timeout": -1,
                "replica_id": "0",
                "quorum_id": None,
                "group_rank": None,
                "group_world_size": None,
                "global_ranks": None,
            },
            "timeout",
        ),
        (Kind.OP, {"op": "allreduce", "tensors": [{"handle": "h"}], "options": {}}, "tensor"),
        (Kind.OP, {"op": "allreduce", "tensors": [], "options": {"x": {"nested": 1}}}, "option x"),
        (Kind.OP, {"op": "allreduce", "tensors": [], "options": []}, "options"),
        (Kind.OP, {"op": "", "tensors": [], "options": {}}, "op"),
        (
            Kind.OP,
            {
                "op": "a",
                "options": {},
                "tensors": [
                    {
                        "handle": "h",
                        "dtype": "object",
                        "shape": [1],
                        "stride": [1],
                        "offset": 0,
                        "device": "cpu",
                    }
                ],
            },
            "dtype",
        ),
        (
            Kind.OP,
            {
                "op": "a",
                "options": {},
                "tensors": [
                    {
                        "handle": "h",
                        "dtype": "float32",
                        "shape": [1, 2],
                        "stride": [1],
                        "offset": 0,
                        "device": "cpu",
                    }
                ],
            },
            "same length",
        ),
        (
            Kind.OP,
            {
                "op": "a",
                "options": {},
                "tensors": [
                    {
                        "handle": "h",
                        "dtype": "float32",
                        "shape": [-1],
                        "stride": [1],
                        "offset": 0,
                        "device": "cpu",
                    }
                ],
            },
            "shape",
        ),
        (
            Kind.OP,
            {
                "op": "a",
                "options": {},
                "tensors": [
                    {
                        "handle": "h",
                        "dtype": "float32",
                        "shape": [1],
                        "stride": [1],
                        "offset": 0,
                        "device": "tpu",
                    }
                ],
            },
            "device",
        ),
    ],
)
def test_a_malformed_payload_is_refused(kind: Kind, payload: object, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        Decoder().feed(raw_frame(kind, payload))


def test_a_broken_decoder_stays_broken() -> None:
    decoder = Decoder()
    with pytest.raises(ProtocolError) as first:
        decoder.feed(header(Kind.DONE, 2, magic=b"no") + b"{}")
    good = encode(Done(op_id=3))
    with pytest.raises(ProtocolError) as again:
        decoder.feed(good)  # the stream cannot be trusted any more
    assert again.value is first.value
    assert Decoder().feed(good) == [Done(op_id=3)]


def test_encode_refuses_what_the_peer_would_refuse() -> None:
    with pytest.raises(ProtocolError, match="op_id"):
        encode(Done(op_id=2**64))
    with pytest.raises(ProtocolError, match="op_id"):
        encode(Done(op_id=-1))
    with pytest.raises(ProtocolError, match="over the cap"):
        encode(Op(op_id=1, op="a", options={f"k{i}": "v" * 60000 for i in range(20)}))


def test_frames_check_themselves() -> None:
    with pytest.raises(ProtocolError, match="rank"):
        Configure(op_id=1, store="s", rank=3, world_size=2, timeout=1.0)
    with pytest.raises(ProtocolError, match="dtype"):
        TensorDesc(handle="h", dtype="int4", shape=(1,), stride=(1,))
    with pytest.raises(ProtocolError, match="pid"):
        Ready(pid=0)


def test_the_header_is_sixteen_bytes_big_endian() -> None:
    data = encode(Done(op_id=0x0102030405060708))
    assert data[:16] == MAGIC + bytes([VERSION, Kind.DONE]) + bytes(range(1, 9)) + struct.pack(
        ">I", 2
    )
    assert data[16:] == b"{}"
    assert MAX_PAYLOAD == 1 << 20
