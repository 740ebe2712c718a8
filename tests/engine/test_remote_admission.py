"""Remote-KV admission lives in the scheduler: requests whose prompt KV comes from a prefill
peer queue with local ones and obey the same slot, block and preemption rules; the engine's KV
connector is called with the blocks to fill, and a failed transfer recomputes the prompt.

The connector here copies KV between two real engines in one process (an in-process
transport, beside the NIXL one that tests/workers and tests/e2e drive): what is under test is
the engine's half, and the outputs must equal the colocated engine's token for token."""

from __future__ import annotations

import random

import pytest
from kv_copy import CopyConnector

from engine import LLM, SamplingParams
from engine.llm_engine import EngineConfig, LLMEngine
from engine.scheduler import SeqStatus


def _engines(model, decode_blocks=64, max_num_seqs=256):
    kw = dict(model=str(model), dtype="float32", max_num_batched_tokens=128)
    pe = LLMEngine(EngineConfig(**kw, role="prefill", num_kv_blocks=64))
    de = LLMEngine(
        EngineConfig(**kw, role="decode", num_kv_blocks=decode_blocks, max_num_seqs=max_num_seqs)
    )
    return pe, de


def _prompts(n, seed=0, low=20, high=60):
    rng = random.Random(seed)
    return [[rng.randrange(5, 400) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def _prefill(pe: LLMEngine, prompts, sp) -> dict[str, int]:
    first = {}
    for i, p in enumerate(prompts):
        pe.add_request(f"r{i}", p, sp)
    while pe.has_unfinished():
        for out in pe.step():
            first[out.request_id] = out.token_ids[0]
    return first


def _drain(de: LLMEngine, outputs: dict[str, list[int]], max_steps=10_000) -> None:
    for _ in range(max_steps):
        if not de.has_unfinished():
            return
        for out in de.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
    raise AssertionError("decode engine did not finish")


def _reference(model, prompts, sp):
    llm = LLM(str(model), dtype="float32", max_num_batched_tokens=128)
    return [o.token_ids for o in llm.generate(prompts, sp)]


@pytest.fixture(scope="module")
def model(make_tiny_model):
    return make_tiny_model("llama")


def test_remote_requests_match_colocated_token_for_token(model):
    pe, de = _engines(model)
    conn = CopyConnector(pe, de)
    prompts = _prompts(6)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = _prefill(pe, prompts, sp)
    assert len(conn.handoffs) == 6 and all(
        h.num_tokens == len(prompts[int(r[1:])]) for r, h in conn.handoffs.items()
    )
    outputs = {rid: [tok] for rid, tok in first.items()}
    for i, p in enumerate(prompts):
        de.add_remote_request(f"r{i}", p, first[f"r{i}"], sp)
    _drain(de, outputs)
    assert [outputs[f"r{i}"] for i in range(6)] == _reference(model, prompts, sp)
    assert de.block_manager.num_free_blocks == de.block_manager.num_blocks
    assert pe.block_manager.num_free_blocks == pe.block_manager.num_blocks


def test_remote_admission_obeys_max_num_seqs_with_local_requests(model):
    pe, de = _engines(model, max_num_seqs=2)
    conn = CopyConnector(pe, de, auto_land=False)
    prompts = _prompts(3, seed=1)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = _prefill(pe, prompts[:2], sp)
    de.add_remote_request("r0", prompts[0], first["r0"], sp)
    de.add_request("local", prompts[2], sp)
    de.add_remote_request("r1", prompts[1], first["r1"], sp)
    de.step()
    # FIFO, one slot budget: r0 admitted (KV in flight), the local prompt runs, r1 waits.
    assert [rid for rid, _ in conn.admitted] == ["r0"]
    assert de.seqs["r0"].status == SeqStatus.REMOTE_KV
    assert de.seqs["local"].status == SeqStatus.RUNNING
    assert de.seqs["r1"].status == SeqStatus.WAITING
    assert de.stats()["queued_prefill_tokens"] == 0  # r1's KV is not computed here
    conn.land("r0")
    de.step()
    assert de.seqs["r1"].status == SeqStatus.WAITING  # both slots busy (r0 now running)
    outputs: dict[str, list[int]] = {}
    _drain(de, outputs)  # r0 and the local request finish, then r1 takes a slot
    assert [rid for rid, _ in conn.admitted] == ["r0", "r1"]
    assert de.seqs["r1"].status == SeqStatus.REMOTE_KV
    conn.land("r1")
    _drain(de, outputs)
    assert len(outputs["r1"]) == 3 and not de.has_unfinished()


def test_remote_request_waits_for_blocks_behind_running_work(model):
    # 8 blocks of 16 slots: two 70-token prompts (5 blocks each) cannot both be resident.
    pe, de = _engines(model, decode_blocks=8)
    conn = CopyConnector(pe, de, auto_land=False)
    prompts = _prompts(2, seed=2, low=70, high=71)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = _prefill(pe, prompts, sp)
    de.add_remote_request("r0", prompts[0], first["r0"], sp)
    de.add_remote_request("r1", prompts[1], first["r1"], sp)
    de.step()
    assert [rid for rid, _ in conn.admitted] == ["r0"]
    assert de.seqs["r1"].status == SeqStatus.WAITING
    conn.land("r0")
    outputs = {rid: [tok] for rid, tok in first.items()}
    for _ in range(200):
        for out in de.step():
            outputs[out.request_id].extend(out.token_ids)
        if "r1" in dict(conn.admitted) and de.seqs.get("r1") is not None:
            if de.seqs["r1"].status == SeqStatus.REMOTE_KV:
                conn.land("r1")
        if not de.has_unfinished():
            break
    assert [rid for rid, _ in conn.admitted] == ["r0", "r1"]
    assert [outputs["r0"], outputs["r1"]] == _reference(model, prompts, sp)
    assert de.block_manager.num_free_blocks == de.block_manager.num_blocks


def test_failed_transfer_recomputes_and_continues_after_the_first_token(model):
    pe, de = _engines(model)
    conn = CopyConnector(pe, de, auto_land=False)
    prompts = _prompts(2, seed=3)
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    first = _prefill(pe, prompts, sp)
    for i, p in enumerate(prompts):
        de.add_remote_request(f"r{i}", p, first[f"r{i}"], sp)
    de.step()
    assert {rid for rid, _ in conn.admitted} == {"r0", "r1"}
    conn.land("r0")
    de.recompute_remote("r1")  # the transfer failed: prefill r1 here
    assert de.seqs["r1"].status == SeqStatus.WAITING and not de.seqs["r1"].kv_from_peer
    outputs = {rid: [tok] for rid, tok in first.items()}
    _drain(de, outputs)
    assert [outputs["r0"], outputs["r1"]] == _reference(model, prompts, sp)
    assert de.block_manager.num_free_blocks == de.block_manager.num_blocks


def test_committed_remote_sequences_are_preempted_and_recomputed_exactly(model):
    # 12 blocks cannot grow four ~40-token sequences by 40 tokens each: preemption.
    pe, de = _engines(model, decode_blocks=12)
    CopyConnector(pe, de)
    prompts = _prompts(4, seed=4, low=35, high=45)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = _prefill(pe, prompts, sp)
    outputs = {rid: [tok] for rid, tok in first.items()}
    for i, p in enumerate(prompts):
        de.add_remote_request(f"r{i}", p, first[f"r{i}"], sp)
    _drain(de, outputs)
    assert de.scheduler.num_preemptions > 0
    assert [outputs[f"r{i}"] for i in range(4)] == _reference(model, prompts, sp)


def test_aborting_a_request_whose_kv_is_in_flight_frees_its_blocks(model):
    pe, de = _engines(model)
    CopyConnector(pe, de, auto_land=False)
    prompts = _prompts(1, seed=5)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = _prefill(pe, prompts, sp)
    de.add_remote_request("r0", prompts[0], first["r0"], sp)
    de.step()
    assert de.block_manager.num_free_blocks < de.block_manager.num_blocks
    assert de.abort("r0")
    assert de.block_manager.num_free_blocks == de.block_manager.num_blocks
    assert not de.scheduler.fetching and not de.has_unfinished()


def test_prefill_hand_off_hook_and_refusal(model):
    pe, de = _engines(model)
    conn = CopyConnector(pe, de)
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompt = _prompts(1, seed=6)[0]
    _prefill(pe, [prompt], sp)
    h = conn.handoffs["r0"]
    assert pe.seqs["r0"].status == SeqStatus.PREFILLED
    assert h.block_ids == pe.seqs["r0"].block_table and h.num_tokens == len(prompt)
    pe.release("r0")
    conn.refuse = True
    pe.add_request("r1", prompt, sp)
    while pe.has_unfinished():
        pe.step()
    assert "r1" not in pe.seqs  # refused: the engine freed the blocks itself
    assert pe.block_manager.num_free_blocks == pe.block_manager.num_blocks


def test_remote_request_needs_a_connector(model):
    _, de = _engines(model)
    with pytest.raises(RuntimeError, match="connector"):
        de.add_remote_request("r0", [1, 2, 3], 4, SamplingParams(max_tokens=2))


def test_a_connector_implements_only_its_roles_call(model):
    """Each role's engine makes one connector call (prefill: `on_prefilled`, decode:
    `on_remote_admitted`): a connector with only its own half is accepted, one without its
    role's call is refused when it is set, not when the first request reaches it."""

    class PrefillOnly:
        def on_prefilled(self, handoff) -> bool:
            return False

    class DecodeOnly:
        def on_remote_admitted(self, request_id, block_ids, num_reused_blocks) -> None:
            pass

    pe, de = _engines(model)
    pe.set_kv_connector(PrefillOnly())
    de.set_kv_connector(DecodeOnly())
    with pytest.raises(TypeError, match="on_remote_admitted"):
        de.set_kv_connector(PrefillOnly())
    with pytest.raises(TypeError, match="on_prefilled"):
        pe.set_kv_connector(DecodeOnly())
    pe.set_kv_connector(None)  # a worker may also drop its connector


@pytest.mark.parametrize("extra", [0, 7, 16])
def test_remote_prompt_reuses_the_decode_engines_cached_prefix(model, extra):
    """A decode engine that already holds a prompt's leading blocks (an earlier turn) takes
    them by reference and is handed only the rest to fill: the partial last block always
    (`extra` 7), and the last full block of a prompt that ends on a block boundary (`extra` 0:
    the first token then needs a block of its own on this side only). The output equals the
    colocated engine's; cached_tokens stays the prefill side's count (0 here), and the hit
    counters that measure compute saved do not move."""
    pe, de = _engines(model)
    conn = CopyConnector(pe, de)
    bm, bs = de.block_manager, de.block_manager.block_size
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    shared = _prompts(1, seed=3, low=3 * bs, high=3 * bs + 1)[0]
    de.add_request("earlier", shared + [7, 8, 9], sp)  # a local prefill caches `shared`
    _drain(de, {})
    counters = (bm.num_prefix_hit_tokens, bm.num_prefix_query_tokens)
    prompt = shared + [random.Random(extra).randrange(5, 400) for _ in range(extra)]
    first = _prefill(pe, [prompt], sp)
    de.add_remote_request("r0", prompt, first["r0"], sp)
    tokens, cached = [first["r0"]], set()
    while de.has_unfinished():
        for out in de.step():
            tokens += out.token_ids
            cached.add(out.num_cached_tokens)
    assert conn.reused["r0"] == min(len(shared), len(prompt) - 1) // bs
    assert tokens == _reference(model, [prompt], sp)[0]
    assert cached == {0} and (bm.num_prefix_hit_tokens, bm.num_prefix_query_tokens) == counters
    assert bm.num_free_blocks == bm.num_blocks


def test_decode_kv_reuse_off_reads_every_block_and_waits_for_room(model):
    """`--no-decode-kv-reuse` (the "today" baseline of benchmarks/multiturn.py): a remote
    prompt whose leading blocks this engine caches takes none of them (the connector fills
    every block), and the room check counts every block it needs: with the cache nearly full
    of free-but-cached blocks the request waits for room instead of failing the step."""
    kw = dict(model=str(model), dtype="float32", max_num_batched_tokens=128)
    pe = LLMEngine(EngineConfig(**kw, role="prefill", num_kv_blocks=64))
    de = LLMEngine(EngineConfig(**kw, role="decode", num_kv_blocks=8, decode_kv_reuse=False))
    conn = CopyConnector(pe, de)
    bs = de.block_manager.block_size
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    shared = _prompts(1, seed=5, low=3 * bs, high=3 * bs + 1)[0]
    prompt = shared + [9, 10, 11]  # 4 blocks
    first = _prefill(pe, [prompt], sp)
    de.add_request("earlier", shared + [7, 8], sp)  # 4 blocks, `shared`'s 3 among them
    de.add_request("holder", [5] * 10, sp)  # 1 block
    de.step()  # both running: 3 blocks free, `shared`'s blocks in use
    de.add_remote_request("r0", prompt, first["r0"], sp)
    outputs: dict[str, list[int]] = {}
    # MemoryError in a step if admission took `shared`'s blocks as reused (needing 1 free)
    # and then allocated 4 fresh ones: r0 must wait until "holder" ends.
    _drain(de, outputs)
    assert conn.reused["r0"] == 0
    assert [first["r0"], *outputs["r0"]] == _reference(model, [prompt], sp)[0]
    assert de.block_manager.num_free_blocks == de.block_manager.num_blocks
