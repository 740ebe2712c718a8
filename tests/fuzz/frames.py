"""Hypothesis strategies for ZMQ frames sent to a worker's request socket (PULL) and to a KV
agent's side channel (ROUTER), and what each receiver must do with them.

A draw is a list of ZMQ parts (one message): random bytes; valid msgpack of any shape (maps
with int keys, ext types, NaN, 2**64-1, deep nesting); real tandem frames (every message type
of engine/protocol.py and kv_transfer/messages.py, encoded by engine/protocol.py's codec) with
one thing broken: a field of the wrong type or out of range, a missing or unknown field, a bad
version or tag, a nested SamplingParams / AgentMetadata gone wrong; oversized frames (over the
1 MiB limit, under ZMQ's 4x disconnect cap); several parts at once.

The oracles use the real decoder (engine.protocol.decode) on each part:
- `worker_counts(part)`: the worker must count the part in tandem_worker_bad_frames_total
  (True) or take it quietly (False: an AbortRequest for an unknown id). None: the part is a
  request that would run, or a Shutdown, which the fuzz does not send.
- `side_channel_answer(parts)`: a side channel answers every message with exactly one frame:
  a HelloReply for a Hello (refused: the fuzz never knows the peer's layout), else an
  ErrorReply.
"""

from __future__ import annotations

import copy
import re

import msgpack
from hypothesis import strategies as st

from engine.protocol import (
    WIRE_VERSION,
    AbortRequest,
    GenerateRequest,
    PrefillRequest,
    SamplingParams,
    Shutdown,
    TokenMessage,
    decode,
    encode,
)
from kv_transfer.messages import (
    Abort,
    AgentMetadata,
    ErrorReply,
    Hello,
    HelloReply,
    KVReady,
    PrefixOffer,
    PrefixPull,
    ReadComplete,
    Renew,
    RenewReply,
)

FRAME_LIMIT = 1 << 20  # --max-frame-mb 1 and kv_transfer.messages.MAX_SIDE_FRAME_BYTES
_NOWHERE = "tcp://127.0.0.1:9"  # the discard port: nothing listens


def templates() -> list:
    """One valid message of every type the two sockets could see (Shutdown left out)."""
    sp = SamplingParams(max_tokens=4)
    agent = AgentMetadata(
        name="fuzz-agent",
        instance_id="i0",
        endpoint=_NOWHERE,
        protocol_version=1,
        compat_hash="h",
        compat_fields={"block_size": "16"},
        num_blocks=64,
        mem_type="DRAM",
    )
    ids = [1, 2, 3]
    return [
        GenerateRequest(request_id="fz-g", prompt_token_ids=ids, sampling=sp, reply_to=_NOWHERE),
        PrefillRequest(
            request_id="fz-p",
            prompt_token_ids=ids,
            sampling=sp,
            reply_to=_NOWHERE,
            decode_worker_id="decode-0",
            decode_endpoint=_NOWHERE,
        ),
        TokenMessage(request_id="fz-t", index=0, token_ids=[5]),
        AbortRequest(request_id="fz-a"),
        KVReady(
            request_id="fz-k",
            prompt_token_ids=ids,
            sampling=sp,
            first_token=7,
            reply_to=_NOWHERE,
            prefill_worker_id="prefill-0",
            sender=agent,
            block_ids=[0],
            num_tokens=3,
            lease_deadline=1e9,
        ),
        Hello(
            protocol_version=1,
            name="fuzz-peer",
            instance_id="i1",
            compat_hash="h",
            compat_fields={"model": "none"},
        ),  # fmt: skip
        HelloReply(ok=False, name="n", instance_id="i"),
        Renew(seq=1, request_ids=["fz-r"]),
        RenewReply(seq=1, request_ids=["fz-r"], statuses=["ok"], remaining_s=[1.0]),
        Abort(request_id="fz-x"),
        ErrorReply(message="m"),
        ReadComplete(request_id="fz-c"),
        agent,
        PrefixPull(
            pull_id="fz-pp/prefix",
            prompt_token_ids=ids,
            first_block=0,
            reader="fuzz-peer",
            reply_to=_NOWHERE,
            cache_salt="fuzz-salt",
        ),  # fmt: skip
        PrefixOffer(pull_id="fz-po/prefix", sender=agent, block_ids=[1], lease_deadline=1e9),
    ]


_TEMPLATES = [msgpack.unpackb(encode(m)) for m in templates()]


def _frame(tag: str, body: dict) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, "t": tag, "d": body}, use_bin_type=True)


def _known_bad() -> dict[str, list[bytes]]:
    """Frames that broke a receiver once: every run sends them first (hypothesis examples)."""
    by_tag = {t["t"]: t["d"] for t in _TEMPLATES}
    generate, kv_ready = by_tag["generate"], by_tag["kvx.kv_ready"]
    return {
        "sampling-not-a-map": [_frame("generate", {**generate, "sampling": 5})],
        "sampling-bad-value": [
            _frame("generate", {**generate, "sampling": {"presence_penalty": {}}})
        ],
        "kv-ready-sampling-bad-value": [
            _frame("kvx.kv_ready", {**kv_ready, "sampling": {"max_tokens": "x"}})
        ],
        "str-and-bytes-field-names": [_frame("abort", {"request_id": "x", b"k": 1, "z": 2})],
    }


KNOWN_BAD = _known_bad()

MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.sampled_from([-1, 2**31, 2**62 + 1, 2**63, 2**64 - 1, 10**6, "", b"", [], {}])
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=12))
    | st.builds(msgpack.Timestamp, st.integers(0, 2**32 - 1), st.integers(0, 999_999_999)),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.text(max_size=8) | st.integers(-5, 5) | st.binary(max_size=4), inner, max_size=4
        )
    ),
    max_leaves=8,
)


@st.composite
def _broken_frame(draw) -> bytes:
    outer = copy.deepcopy(draw(st.sampled_from(_TEMPLATES)))
    body = outer["d"]
    nested = [k for k, v in body.items() if isinstance(v, dict)]
    how = draw(
        st.sampled_from(["field", "drop", "unknown", "version", "tag", "body", "outer", "nested"])
    )
    if how == "field" or (how == "nested" and not nested):
        body[draw(st.sampled_from(sorted(body)))] = draw(MSGPACK_VALUES)
    elif how == "drop":
        del body[draw(st.sampled_from(sorted(body)))]
    elif how == "unknown":
        body[draw(st.text(min_size=1, max_size=10))] = draw(MSGPACK_VALUES)
    elif how == "version":
        outer["v"] = draw(MSGPACK_VALUES.filter(lambda v: v != WIRE_VERSION))
    elif how == "tag":
        outer["t"] = draw(
            MSGPACK_VALUES | st.sampled_from(["generate ", "GENERATE", "kvx.", "tokens"])
        )
    elif how == "body":
        outer["d"] = draw(MSGPACK_VALUES)
    elif how == "outer":
        outer[draw(st.text(max_size=3))] = draw(MSGPACK_VALUES)
    else:
        inner = body[draw(st.sampled_from(nested))]
        inner[draw(st.sampled_from(sorted(inner)) | st.text(max_size=6))] = draw(MSGPACK_VALUES)
    return msgpack.packb(outer, use_bin_type=True)


def _oversized(n: int) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, "t": "abort", "d": {"request_id": "x" * n}})


SMALL_PART = st.one_of(
    st.binary(max_size=300),
    MSGPACK_VALUES.map(lambda v: msgpack.packb(v, use_bin_type=True)),
    _broken_frame(),
    _broken_frame(),  # twice the weight: the frames closest to real ones
    st.integers(1, 200_000).map(lambda n: b"\x91" * n + b"\xc0"),  # arrays nested n deep
)
ONE_PART = st.one_of(
    SMALL_PART,
    st.integers(FRAME_LIMIT + 1, 2 * FRAME_LIMIT).map(_oversized),
    st.integers(FRAME_LIMIT + 1, 2 * FRAME_LIMIT).map(lambda n: b"\x00" * n),
)
MESSAGES = st.one_of(
    ONE_PART.map(lambda p: [p]),
    ONE_PART.map(lambda p: [p]),
    st.lists(SMALL_PART, min_size=2, max_size=4),
)


def _decoded(part: bytes):
    try:
        return decode(part, FRAME_LIMIT)
    except Exception:  # noqa: BLE001 - any refusal: WireError today, others count as bad too
        return None


def worker_counts(part: bytes) -> bool | None:
    msg = _decoded(part)
    # Requests, hand-offs and prefix pulls (a worker answers or reads them) act, not count.
    acting = GenerateRequest | PrefillRequest | KVReady | Shutdown | PrefixPull | PrefixOffer
    if isinstance(msg, acting):
        return None
    return not isinstance(msg, AbortRequest)


def worker_messages() -> st.SearchStrategy[list[bytes]]:
    return MESSAGES.filter(lambda parts: all(worker_counts(p) is not None for p in parts))


def side_channel_answer(parts: list[bytes]) -> type:
    if len(parts) == 1 and isinstance(_decoded(parts[0]), Hello):
        return HelloReply
    return ErrorReply


def bad_frame_counts(metrics: dict[str, float]) -> dict[str, float]:
    """worker id -> tandem_worker_bad_frames_total, from ServeProcess.metrics()."""
    out = {}
    for key, value in metrics.items():
        m = re.match(r'tandem_worker_bad_frames_total\{.*worker="([^"]+)"', key)
        if m:
            out[m[1]] = value
    return out
