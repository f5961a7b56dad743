"""The frame codec, with no process or socket: round trips, any split of a
stream, and a fuzz run whose one rule is h11's: input decodes to frames or
raises ``ProtocolError``, nothing else."""

from __future__ import annotations

import json
import math
import struct
from typing import Any

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
    _frames,
    encode,
    encode_op,
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
        device=draw(st.none() | st.integers(0, 1 << 20)),
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
    st.builds(
        Done,
        op_id=op_ids,
        event=st.one_of(st.just(""), st.binary(min_size=1, max_size=64).map(bytes.hex)),
    ),
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
                "device": None,
            },
            "rank",
        ),
        (
            Kind.CONFIGURE,
            b'{"store":"s","rank":0,"world_size":1,"timeout":NaN,"replica_id":"0",'
            b'"quorum_id":null,"group_rank":null,"group_world_size":null,'
            b'"global_ranks":null,"device":null}',
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
                "device": None,
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


# -- the codec caches: an OP payload seen before is not checked again --------------------
op_frames: st.SearchStrategy[Op] = st.builds(
    Op,
    op_id=op_ids,
    op=names,
    tensors=st.lists(tensor_descs(), max_size=4).map(tuple),
    options=st.dictionaries(names, scalars, max_size=6),
)


def _seg(i: int = 0, dtype: str = "float32", shape: tuple[int, ...] = (4,)) -> TensorDesc:
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    return TensorDesc(f"ftcomm-123-{i}-0a1b2c3d", dtype, shape, stride, offset=16 * i)


# What the subprocess backend sends, op after op (see backends/subprocess/__init__.py).
PAYLOADS: list[tuple[str, tuple[TensorDesc, ...], dict[str, object]]] = [
    ("allreduce", (_seg(0),), {"reduce_op": "SUM", "timeout": 20.0}),
    ("allreduce", (_seg(0),), {"reduce_op": "MAX", "timeout": 20.0}),
    ("allgather", (_seg(0), _seg(1), _seg(2)), {"timeout": 5.5}),
    ("broadcast", (_seg(0, "int64", (2, 3)),), {"root": 1, "timeout": 60.0}),
    (
        "alltoall_base",
        (_seg(0), _seg(1)),
        {"output_split_sizes": (1, 3), "input_split_sizes": (2, 2), "timeout": 20.0},
    ),
    ("barrier", (), {"timeout": 20.0}),
    ("send", (TensorDesc("empty", "bool", (0,), (1,)),), {"peer": 0, "tag": 7, "timeout": 1.0}),
]


@FAST
@given(st.sampled_from(PAYLOADS), op_ids, op_ids)
def test_encode_op_gives_the_bytes_of_encode(
    payload: tuple[str, tuple[TensorDesc, ...], dict[str, object]], first: int, then: int
) -> None:
    op, tensors, options = payload
    assert encode_op(first, op, tensors, options) == encode(Op(first, op, tensors, options))
    cached = len(_frames._op_payloads)
    assert cached >= 1
    # The same payload under another op id: from the cache, still the same bytes.
    data = encode_op(then, op, tensors, options)
    assert len(_frames._op_payloads) == cached  # a hit: nothing new was stored
    assert data == encode(Op(then, op, tensors, options))
    assert Decoder().feed(data) == [Op(then, op, tensors, options)]


@FAST
@given(op_frames, op_ids)
def test_encode_op_gives_the_bytes_of_encode_for_any_op(frame: Op, then: int) -> None:
    # A fresh cache per example: values equal in Python but not in JSON are
    # the next test's.
    _frames._op_payloads.clear()
    args = (frame.op, frame.tensors, frame.options)
    assert encode_op(frame.op_id, *args) == encode(frame)
    assert encode_op(then, *args) == encode(Op(then, *args))


@pytest.mark.parametrize(
    ("first", "then"),
    [
        (1, True),
        (True, 1),
        (1, 1.0),
        (0.0, -0.0),
        (-0.0, 0.0),
        ((1,), (True,)),
    ],
    ids=["int-bool", "bool-int", "int-float", "zero-negzero", "negzero-zero", "ints-bools"],
)
def test_encode_op_tells_options_that_are_equal_in_python_apart(
    first: object, then: object
) -> None:
    _frames._op_payloads.clear()
    encode_op(1, "allreduce", (), {"x": first})
    try:
        want = encode(Op(2, "allreduce", (), {"x": then}))
    except ProtocolError:
        with pytest.raises(ProtocolError):
            encode_op(2, "allreduce", (), {"x": then})
        return
    assert encode_op(2, "allreduce", (), {"x": then}) == want


@pytest.mark.parametrize(
    ("change", "match"),
    [
        pytest.param({"op_id": 2**64}, "op_id", id="op_id past 64 bits"),
        pytest.param({"op_id": -1}, "op_id", id="negative op_id"),
        pytest.param({"op": ""}, "op", id="empty op"),
        pytest.param({"options": {"timeout": math.nan}}, "timeout", id="nan timeout"),
        pytest.param({"options": {"x": (1, -1)}}, "option x", id="negative in a tuple"),
        pytest.param({"options": {"x": [1, {"nested": 1}]}}, "option x", id="nested dict"),
    ],
)
def test_encode_op_refuses_what_encode_refuses_after_a_cached_payload(
    change: dict[str, Any], match: str
) -> None:
    op, tensors, options = PAYLOADS[0]
    encode_op(1, op, tensors, options)  # cached now
    bad = {"op_id": 2, "op": op, "tensors": tensors, **change}
    bad["options"] = {**options, **change.get("options", {})}
    with pytest.raises(ProtocolError, match=match):
        encode_op(bad["op_id"], bad["op"], bad["tensors"], bad["options"])
    assert encode_op(3, op, tensors, options) == encode(Op(3, op, tensors, options))


@FAST
@given(op_frames, op_ids)
def test_decoder_gives_a_repeated_op_payload_under_each_op_id(frame: Op, then: int) -> None:
    decoder = Decoder()
    again = Op(then, frame.op, frame.tensors, frame.options)
    first, second = decoder.feed(encode(frame) + encode(again))
    assert first == frame
    assert second == again
    assert (first.op_id, second.op_id) == (frame.op_id, then)
    assert (second.op, second.tensors, second.options) == (first.op, first.tensors, first.options)
    assert len(decoder._ops) == 1  # the second came from the cache


def test_decoder_decodes_a_payload_one_byte_off_afresh() -> None:
    seg = _seg(0)
    a = Op(1, "allreduce", (seg,), {"reduce_op": "SUM", "timeout": 20.0})
    other_seg = TensorDesc("ftcomm-123-1-0a1b2c3d", seg.dtype, seg.shape, seg.stride, seg.offset)
    b = Op(2, "allreduce", (other_seg,), {"reduce_op": "SUM", "timeout": 20.0})
    c = Op(3, "allreduce", (seg,), {"reduce_op": "SUM", "timeout": 30.0})
    pa, pb, pc = (encode(f)[HEADER.size :] for f in (a, b, c))
    for other in (pb, pc):  # each differs from a's payload in exactly one byte
        assert len(other) == len(pa)
        assert sum(x != y for x, y in zip(pa, other, strict=True)) == 1
    decoder = Decoder()
    stream = encode(a) + encode(b) + encode(Op(4, a.op, a.tensors, a.options)) + encode(c)
    got = decoder.feed(stream)
    assert got == [a, b, Op(4, a.op, a.tensors, a.options), c]
    assert got[1].tensors[0].handle == "ftcomm-123-1-0a1b2c3d"
    assert got[3].options["timeout"] == 30.0


@pytest.mark.parametrize(
    ("old", "new", "match"),
    [
        (b"float32", b"float33", "dtype"),
        (b'"offset":0', b'"offset":-', "not JSON"),
        (b'"shape":[4]', b'"shape":[4.', "not JSON"),
        (b'"device":"cpu"', b'"device":"cpx"', "device"),
        (b'"op":"allreduce"', b'"oq":"allreduce"', "unknown fields"),
    ],
    ids=["dtype", "offset", "shape", "device", "field"],
)
def test_decoder_refuses_a_malformed_payload_after_a_good_one(
    old: bytes, new: bytes, match: str
) -> None:
    good = Op(1, "allreduce", (_seg(0),), {"reduce_op": "SUM", "timeout": 20.0})
    payload = encode(good)[HEADER.size :]
    assert payload.count(old) == 1
    assert len(old) == len(new)
    bad = payload.replace(old, new)
    decoder = Decoder()
    assert decoder.feed(encode(good)) == [good]  # cached
    with pytest.raises(ProtocolError, match=match):
        decoder.feed(header(Kind.OP, len(bad), op_id=2) + bad)


@settings(max_examples=500, deadline=None, database=None)
@given(op_frames, st.data())
def test_a_cached_decoder_decodes_a_changed_payload_like_a_fresh_one(
    frame: Op, data: st.DataObject
) -> None:
    good = encode(frame)
    i = data.draw(st.integers(HEADER.size, len(good) - 1))
    changed = bytearray(good)
    changed[i] = data.draw(st.integers(0, 255).filter(lambda b: b != good[i]))
    cached = Decoder()
    assert cached.feed(good) == [frame]
    try:
        fresh = Decoder().feed(bytes(changed))
    except ProtocolError:
        with pytest.raises(ProtocolError):
            cached.feed(bytes(changed))
        return
    assert cached.feed(bytes(changed)) == fresh


def test_the_caches_stay_bounded() -> None:
    decoder = Decoder()
    for i in range(1000):
        op = Op(i + 1, "allreduce", (_seg(i),), {"reduce_op": "SUM", "timeout": 20.0})
        data = encode_op(op.op_id, op.op, op.tensors, op.options)
        assert data == encode(op)
        assert decoder.feed(data) == [op]
        assert 1 <= len(decoder._ops) <= 256
        assert 1 <= len(_frames._op_payloads) <= 256
    # Still correct after the caches were emptied and refilled.
    last = Op(5000, "allreduce", (_seg(999),), {"reduce_op": "SUM", "timeout": 20.0})
    assert decoder.feed(encode_op(5000, last.op, last.tensors, last.options)) == [last]
