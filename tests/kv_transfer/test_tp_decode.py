"""The KV hand-off into a tensor-parallel DECODE worker (kv_transfer/tp_read.py): real engines
(fp32, greedy), the decode engine's ranks in their own processes, each READing its own KV heads
with its own NIXL agent on rank 0's orders; rank 0's READ (with the completion notification)
goes last. Token-exact against transformers with the KV really moved (0 recomputes, bytes read
= the prompts' blocks of every decode rank's heads) at (P1, D2), (P2, D2) and, with the tiny
llama's 2 KV heads, (P1, D4) (replicated heads: each decode rank reads the head its query
heads use). A failed READ on one decode rank recomputes the whole request; a decode rank
SIGKILLed mid-stream: every request is correct or ends with an error naming the rank, and the
prefill worker keeps no block; a hung decode rank: the request fails within the hook timeout.
(The group coming back as a new incarnation is tests/e2e/test_serve_tp.py's.)

Harness: tests/kv_transfer/test_tp_handoff.py's (`Decode`, `_prefill`)."""

from __future__ import annotations

import signal
import time

import pytest
import torch
import zmq

from engine.protocol import PrefillRequest, SamplingParams, TokenMessage, decode, encode
from kv_transfer.tp_layout import HeadSlice
from tests.kv_transfer.test_tp_handoff import (
    Decode,
    _blocks,
    _hf_greedy,
    _prefill,
    _prompts,
    _stop,
    _wait_free,
)


def _close(d: Decode) -> None:
    d.close()
    d.engine.shutdown()


@pytest.fixture(scope="module")
def llama(make_tiny_model):
    return make_tiny_model("llama")  # 4 query heads, 2 KV heads, 2 layers


@pytest.fixture(scope="module")
def d2(llama):
    d = Decode(llama, tensor_parallel_size=2)
    yield d
    _close(d)


def _check_moved(d: Decode, p, prompts, before: int, recomputed: int) -> None:
    """0 recomputes, every rank's heads of every prompt block read, every lease released."""
    assert d.server.connector.num_recomputed == recomputed
    per_rank = d.engine.cache.bytes_per_block(d.engine.kv_spec)
    tp = d.engine.config.tensor_parallel_size
    assert d.agent.stats().bytes_read - before == _blocks(prompts) * per_rank * tp
    assert p.connector.released_reasons.get("read_done", 0) == len(prompts)
    _wait_free(p, d.server)


# P1 -> D2 here; P2 -> D2 is served end to end by tests/e2e/test_serve_tp.py (the suite's
# 25 minutes leave no room for both).
@pytest.mark.parametrize(("ptp", "seed"), [(1, 11)])
def test_tp2_decode_reads_its_heads_on_every_rank_token_exact(llama, d2, ptp, seed):
    p = _prefill(llama, ptp)
    try:
        prompts = _prompts(seed)
        before, recomputed = d2.agent.stats().bytes_read, d2.server.connector.num_recomputed
        got = d2.run(p, prompts)
        assert got == [_hf_greedy(str(llama), tuple(q)) for q in prompts]
        _check_moved(d2, p, prompts, before, recomputed)
    finally:
        _stop(p)


def test_tp4_decode_with_replicated_heads_is_token_exact(llama):
    d = Decode(llama, tensor_parallel_size=4)  # 2 KV heads: ranks 0,1 hold head 0; 2,3 head 1
    p = _prefill(llama, 1)
    try:
        prompts = _prompts(13)
        got = d.run(p, prompts)
        assert got == [_hf_greedy(str(llama), tuple(q)) for q in prompts]
        _check_moved(d, p, prompts, 0, 0)
    finally:
        _stop(p)
        _close(d)


def test_a_failed_read_on_a_decode_rank_recomputes_the_whole_request(llama):
    """`fail_reads=1` reaches every decode rank (its own counter): rank 1's READ post fails
    first, so rank 0 never posts its own; the request is recomputed whole (no partial KV is
    used), nothing is counted as read, and neither side keeps a block."""
    d = Decode(llama, tensor_parallel_size=2, faults={"fail_reads": 1})
    p = _prefill(llama, 1)
    try:
        prompts = _prompts(14)[:1]
        assert d.run(p, prompts) == [_hf_greedy(str(llama), tuple(prompts[0]))]
        assert d.server.connector.num_recomputed == 1
        assert d.agent.stats().bytes_read == 0
        _wait_free(p, d.server)
    finally:
        _stop(p)
        _close(d)


def _stream(d: Decode, p, prompts, sp, on_token, timeout=60.0) -> dict[str, tuple]:
    """Send `prompts` through `p` to `d`; per request (tokens, finish reason, error)."""
    push = d.ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(p.endpoint)
    rids = [f"f{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    try:
        for rid, q in zip(rids, prompts, strict=True):
            msg = PrefillRequest(rid, q, sp, d.reply_to, d.server.worker_id, d.server.endpoint)
            push.send(encode(msg))
        got = {r: ({}, None, "") for r in rids}
        deadline = time.time() + timeout
        while any(v[1] is None for v in got.values()):
            assert time.time() < deadline, f"timed out; got {got}"
            if not d.sink.poll(100):
                continue
            m = decode(d.sink.recv(), expect=TokenMessage)
            toks, _, _ = got[m.request_id]
            for i, t in enumerate(m.token_ids):
                toks[m.index + i] = t
            on_token(m)
            if m.finish_reason:
                got[m.request_id] = (toks, m.finish_reason, m.error or "")
        return {r: ([v[0][i] for i in sorted(v[0])], v[1], v[2]) for r, v in got.items()}
    finally:
        push.close(0)


def test_a_decode_rank_killed_mid_stream_fails_clearly_and_frees_every_lease(llama):
    """Rank 1 of a D2 group is SIGKILLed while 3 requests stream from it (each has its KV
    moved and tokens out): each request's tokens are transformers' up to where it stopped,
    and it ends either complete or with an error naming the dead rank; the loop reports the
    group down once (a Ray worker exits on it and is replaced: tests/e2e/test_serve_tp.py);
    the prefill worker keeps no block."""
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    d = Decode(llama, tensor_parallel_size=2)
    d.server.step_delay_s = 0.02  # streams last ~1 s: the kill lands mid-stream
    told: list[Exception] = []  # what a Ray worker exits on, to be replaced (worker_actor.py)
    d.server.on_group_down = told.append
    p = _prefill(llama, 1)
    try:
        prompts = _prompts(15)
        rank1, killed_at = d.engine.tp.procs[0], []

        def kill_after_some_tokens(m: TokenMessage) -> None:
            if not killed_at and m.index >= 4:
                rank1.send_signal(signal.SIGKILL)
                killed_at.append(time.monotonic())

        got = _stream(d, p, prompts, sp, kill_after_some_tokens)
        assert killed_at and rank1.wait(5) == -signal.SIGKILL
        want = {tuple(q): _hf_greedy_n(llama, q, sp.max_tokens) for q in prompts}
        errors = 0
        for q, (toks, reason, error) in zip(prompts, got.values(), strict=True):
            assert toks == want[tuple(q)][: len(toks)], "a token after the kill is wrong"
            if reason == "error":
                errors += 1
                assert "tensor-parallel group is down" in error and "rank 1" in error, error
            else:
                assert toks == want[tuple(q)]
        assert errors, "the kill landed after every request finished"
        assert len(told) == 1 and "rank 1" in str(told[0]), told
        _wait_free(p)  # the prefill worker keeps no block
        print(f"decode rank killed -> prefill blocks free {time.monotonic() - killed_at[0]:.1f} s")
    finally:
        _stop(p)
        _close(d)


def test_a_hung_decode_rank_fails_the_request_clearly_and_frees_the_lease(llama, monkeypatch):
    """Rank 1 of a D2 group is stopped (SIGSTOP) before a READ order reaches it: rank 0 waits
    `HOOK_TIMEOUT_S` (2 s here) for the order to reach it, not the 120 s collective timeout;
    the READ fails, the group is down, the request ends with an error naming the timeout, and
    the prefill worker's lease is released (no block kept on the prefill side)."""
    import engine.distributed

    monkeypatch.setattr(engine.distributed, "HOOK_TIMEOUT_S", 2.0)
    d = Decode(llama, tensor_parallel_size=2)
    p = _prefill(llama, 1)
    rank1 = d.engine.tp.procs[0]
    try:
        prompts = _prompts(16)
        assert d.run(p, prompts[:1]) == [_hf_greedy(str(llama), tuple(prompts[0]))]
        rank1.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        sp = SamplingParams(max_tokens=4, temperature=0)
        got = _stream(d, p, prompts[1:2], sp, lambda m: None)
        took = time.monotonic() - t0
        [(toks, reason, error)] = got.values()
        assert toks == _hf_greedy(str(llama), tuple(prompts[1]))[: len(toks)], got
        assert reason == "error" and "tensor-parallel group is down" in error, got
        assert "Timed out waiting 2000ms" in error, error  # the order's broadcast, not 120 s
        assert took < 15, took
        print(f"hung decode rank -> the request's error after {took:.1f} s")
        _wait_free(p)
    finally:
        rank1.send_signal(signal.SIGKILL)
        _stop(p)
        _close(d)


def _hf_greedy_n(llama, prompt, n: int) -> list[int]:
    from tests.kv_transfer.test_tp_handoff import _hf_model

    model = _hf_model(str(llama))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


# ---------------------------------------------------------------- the pure parts


@pytest.mark.parametrize(
    ("ptp", "dtp", "want"),
    [
        (1, 2, [[HeadSlice(0, 0, 0, 1)], [HeadSlice(0, 1, 0, 1)]]),  # halves of P's blocks
        (2, 2, [[HeadSlice(0, 0, 0, 1)], [HeadSlice(1, 0, 0, 1)]]),  # whole blocks, rank to rank
        (1, 4, [[HeadSlice(0, 0, 0, 1)]] * 2 + [[HeadSlice(0, 1, 0, 1)]] * 2),  # replicated
    ],
)
def test_each_decode_rank_plans_its_own_heads_from_the_senders_reply(llama, ptp, dtp, want):
    """What each decode rank's RankConnect computes (handshake.slice_plan for its rank), from
    the same HelloReply rank 0 received: its heads, the sender ranks' agents and bases."""
    from engine.config import ModelConfig
    from engine.kv_setup import kv_spec_for
    from engine.llm_engine import EngineConfig
    from engine.models.parallel import Shard
    from kv_transfer.handshake import slice_plan
    from kv_transfer.messages import HelloReply, RankRegion
    from kv_transfer.nixl import BlockRegion

    mc = ModelConfig.from_pretrained(str(llama))
    cfg = EngineConfig(model=str(llama), dtype="float32")
    src = kv_spec_for(cfg, mc, Shard.of(mc, 0, ptp) if ptp > 1 else None, torch.float32)
    ranks = [RankRegion(rank=r, nixl_metadata=b"m", data_base=1000 * r) for r in range(1, ptp)]
    reply = HelloReply(
        ok=True, name="p", instance_id="i", nixl_metadata=b"m", num_blocks=8, data_base=64,
        block_bytes=src.block_bytes, tp_size=ptp, ranks=ranks,
    )  # fmt: skip
    got = []
    for rank in range(dtp):
        spec = kv_spec_for(cfg, mc, Shard.of(mc, rank, dtp), torch.float32)
        local = BlockRegion("DRAM", 0, 8, 4096, spec.block_bytes)
        plan = slice_plan("p", reply, spec, local, rank)
        got.append(list(plan.slices))
        names = {plan.sources[s.src_rank].name for s in plan.slices}
        assert names <= {"p", "p.tp1"}, names  # each sender rank's own agent
    assert got == want
