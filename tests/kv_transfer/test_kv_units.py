"""Unit tests without NIXL processes: the state enum, messages, descriptors."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from engine.kv_cache import KVCacheSpec
from engine.protocol import SamplingParams, WireError, encode
from engine.protocol import decode as decode_frame
from kv_transfer.errors import TransferError, differing_fields
from kv_transfer.messages import (
    MAX_KVREADY_BYTES,
    PROTOCOL_VERSION,
    AgentMetadata,
    HelloReply,
    InvalidTransition,
    KVReady,
    PrefixPull,
    Released,
    RenewReply,
    TransferState,
    TransferStats,
    TransferStatus,
)
from kv_transfer.nixl import (
    CUDA_IPC_GET_ENV,
    BlockRegion,
    allow_cuda_ipc_reads,
    check_block_ids,
    chunk,
    default_max_read_bytes,
)

S = TransferState


def test_states_are_ordered():
    assert S.FAILED < S.PENDING < S.TRANSFERRING < S.DONE


def test_status_only_moves_forward():
    st = TransferStatus()
    st.advance(S.TRANSFERRING)
    with pytest.raises(InvalidTransition):
        st.advance(S.PENDING)
    with pytest.raises(InvalidTransition):
        st.advance(S.TRANSFERRING)
    st.advance(S.DONE)
    with pytest.raises(InvalidTransition):
        st.fail("too late")
    assert st.state is S.DONE and st.reason is None


@pytest.mark.parametrize("start", [S.PENDING, S.TRANSFERRING])
def test_failed_is_sticky_and_keeps_its_first_reason(start):
    st = TransferStatus(start)
    assert st.fail("peer died")
    assert not st.fail("second reason")
    assert (st.state, st.reason) == (S.FAILED, "peer died")
    for target in (S.PENDING, S.TRANSFERRING, S.DONE):
        with pytest.raises(InvalidTransition):
            st.advance(target)
    with pytest.raises(InvalidTransition):
        st.advance(S.FAILED)
    with pytest.raises(ValueError):
        TransferStatus(S.FAILED)  # FAILED always carries a reason


def test_every_sequence_of_moves_is_monotone():
    import itertools

    for seq in itertools.product(list(S), repeat=4):
        st = TransferStatus()
        seen = [st.state]
        for target in seq:
            try:
                st.fail("x") if target is S.FAILED else st.advance(target)
            except InvalidTransition:
                pass
            seen.append(st.state)
        terminal_at = next((i for i, s in enumerate(seen) if s.terminal), None)
        if terminal_at is not None:
            assert all(s is seen[terminal_at] for s in seen[terminal_at:])
        live = seen[: terminal_at if terminal_at is not None else len(seen)]
        assert live == sorted(live)


def _md(**kw) -> AgentMetadata:
    spec = KVCacheSpec("LlamaForCausalLM", 2, 2, 64, 16, torch.bfloat16)
    d = {
        "name": "p0",
        "instance_id": "abc",
        "endpoint": "tcp://127.0.0.1:5555",
        "protocol_version": PROTOCOL_VERSION,
        "compat_hash": spec.compat_hash(),
        "compat_fields": spec.compat_fields(),
        "num_blocks": 100,
        "mem_type": "DRAM",
    }
    d.update(kw)
    return AgentMetadata(**d)


def _kv_ready(**kw) -> KVReady:
    d = {
        "request_id": "r1",
        "prompt_token_ids": list(range(40)),
        "sampling": SamplingParams(max_tokens=5, temperature=0.0),
        "first_token": 9,
        "reply_to": "tcp://router:1",
        "prefill_worker_id": "prefill-0",
        "sender": _md(),
        "block_ids": [4, 9, 2],
        "num_tokens": 40,
        "lease_deadline": time.time() + 10,
    }
    d.update(kw)
    return KVReady(**d)


def test_kv_ready_round_trips_through_the_wire():
    msg = _kv_ready()
    back = decode_frame(encode(msg), MAX_KVREADY_BYTES, expect=KVReady)
    assert back == msg
    assert isinstance(back.sender, AgentMetadata) and isinstance(back.sampling, SamplingParams)
    assert AgentMetadata.coerce(msg.sender.to_dict()) == msg.sender


@pytest.mark.parametrize(
    "bad",
    [
        {"block_ids": [4, 9]},  # 2 blocks of 16 cannot hold 40 tokens
        {"block_ids": [4, 4, 2]},
        {"block_ids": [4, 9, 100]},  # beyond the sender's cache
        {"first_token": -1},
        {"request_id": ""},
        {"lease_deadline": float("nan")},
        {"num_tokens": 0},
    ],
)
def test_kv_ready_rejects_bad_fields(bad):
    with pytest.raises(ValueError):
        _kv_ready(**bad)
    frame = encode(_kv_ready())
    import msgpack

    outer = msgpack.unpackb(frame)
    outer["d"].update(bad)
    with pytest.raises(WireError):
        decode_frame(msgpack.packb(outer), MAX_KVREADY_BYTES)


def test_prefix_pull_carries_the_cache_salt_and_a_frame_without_one_is_unsalted():
    import msgpack

    pull = PrefixPull("r/prefix", [1, 2, 3], 0, "reader", "tcp://127.0.0.1:9", cache_salt="t1")
    assert decode_frame(encode(pull), expect=PrefixPull).cache_salt == "t1"
    outer = msgpack.unpackb(encode(pull))
    del outer["d"]["cache_salt"]  # a peer that predates salts
    assert decode_frame(msgpack.packb(outer), expect=PrefixPull).cache_salt is None
    outer["d"]["cache_salt"] = ""
    with pytest.raises(WireError):
        decode_frame(msgpack.packb(outer))


def test_oversized_and_wrong_type_frames_are_refused():
    frame = encode(_kv_ready())
    with pytest.raises(WireError, match="limit"):
        decode_frame(frame, len(frame) - 1)
    with pytest.raises(WireError, match="expected"):
        decode_frame(frame, MAX_KVREADY_BYTES, expect=RenewReply)


def test_agent_metadata_validation():
    with pytest.raises(ValueError):
        _md(endpoint="http://x")
    with pytest.raises(ValueError):
        _md(mem_type="HBM")
    with pytest.raises(ValueError, match="unknown fields"):
        AgentMetadata.coerce(_md().to_dict() | {"extra": 1})


def test_renew_reply_and_hello_reply_validation():
    with pytest.raises(ValueError):
        RenewReply(1, ["a"], ["ok", "ok"], [1.0])
    with pytest.raises(ValueError):
        RenewReply(1, ["a"], ["maybe"], [1.0])
    with pytest.raises(ValueError):
        HelloReply(ok=True, name="x", instance_id="y")  # accepting needs metadata + bases


def test_differing_fields_names_the_fields():
    a = {"block_size": "16", "kv_dtype": "auto", "model": "M"}
    b = {"block_size": "32", "kv_dtype": "auto", "layout": "other"}
    assert differing_fields(a, b) == ["block_size", "layout", "model"]


def test_region_descriptors_and_indices():
    r = BlockRegion("DRAM", 0, 4, 1000, 10, scales_base=5000, scale_block_bytes=2)
    rows = r.descriptors()
    assert rows.shape == (8, 3) and rows.dtype == np.uint64
    assert rows[:4, 0].tolist() == [1000, 1010, 1020, 1030]
    assert rows[4:, 0].tolist() == [5000, 5002, 5004, 5006]
    assert set(rows[:, 2].tolist()) == {0}
    assert r.indices([3, 1]).tolist() == [3, 1, 7, 5]
    with pytest.raises(ValueError):
        r.indices([4])
    assert BlockRegion("DRAM", 0, 4, 1000, 10).indices([2]).tolist() == [2]
    assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def test_events_and_stats():
    with pytest.raises(ValueError):
        Released("r", (1,), "because")
    s = TransferStats(bytes_read=2_000_000_000, seconds=0.5)
    assert s.gbps == pytest.approx(4.0)
    assert s.to_dict()["gbps"] == pytest.approx(4.0)
    assert TransferError("r9", "peer gone").request_id == "r9"


def test_wildcard_bind_is_advertised_under_a_routable_host():
    from kv_transfer.side_channel import advertised_endpoint

    assert advertised_endpoint("tcp://127.0.0.1:5000", None) == "tcp://127.0.0.1:5000"
    assert advertised_endpoint("tcp://0.0.0.0:5000", "10.0.0.7") == "tcp://10.0.0.7:5000"
    assert not advertised_endpoint("tcp://0.0.0.0:5000", None).startswith("tcp://0.0.0.0")


def test_reads_are_chunked_small_in_host_memory_and_large_in_vram():
    host, vram = (
        default_max_read_bytes(torch.device("cpu")),
        default_max_read_bytes(torch.device("cuda", 0)),
    )
    assert host == 64 << 20  # bounds how long one poll() copies on CPU
    assert vram >= 1 << 30  # a VRAM post only enqueues copies; few READs keep the bandwidth


def test_cuda_ipc_reads_are_allowed_unless_the_operator_said_otherwise(monkeypatch):
    monkeypatch.delenv(CUDA_IPC_GET_ENV, raising=False)
    allow_cuda_ipc_reads()
    assert os.environ[CUDA_IPC_GET_ENV] == "y"
    monkeypatch.setenv(CUDA_IPC_GET_ENV, "n")
    allow_cuda_ipc_reads()
    assert os.environ[CUDA_IPC_GET_ENV] == "n"


@pytest.mark.parametrize(
    "ids, why",
    [
        ([1, True, 2], "ints"),
        ([1, 2.0], "ints"),
        (["1"], "ints"),
        ([np.bool_(True)], "ints"),
        ([0, 8], "in \\[0, 8\\)"),
        ([-1], "in \\[0, 8\\)"),
        ([3, 3], "repeat"),
        ([], "non-empty"),
        ("012", "non-empty list"),
    ],
)
def test_block_ids_are_checked_before_any_read(ids, why):
    """Block ids are checked by their distinct types (fast for a 1024-block READ), and still
    refuse a bool among ints, a float, a str, an id out of range or repeated."""
    with pytest.raises(TransferError, match=why) as err:
        check_block_ids("req-7", ids, 8)
    assert err.value.request_id == "req-7"


def test_block_ids_accept_python_and_numpy_ints():
    ids = [0, np.int64(5), np.int32(7), 2]
    out = check_block_ids("r", ids, 8)
    assert out == (0, 5, 7, 2) and all(type(b) is int for b in out)
