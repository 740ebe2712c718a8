"""The prefill and decode worker loops with real engines, real ZMQ sockets and real NIXL
agents (in one process, no Ray): the hand-off path produces exactly the colocated engine's
tokens, a decode worker with no room lets the lease lapse and recomputes, an abort that
reaches the decode worker before the KV hand-off releases the prefill worker's blocks at
once, and every KV block comes back on both sides."""

from __future__ import annotations

import itertools
import time

import pytest
import zmq

from decode_worker.server import decode_server
from engine import LLM, SamplingParams
from engine.llm_engine import EngineConfig, LLMEngine
from engine.protocol import (
    AbortRequest,
    GenerateRequest,
    PrefillRequest,
    TokenMessage,
    decode,
    encode,
)
from kv_transfer.agent import KVTransferAgent
from prefill_worker.server import prefill_server

_names = itertools.count()


class Pair:
    def __init__(
        self, model, lease_seconds=10.0, decode_blocks=None, start_decode=True,
        prefill_kw=None, decode_kw=None, decode_faults=None,
    ):  # fmt: skip
        n = next(_names)
        kw = dict(model=str(model), dtype="float32", max_num_batched_tokens=128)
        pkw = {"num_kv_blocks": 64, **(prefill_kw or {})}
        pe = LLMEngine(EngineConfig(**kw, role="prefill", **pkw))
        dkw = {"num_kv_blocks": decode_blocks or 64, **(decode_kw or {})}
        de = LLMEngine(EngineConfig(**kw, role="decode", **dkw))
        self.p = prefill_server(
            f"p{n}", pe, KVTransferAgent(f"p{n}", pe.cache, lease_seconds=lease_seconds)
        )
        d_agent = KVTransferAgent(
            f"d{n}", de.cache, lease_seconds=lease_seconds, faults=decode_faults
        )
        self.d = decode_server(f"d{n}", de, d_agent)
        self.ctx = zmq.Context()
        self.sink = self.ctx.socket(zmq.PULL)
        self.sink.bind("tcp://127.0.0.1:*")
        self.reply_to = self.sink.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.push = {ep: self._push(ep) for ep in (self.p.endpoint, self.d.endpoint)}
        self.p.start()
        if start_decode:
            self.d.start()

    def _push(self, ep):
        s = self.ctx.socket(zmq.PUSH)
        s.connect(ep)
        return s

    def prefill(self, rid, prompt, sp):
        msg = PrefillRequest(rid, prompt, sp, self.reply_to, self.d.worker_id, self.d.endpoint)
        self.push[self.p.endpoint].send(encode(msg))

    def generate_on_decode(self, rid, prompt, sp):
        msg = GenerateRequest(rid, prompt, sp, self.reply_to)
        self.push[self.d.endpoint].send(encode(msg))

    def abort_on_decode(self, rid):
        self.push[self.d.endpoint].send(encode(AbortRequest(rid)))

    def collect(self, rids, timeout=60.0) -> dict[str, list[int]]:
        out: dict[str, dict[int, int]] = {r: {} for r in rids}
        done: set[str] = set()
        deadline = time.time() + timeout
        while done != set(rids):
            assert time.time() < deadline, f"timed out; got {out}"
            if not self.sink.poll(100):
                continue
            m = decode(self.sink.recv(), expect=TokenMessage)
            assert m.finish_reason != "error", m.error
            if m.request_id not in out:
                continue  # e.g. the first token of a request aborted meanwhile
            for i, t in enumerate(m.token_ids):
                out[m.request_id][m.index + i] = t
            if m.finish_reason:
                done.add(m.request_id)
        return {r: [v[i] for i in sorted(v)] for r, v in out.items()}

    def wait_free(self, timeout=15.0):
        """Every block back, and neither worker still tracking a request it no longer
        streams (reply endpoints, open choices and the connectors' transfer records are
        per-request state that must not leak)."""
        deadline = time.time() + timeout
        pb, db = self.p.engine.block_manager, self.d.engine.block_manager
        servers = (self.p, self.d)
        tracked = lambda: [s.reply_to or s.open_choices or s.connector.requests for s in servers]  # noqa: E731
        while time.time() < deadline:
            if pb.num_free_blocks == pb.num_blocks and db.num_free_blocks == db.num_blocks:
                if not any(tracked()):
                    return
            time.sleep(0.05)
        raise AssertionError(
            f"blocks held: prefill {pb.num_blocks - pb.num_free_blocks}, "
            f"decode {db.num_blocks - db.num_free_blocks}; still tracked: {tracked()}"
        )

    def close(self):
        self.p.stop()
        if self.d._thread is None:
            self.d.close()
        else:
            self.d.stop()
        self.sink.close(0)
        for s in self.push.values():
            s.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def model(make_tiny_model):
    return make_tiny_model("qwen3")


def _prompts():
    import torch

    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (20, 33, 70, 100)]


SP = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(model):
    return [o.token_ids for o in LLM(model, dtype="float32").generate(_prompts(), SP)]


def test_handoff_matches_colocated_engine(model, expected):
    pair = Pair(model)
    try:
        rids = [f"r{i}" for i in range(4)]
        for rid, p in zip(rids, _prompts(), strict=True):
            pair.prefill(rid, p, SP)
        got = pair.collect(rids)
        assert [got[r] for r in rids] == expected
        pair.wait_free()
        assert pair.d.connector.num_remote == 4
        assert pair.p.connector.released_reasons == {"read_done": 4}
    finally:
        pair.close()


def test_lease_lapsed_before_admission_recomputes(model, expected):
    # The decode worker is busy (here: not yet running) while the prefill worker's 0.5 s
    # leases run out: it must not read those blocks; it recomputes the prompts and stays exact.
    pair = Pair(model, lease_seconds=0.5, start_decode=False)
    try:
        rids = [f"r{i}" for i in range(4)]
        for rid, p in zip(rids, _prompts(), strict=True):
            pair.prefill(rid, p, SP)
        deadline = time.time() + 20
        while pair.p.connector.released_reasons.get("lease_expired", 0) < 4:
            assert time.time() < deadline, pair.p.connector.released_reasons
            time.sleep(0.05)
        pair.d.start()
        got = pair.collect(rids)
        assert [got[r] for r in rids] == expected
        pair.wait_free()
        assert pair.d.connector.num_recomputed == 4 and pair.d.connector.num_remote == 0
    finally:
        pair.close()


def test_abort_before_handoff_releases_prefill_blocks_now(model):
    pair = Pair(model, lease_seconds=30.0)
    try:
        pair.abort_on_decode("gone")
        time.sleep(0.2)  # the abort reaches the decode worker first
        pair.prefill("gone", _prompts()[3], SP)
        pair.prefill("kept", _prompts()[0], SP)
        got = pair.collect(["kept"])
        assert len(got["kept"]) == 12
        pair.wait_free(timeout=10.0)  # far sooner than the 30 s lease
        assert pair.p.connector.released_reasons.get("aborted", 0) == 1
    finally:
        pair.close()


def test_decode_reads_only_the_blocks_its_prefix_cache_lacks(model):
    """Multi-turn reuse on the decode side: the worker answered a prompt's first 64 tokens
    before (a local prefill), so of the next turn's 5 blocks it READs 1 over NIXL (the
    partial last block) and takes 4 from its own cache; the answer equals the colocated
    engine's, and the bytes read are that one block's."""
    from engine.kv_cache import KVCache

    pair = Pair(model)
    try:
        shared = _prompts()[3][:64]
        prompt = shared + _prompts()[1][:9]
        pair.generate_on_decode("earlier", shared + [5, 6], SP)
        pair.collect(["earlier"])
        pair.prefill("next", prompt, SP)
        got = pair.collect(["next"])["next"]
        assert got == LLM(model, dtype="float32").generate([prompt], SP)[0].token_ids
        pair.wait_free()
        conn = pair.d.connector
        assert (conn.num_remote, conn.num_reused_blocks, conn.num_read_blocks) == (1, 4, 1)
        assert conn.agent.stats().bytes_read == KVCache.bytes_per_block(pair.d.engine.cache.spec)
        assert pair.p.connector.released_reasons == {"read_done": 1}
    finally:
        pair.close()


def test_blocks_demoted_and_promoted_while_reads_land(model):
    """Both tiers under pressure during real NIXL READs. The prefill worker has 16 device
    blocks and a host tier; the decode worker reads every block (no decode-side reuse) and
    holds each READ back 0.3 s, so it is in flight while filler prompts evict (demote) the
    prefill worker's other blocks; the next turn's leading blocks come back from the host
    tier (promoted) and are handed off at once. A leased block demoted or overwritten, or a
    promoted one read before its copy, would change the bytes read and so the tokens: all
    answers must equal the colocated engine's, and every block comes back on both sides."""
    host = {"kv_host_cache_gb": 0.01}
    pair = Pair(
        model, prefill_kw={"num_kv_blocks": 16, **host},
        decode_kw={"decode_kv_reuse": False, **host}, decode_faults={"read_delay_s": 0.3},
    )  # fmt: skip
    g = iter(range(10_000))
    fresh = lambda n: [3 + (next(g) * 7919) % 997 for _ in range(n)]  # noqa: E731
    first = fresh(96)
    prompts = {"t1": first, **{f"f{i}": fresh(64) for i in range(4)}}
    prompts["t2"] = first + fresh(20)
    prompts.update({f"g{i}": fresh(48) for i in range(3)})
    try:
        pair.prefill("t1", first, SP)
        got = pair.collect(["t1"])
        for i in range(4):  # t1's blocks leave the device cache for the host tier
            pair.prefill(f"f{i}", prompts[f"f{i}"], SP)
        got |= pair.collect([f"f{i}" for i in range(4)])
        host_cache = pair.p.engine.host_cache
        demoted, promoted = host_cache.demotions, host_cache.promotions
        pair.prefill("t2", prompts["t2"], SP)  # promoted from host, then READ (held back)
        for i in range(3):  # while t2's READ is in flight: more evictions, more demotions
            pair.prefill(f"g{i}", prompts[f"g{i}"], SP)
        got |= pair.collect(["t2", "g0", "g1", "g2"])
        stats = (demoted, promoted, host_cache.stats())
        assert host_cache.promotions > promoted and host_cache.demotions > demoted, stats
        ref = LLM(model, dtype="float32").generate(list(prompts.values()), SP)
        assert [got[r] for r in prompts] == [o.token_ids for o in ref]
        pair.wait_free()
        assert pair.d.connector.num_reused_blocks == 0  # every block READ
        assert pair.p.connector.released_reasons == {"read_done": len(prompts)}
    finally:
        pair.close()
