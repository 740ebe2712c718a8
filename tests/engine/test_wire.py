"""engine.protocol's codec and frames (msgspec Structs): every message type round-trips; types
are strict (a bool is not an int); unknown fields, unknown tags, other wire versions, oversized
frames and nested constraint violations are refused with a WireError and nothing else; a value
is checked once (built in Python: by `__post_init__`; decoded: by the decoder, not again)."""

from __future__ import annotations

import msgpack
import msgspec
import pytest
from fuzz.frames import templates

from engine import protocol
from engine.kv_events import KVEvent, KVEventBatch, KVSnapshot, KVSnapshotRequest
from engine.protocol import (
    WIRE_VERSION,
    GenerateRequest,
    PrefillRequest,
    SamplingParams,
    Shutdown,
    TokenMessage,
    WireError,
    decode,
    encode,
)
from kv_transfer.messages import HelloReply, KVReady
from kv_transfer.tp_read import RankConnect, RankForget, RankPoll, RankRead, RankStates

_EP = "tcp://127.0.0.1:9"


def _every_message() -> list:
    msgs = templates() + [Shutdown(reason="bye")]
    kv_ready = next(m for m in msgs if isinstance(m, KVReady))
    sp = SamplingParams(
        n=3,
        logprobs=2,
        stop_token_ids=[7],
        logit_bias=[[3, -1.5]],
        seed=2**63,
        allowed_token_ids=[3, 7, 9],
        bad_words_token_ids=[[7], [3, 9]],
    )  # the KV hand-off (KVReady) carries it to the decode worker
    entry = (-0.25, 1, [[5, -0.25], [9, -2.0]])
    return msgs + [
        TokenMessage("r", 0, [5], "stop", 1, [entry], [None, entry], 4, worker_id="w"),
        TokenMessage(request_id="r", index=3, token_ids=[], handoff=True),
        msgspec.structs.replace(kv_ready, sampling=sp, choices=[[0, 7], [2, 8]]),
        HelloReply(
            True, "n", "i", nixl_metadata=b"\x00md", num_blocks=4, data_base=64, block_bytes=8
        ),  # fmt: skip
        # KV events (their own sockets: worker PUB -> router SUB, and the resync)
        KVEventBatch("w", "inc", 3, 16, [KVEvent("stored", -5, "device")]),
        KVSnapshotRequest(),
        KVSnapshot("w", "inc", 3, 16, {"device": [1, -2], "host": [3]}),
        # A tensor-parallel decode worker's READ orders to its other ranks (kv_transfer/tp_read)
        RankConnect("a", "peer", b"\x01reply", 5.0, faults={"fail_reads": 1}),
        RankRead("a", "r", "peer", [3, 4], [7, 8]),
        RankPoll("a", ["r"], cancel=True),
        RankForget("a", "peer"),
        RankStates({"r": "DONE", "": "ERR why"}, {"r": 4096}),
    ]


def _frame(tag: str, body: dict, v: int = WIRE_VERSION) -> bytes:
    return msgpack.packb({"v": v, "t": tag, "d": body}, use_bin_type=True)


def _body(msg) -> dict:
    return msgpack.unpackb(encode(msg))["d"]


def _prefill() -> PrefillRequest:
    return PrefillRequest("p", [1, 2, 3], SamplingParams(max_tokens=4), _EP, "decode-0", _EP)


def test_every_message_type_round_trips():
    msgs = _every_message()
    assert {type(m) for m in msgs} == set(protocol._REGISTRY.values())
    for msg in msgs:
        back = decode(encode(msg), expect=type(msg))
        assert type(back) is type(msg) and back == msg, msg


def test_a_bool_is_never_an_int():
    body = _body(_prefill())
    for bad in (
        {"prompt_token_ids": [1, True]},
        {"sampling": {"max_tokens": True}},
        {"sampling": {"temperature": False}},
    ):
        with pytest.raises(WireError, match="got `bool`"):
            decode(_frame("prefill", body | bad))
    with pytest.raises(ValueError, match="got `bool`"):
        SamplingParams(max_tokens=True)
    with pytest.raises(ValueError, match="got `bool`"):
        TokenMessage("r", False, [1])


def test_unknown_fields_are_refused_at_every_level():
    body = _body(_prefill())
    with pytest.raises(WireError, match="unknown field `extra`"):
        decode(_frame("prefill", body | {"extra": 1}))
    with pytest.raises(WireError, match="unknown field `beam`"):
        decode(_frame("prefill", body | {"sampling": {"beam": 2}}))
    with pytest.raises(WireError, match="unknown field `x`"):
        decode(msgpack.packb({"v": WIRE_VERSION, "t": "prefill", "d": body, "x": 0}))


def test_unknown_tag_and_other_wire_versions_are_refused():
    body = _body(_prefill())
    with pytest.raises(WireError, match="unknown message type 'os.system'"):
        decode(_frame("os.system", body))
    with pytest.raises(WireError, match="wire version 1 is not supported"):
        decode(_frame("prefill", body, v=1))  # what a peer of the dataclass era sends
    with pytest.raises(WireError, match="expected GenerateRequest, got PrefillRequest"):
        decode(encode(_prefill()), expect=GenerateRequest)


def test_an_oversized_frame_is_refused_before_unpacking(monkeypatch):
    class Untouchable:
        def decode(self, frame):
            raise AssertionError("unpacked an oversized frame")

    frame = encode(_prefill())
    monkeypatch.setattr(protocol, "_ENVELOPE", Untouchable())
    with pytest.raises(WireError, match=f"{len(frame)} bytes is over the {len(frame) - 1}"):
        decode(frame, max_bytes=len(frame) - 1)
    with pytest.raises(WireError, match="over"):
        encode(_prefill(), max_bytes=len(frame) - 1)


def test_nested_and_field_constraints_are_wire_errors():
    body = _body(_prefill())
    for bad, where in [
        ({"sampling": {"top_p": 0.0}}, r"\$.sampling.top_p"),
        ({"sampling": {"n": 129}}, r"\$.sampling.n"),
        ({"sampling": {"logit_bias": [[1, 101.0]]}}, r"\$.sampling.logit_bias\[0\]\[1\]"),
        ({"sampling": {"top_k": 0}}, "top_k"),  # the rule in check(), run by the decoder
        ({"prompt_token_ids": []}, r"\$.prompt_token_ids"),
        ({"prompt_token_ids": [1, -2]}, r"\$.prompt_token_ids\[1\]"),
        ({"reply_to": "nowhere"}, r"\$.reply_to"),
    ]:
        with pytest.raises(WireError, match=where):
            decode(_frame("prefill", body | bad))


@pytest.mark.parametrize(
    "frame",
    [
        b"\x91" * 200_000 + b"\xc0",  # nested 200k deep
        msgpack.packb({"v": WIRE_VERSION, "t": "abort", "d": [b"\x91" * 50]}),
        msgpack.packb({"v": 2**64 - 1, "t": 5, "d": None}),
        msgpack.packb({"v": WIRE_VERSION, "t": "abort", "d": {b"request_id": "x"}}),
        msgpack.packb({"v": WIRE_VERSION, "t": "tokens", "d": {"request_id": "x", "index": 0}}),
        b"\xc1",
        b"",
    ],
)
def test_any_bad_input_is_a_wire_error(frame):
    with pytest.raises(WireError):
        decode(frame)


def test_a_decoded_value_is_not_checked_again(monkeypatch):
    frame = encode(_prefill())
    calls = []
    convert = msgspec.convert
    monkeypatch.setattr(msgspec, "convert", lambda *a, **k: calls.append(a) or convert(*a, **k))
    assert decode(frame) == _prefill()
    assert len(calls) == 2  # the two `_prefill()`s built here, none for the decoded one


def test_python_construction_checks_and_normalizes():
    sp = SamplingParams(stop_token_ids=[3, 4], logit_bias=[[1, 2]], structured=["regex", "a"])
    assert sp.stop_token_ids == (3, 4) and sp.logit_bias == ((1, 2.0),)
    assert sp.structured == ("regex", "a")
    with pytest.raises(ValueError, match="n"):
        msgspec.structs.replace(sp, n=0)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match="one entry per token"):
        TokenMessage("r", 0, [1, 2], logprobs=[(-1.0, 1, [])])


def test_trusted_construction_skips_the_field_check_but_not_check():
    """The engine builds its per-token records with `trusted` (its own values): the field
    validation is skipped, the cross-field `check()` still runs, and the flag does not leak."""
    from engine.protocol import trusted

    fast = trusted(TokenMessage, "r", 0, [1, 2], None)
    assert fast.token_ids == [1, 2]
    with pytest.raises(ValueError, match="handoff"):
        trusted(TokenMessage, "r", 0, [1], None, handoff=True)
    with pytest.raises(ValueError):  # outside `trusted` the fields are checked again
        TokenMessage("r", -1, [1], None)
    # A decode inside a trusted build leaves the flag as it found it.
    frame = encode(TokenMessage("r", 0, [1], None))
    assert decode(frame).token_ids == [1]
    with pytest.raises(ValueError):
        TokenMessage("", 0, [1], None)


def test_allowed_and_bad_words_cross_the_wire():
    sp = SamplingParams(allowed_token_ids=[5, 9, 2**31 - 1], bad_words_token_ids=[[7], [8, 9, 10]])
    assert sp.allowed_token_ids == (5, 9, 2**31 - 1)
    assert sp.bad_words_token_ids == ((7,), (8, 9, 10))
    for msg in (
        PrefillRequest("p", [1, 2, 3], sp, _EP, "decode-0", _EP),
        GenerateRequest("g", [1, 2, 3], sp, _EP),
    ):
        back = decode(encode(msg), expect=type(msg))
        assert back == msg and back.sampling.needs_processing
        assert back.sampling.bad_words_token_ids == ((7,), (8, 9, 10))
        assert back.sampling.allowed_token_ids == (5, 9, 2**31 - 1)
    # At the caps: 1024 words of 256 tokens.
    full = SamplingParams(bad_words_token_ids=(tuple(range(256)),) * 1024)
    assert decode(encode(GenerateRequest("g", [1], full, _EP))).sampling == full


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("allowed_token_ids", (3, -1)),
        ("allowed_token_ids", (2**31,)),
        ("bad_words_token_ids", ((),)),  # an empty word
        ("bad_words_token_ids", ((4,), (5, -2))),
        ("bad_words_token_ids", (tuple(range(257)),)),  # a word over 256 tokens
        ("bad_words_token_ids", ((4,),) * 1025),  # over 1024 words
    ],
)
def test_allowed_and_bad_words_out_of_range_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    # The same values from a peer: a WireError at the field.
    with pytest.raises(WireError, match=rf"\$.sampling.{field}"):
        decode(_frame("prefill", _body(_prefill()) | {"sampling": {field: value}}))


def test_fields_left_at_their_defaults_are_not_sent_so_an_older_peer_reads_the_frame():
    """A rolling upgrade: a peer whose SamplingParams predates a field (here: only two fields)
    reads frames that leave the new fields at their defaults, and refuses by name one that
    sets them."""

    class OlderSampling(protocol.Frame, frozen=True):
        max_tokens: int = 16
        temperature: float = 1.0

    plain = msgspec.msgpack.encode(SamplingParams(max_tokens=5, temperature=0.5))
    assert msgspec.msgpack.decode(plain, type=OlderSampling) == OlderSampling(5, 0.5)
    salted = msgspec.msgpack.encode(SamplingParams(max_tokens=5, cache_salt="tenant"))
    with pytest.raises(msgspec.ValidationError, match="cache_salt"):
        msgspec.msgpack.decode(salted, type=OlderSampling)
