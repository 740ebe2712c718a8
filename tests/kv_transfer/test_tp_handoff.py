"""The KV hand-off from a tensor-parallel prefill worker (kv_transfer/tp_layout.py,
tp_rank.py): real engines (fp32, greedy), the prefill engine's ranks in their own processes,
each with its own NIXL agent; the decode worker (TP 1) READs each rank's head slice into its
own head range. Token-exact against transformers with the KV really moved (0 recomputes,
bytes read = the prompts' blocks) at (P1, D1), (P2, D1), (P4, D1) (2 KV heads: replicated
heads read from one holder only), FP8 KV at (P2, D1) (scales split the same way, equal to
the colocated FP8 engine); a failed READ of rank 1's slice recomputes the whole request with
no block left held; a sender whose blocks do not match its declared layout is refused naming
both layouts. Plus the pure parts: the head plan for every pair and the row counts.

One decode server per KV dtype for the module; one prefill engine per TP size."""

from __future__ import annotations

import functools
import itertools
import time

import pytest
import torch
import zmq

from decode_worker.server import decode_server
from engine import LLM, SamplingParams
from engine.llm_engine import EngineConfig, LLMEngine
from engine.protocol import PrefillRequest, TokenMessage, decode, encode
from kv_transfer.agent import KVTransferAgent
from kv_transfer.errors import HandshakeError
from kv_transfer.handshake import slice_plan
from kv_transfer.messages import HelloReply, RankRegion
from kv_transfer.nixl import BlockRegion
from kv_transfer.tp_layout import BlockShape, HeadLayout, HeadSlice, plan_reads, slice_rows
from prefill_worker.server import prefill_server

SP = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
KW = dict(dtype="float32", max_num_batched_tokens=128, num_kv_blocks=64)
_ids = itertools.count()


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (17, 40, 70)]


@functools.cache
def _hf_greedy(path: str, prompt: tuple[int, ...]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = _hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=SP.max_tokens, do_sample=False, pad_token_id=0
        )
    del AutoModelForCausalLM
    return out[0, len(prompt) :].tolist()


@functools.cache
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


class Decode:
    """A decode worker (TP 1, or `tensor_parallel_size=N`: tests/kv_transfer/test_tp_decode.py)
    and the socket its tokens come back on."""

    def __init__(self, model, faults=None, agent=None, **settings):
        n = next(_ids)
        self.engine = LLMEngine(EngineConfig(model=str(model), role="decode", **KW, **settings))
        self.agent = KVTransferAgent(
            f"d{n}", self.engine.cache, faults=faults, tp_group=self.engine.tp, **(agent or {})
        )
        self.server = decode_server(f"d{n}", self.engine, self.agent)
        self.ctx = zmq.Context()
        self.sink = self.ctx.socket(zmq.PULL)
        self.sink.bind("tcp://127.0.0.1:*")
        self.reply_to = self.sink.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.server.start()

    def run(self, prefill, prompts, timeout=60.0) -> list[list[int]]:
        """Prefill `prompts` on `prefill`, hand them here, collect every token."""
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(prefill.endpoint)
        try:
            return self._collect(push, prompts, timeout)
        finally:
            push.close(0)  # also when a check fails: close() must not hang on it

    def _collect(self, push, prompts, timeout) -> list[list[int]]:
        rids = [f"r{next(_ids)}" for _ in prompts]
        for rid, p in zip(rids, prompts, strict=True):
            msg = PrefillRequest(
                rid, p, SP, self.reply_to, self.server.worker_id, self.server.endpoint
            )
            push.send(encode(msg))
        out: dict[str, dict[int, int]] = {r: {} for r in rids}
        done: set[str] = set()
        deadline = time.time() + timeout
        while done != set(rids):
            assert time.time() < deadline, f"timed out; got {out}"
            if not self.sink.poll(100):
                continue
            m = decode(self.sink.recv(), expect=TokenMessage)
            assert m.finish_reason != "error", m.error
            for i, t in enumerate(m.token_ids):
                out[m.request_id][m.index + i] = t
            if m.finish_reason:
                done.add(m.request_id)
        return [[v[i] for i in sorted(v)] for v in (out[r] for r in rids)]

    def close(self):
        self.server.stop()
        self.sink.close(0)
        self.ctx.term()


def _prefill(model, tp: int, **settings):
    n = next(_ids)
    engine = LLMEngine(
        EngineConfig(model=str(model), role="prefill", tensor_parallel_size=tp, **KW, **settings)
    )
    agent = KVTransferAgent(f"p{n}", engine.cache, tp_group=engine.tp)
    server = prefill_server(f"p{n}", engine, agent)
    server.start()
    return server


def _stop(server) -> None:
    server.stop()
    server.engine.shutdown()


def _wait_free(*servers, timeout=15.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        bms = [s.engine.block_manager for s in servers]
        if all(b.num_free_blocks == b.num_blocks for b in bms) and not any(
            s.connector.requests for s in servers
        ):
            return
        time.sleep(0.05)
    raise AssertionError([b.num_blocks - b.num_free_blocks for b in bms])


@pytest.fixture(scope="module")
def llama(make_tiny_model):
    return make_tiny_model("llama")  # 4 query heads, 2 KV heads, 2 layers


@pytest.fixture(scope="module")
def d1(llama):
    d = Decode(llama)
    yield d
    d.close()


def _blocks(prompts, block_size=16) -> int:
    return sum(-(-len(p) // block_size) for p in prompts)


# TP 1 -> 1 is every other hand-off test's case; here the TP senders.
@pytest.mark.parametrize(("tp", "seed"), [(2, 2), (4, 3)])
def test_tp_prefill_to_tp1_decode_is_token_exact_and_moves_the_kv(llama, d1, tp, seed):
    p = _prefill(llama, tp)
    try:
        prompts = _prompts(seed)
        before = d1.agent.stats().bytes_read
        recomputed = d1.server.connector.num_recomputed
        got = d1.run(p, prompts)
        assert got == [_hf_greedy(str(llama), tuple(q)) for q in prompts]
        assert d1.server.connector.num_recomputed == recomputed
        read = d1.agent.stats().bytes_read - before
        assert read == _blocks(prompts) * d1.engine.cache.bytes_per_block(d1.engine.kv_spec)
        assert p.connector.released_reasons.get("read_done", 0) == len(prompts)
        _wait_free(p, d1.server)
    finally:
        _stop(p)


def test_fp8_kv_travels_with_its_scales_from_tp2(llama):
    d = Decode(llama, kv_dtype="fp8_e4m3")
    p = _prefill(llama, 2, kv_dtype="fp8_e4m3")
    try:
        prompts = _prompts(4)
        got = d.run(p, prompts)
        want = LLM(llama, kv_dtype="fp8_e4m3", **KW).generate(prompts, SP)
        assert got == [o.token_ids for o in want]
        assert d.server.connector.num_recomputed == 0
        assert d.agent.stats().bytes_read == _blocks(prompts) * d.engine.cache.bytes_per_block(
            d.engine.kv_spec
        )
        _wait_free(p, d.server)
    finally:
        _stop(p)
        d.close()


def test_a_failed_read_of_one_rank_recomputes_the_whole_request(llama):
    # P2 -> D1 posts rank 1's slice first: failing the first post fails that rank's READ.
    d = Decode(llama, faults={"fail_reads": 1})
    p = _prefill(llama, 2)
    try:
        prompts = _prompts(5)[:1]
        assert d.run(p, prompts) == [_hf_greedy(str(llama), tuple(prompts[0]))]
        assert d.server.connector.num_recomputed == 1
        assert d.agent.stats().bytes_read == 0
        _wait_free(p, d.server)
    finally:
        _stop(p)
        d.close()


def test_a_prefill_rank_killed_during_the_read_costs_a_recompute_not_a_wrong_answer(llama):
    """Rank 1 of a P2 group is SIGKILLed while the decode worker's READ of its slice is held
    back (the handshake done by an earlier request): the request is still answered exactly
    (the dead rank's READ fails and the decode worker recomputes it whole), the decode worker
    keeps no block, and the prefill engine names the dead rank instead of stepping on."""
    import signal
    import threading

    from engine.distributed import TPError

    d = Decode(llama, faults={"read_delay_s": 1.0}, agent={"read_timeout_s": 5.0})
    p = _prefill(llama, 2)
    try:
        prompts = _prompts(6)[:2]
        assert d.run(p, prompts[:1]) == [_hf_greedy(str(llama), tuple(prompts[0]))]
        assert d.server.connector.num_recomputed == 0
        rank1 = p.engine.tp.procs[0]

        def kill_while_the_read_is_held():
            deadline = time.time() + 20
            while not d.server.connector.requests and time.time() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)  # inside the 1 s the READ is held back
            rank1.send_signal(signal.SIGKILL)

        killer = threading.Thread(target=kill_while_the_read_is_held)
        killer.start()
        got = d.run(p, prompts[1:], timeout=30)
        killer.join()
        assert rank1.wait(5) == -signal.SIGKILL
        assert got == [_hf_greedy(str(llama), tuple(prompts[1]))]
        assert d.server.connector.num_recomputed == 1, "the dead rank's slice was not refused"
        _wait_free(d.server)
        with pytest.raises(TPError, match="rank 1"):
            p.engine.tp.check_alive()
    finally:
        _stop(p)
        d.close()


# ---------------------------------------------------------------- the pure parts


@pytest.mark.parametrize(
    ("total", "src", "dst", "want"),
    [
        (4, 2, 1, [[HeadSlice(0, 0, 0, 2), HeadSlice(1, 0, 2, 2)]]),
        (4, 1, 2, [[HeadSlice(0, 0, 0, 2)], [HeadSlice(0, 2, 0, 2)]]),
        (4, 2, 2, [[HeadSlice(0, 0, 0, 2)], [HeadSlice(1, 0, 0, 2)]]),
        (2, 4, 1, [[HeadSlice(0, 0, 0, 1), HeadSlice(2, 0, 1, 1)]]),  # one holder each
        (2, 1, 4, [[HeadSlice(0, 0, 0, 1)]] * 2 + [[HeadSlice(0, 1, 0, 1)]] * 2),
        (2, 4, 4, [[HeadSlice(r, 0, 0, 1)] for r in range(4)]),
    ],
)
def test_each_reader_rank_takes_each_of_its_heads_once(total, src, dst, want):
    s, d = HeadLayout(total, src), HeadLayout(total, dst)
    assert [plan_reads(s, d, r) for r in range(dst)] == want


def test_head_slice_rows_address_one_head_range_per_unit():
    shape = BlockShape(units=4, heads=2, entry_bytes=8)
    rows = slice_rows(1000, shape, [0, 3], 1, 1, 0)
    assert rows.shape == (8, 3)
    assert rows[:4, 0].tolist() == [1008, 1024, 1040, 1056]
    assert rows[4, 0] == 1000 + 3 * 64 + 8 and set(rows[:, 1].tolist()) == {8}
    whole = slice_rows(1000, shape, [0, 3], 0, 2, 0, whole=True)
    assert whole[:, :2].tolist() == [[1000, 64], [1192, 64]]


def test_a_sender_whose_blocks_contradict_its_layout_is_refused_naming_both(llama):
    from engine.config import ModelConfig
    from engine.kv_setup import kv_spec_for

    cfg = EngineConfig(model=str(llama), **KW)
    spec = kv_spec_for(cfg, ModelConfig.from_pretrained(str(llama)), None, torch.float32)
    local = BlockRegion("DRAM", 0, 8, 4096, spec.block_bytes)
    reply = HelloReply(
        ok=True, name="p", instance_id="i", nixl_metadata=b"x", num_blocks=8, data_base=64,
        block_bytes=spec.block_bytes,  # a whole model's block, but it says it is one of 2 ranks
        tp_size=2, ranks=[RankRegion(rank=1, nixl_metadata=b"y", data_base=128)],
    )  # fmt: skip
    with pytest.raises(HandshakeError, match=r"tp 2.*needs.*here: 2 KV heads over tp 1"):
        slice_plan("p", reply, spec, local)
    plan = slice_plan("p", HelloReply(**{**_fields(reply), "block_bytes": spec.block_bytes // 2}),
                      spec, local)  # fmt: skip
    assert [s.src_rank for s in plan.slices] == [1, 0]  # rank 0's READ last
    assert plan.rows_per_block() == 2 * spec.num_layers * 2 * spec.block_size


def _fields(frame) -> dict:
    return {k: getattr(frame, k) for k in frame.__struct_fields__}
