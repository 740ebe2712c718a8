"""In-batch prefix sharing (engine/scheduler.py): prompts that arrive together and share leading
blocks compute those blocks once. The first is admitted; the others wait a step (keeping their
place) and then find the shared blocks in the prefix cache. Outputs stay the colocated engine's,
token for token; prompts sharing nothing are admitted together as before."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.llm_engine import EngineConfig, LLMEngine

SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SHARED = list(range(100, 148))  # 3 blocks of 16


@pytest.fixture(scope="module")
def model(make_tiny_model):
    return make_tiny_model("llama")


def _run(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int], int]:
    """(outputs, cached tokens per prompt, requests the first step admitted)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SP)
    out: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    first_step = None
    while engine.has_unfinished():
        plan_outputs = engine.step()
        if first_step is None:
            first_step = len(engine.scheduler.running)
        for o in plan_outputs:
            out.setdefault(o.request_id, []).extend(o.token_ids)
            if o.index == 0:
                cached[o.request_id] = o.num_cached_tokens
    keys = [f"r{i}" for i in range(len(prompts))]
    return [out[k] for k in keys], [cached[k] for k in keys], first_step


def test_prompts_sharing_blocks_compute_them_once_and_stay_exact(model):
    prompts = [SHARED + [7, 8, 9], SHARED + [11, 12], SHARED[:16] + [5] * 20, [3, 4] * 20]
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64))
    got, cached, first_step = _run(engine, prompts)
    expected = [o.token_ids for o in LLM(model, dtype="float32").generate(prompts, SP)]
    assert got == expected
    # Step 1 runs r0 (the shared blocks) and r3 (shares nothing); r1 and r2 waited a step and
    # then took 3 and 1 shared blocks from the cache instead of computing them again.
    assert first_step == 2 and engine.scheduler.num_prefix_waits >= 2
    assert cached == [0, 48, 16, 0]
    bm = engine.block_manager
    computed = bm.num_prefix_query_tokens - bm.num_prefix_hit_tokens
    assert computed == sum(map(len, prompts)) - 64


def test_prompt_logprobs_requests_are_never_held_back(model):
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64))
    engine.add_request("a", SHARED + [1], SP)
    engine.add_request("b", SHARED + [2], SamplingParams(max_tokens=2, prompt_logprobs=0))
    engine.step()
    assert {s.request_id for s in engine.scheduler.running} == {"a", "b"}
    assert engine.scheduler.num_prefix_waits == 0
