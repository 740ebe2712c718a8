"""Decode steps launched ahead (engine.decode_ahead): the same tokens as ordinary steps, every
block back, and the path taken.

On a CPU every op is synchronous, so nothing overlaps here; what these tests prove is the
bookkeeping: placeholders resolved on the device, sequences that finish while the next step
is in flight, drains before anything changes the batch (arrivals, aborts, preemption under a
small cache), non-greedy requests kept on the ordinary path, and prefix-cache commits made
with the real tokens."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.test_parity_hf import hf_greedy

PROMPT_LENGTHS = [3, 17, 9, 30]
MAX_TOKENS = [12, 5, 20, 9]


def _llm(path, mode: str, **kw) -> LLM:
    return LLM(path, dtype="float32", max_num_seqs=8, decode_ahead=mode, **kw)


def _prompts(lengths=PROMPT_LENGTHS, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


def _greedy(max_tokens, **kw):
    return [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, **kw) for m in max_tokens]


def _all_blocks_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks


@pytest.fixture(scope="module")
def llama(make_tiny_model):
    return make_tiny_model("llama")


def test_greedy_batches_are_token_exact_and_launched_ahead(llama):
    ahead, plain = _llm(llama, "on"), _llm(llama, "off")
    got = ahead.generate(_prompts(), _greedy(MAX_TOKENS))
    want = plain.generate(_prompts(), _greedy(MAX_TOKENS))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == ["length"] * 4
    assert got[0].token_ids == hf_greedy(llama, _prompts()[0], MAX_TOKENS[0])
    # Every decode step after the prompts' went ahead; none did without decode_ahead.
    assert ahead.engine.ahead.launched >= max(MAX_TOKENS) - 2
    assert plain.engine.ahead.launched == 0
    # Requests ending by length sat the next step out: the batch drained once, at its end.
    assert ahead.engine.ahead.drained == 1
    assert _all_blocks_free(ahead)


def test_a_stop_token_met_while_the_next_step_is_in_flight(llama):
    """A sequence that stops at step N already has a row in step N+1: the row is dropped,
    its blocks freed, and the others go on unchanged."""
    plain = _llm(llama, "off")
    free_run = plain.generate(_prompts(), _greedy(MAX_TOKENS))
    stop = free_run[2].token_ids[6]  # met mid-way by request 2 (and wherever else it comes)
    sps = _greedy(MAX_TOKENS, stop_token_ids=[stop])
    ahead = _llm(llama, "on")
    got = ahead.generate(_prompts(), sps)
    want = plain.generate(_prompts(), sps)
    assert [(o.token_ids, o.finish_reason) for o in got] == [
        (o.token_ids, o.finish_reason) for o in want
    ]
    assert got[2].finish_reason == "stop" and got[2].token_ids[-1] == stop
    assert len(got[2].token_ids) <= 7
    assert _all_blocks_free(ahead)


def test_sampled_and_logprob_requests_stay_on_the_ordinary_path(llama):
    """A seeded sampled request and one asking for logprobs batch with greedy ones: while
    they run, no step goes ahead; the results equal decode_ahead off."""
    sps = _greedy(MAX_TOKENS[:2]) + [
        SamplingParams(max_tokens=8, temperature=0.8, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True),
    ]
    ahead, plain = _llm(llama, "on"), _llm(llama, "off")
    got, want = ahead.generate(_prompts(), sps), plain.generate(_prompts(), sps)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[3].logprobs == want[3].logprobs
    # Steps went ahead only once the non-greedy requests were done (request 0 outlives them).
    assert 0 < ahead.engine.ahead.launched <= MAX_TOKENS[0] - 8
    assert _all_blocks_free(ahead)


def _run_by_hand(llm: LLM, late_prompt, abort_at: int | None):
    """Three requests, a fourth arriving after 4 steps, request 1 aborted after `abort_at`
    steps: outputs per request id."""
    engine, out = llm.engine, {}
    prompts = _prompts()
    for i, (p, sp) in enumerate(zip(prompts[:3], _greedy(MAX_TOKENS[:3]), strict=True)):
        engine.add_request(f"r{i}", p, sp)
    steps = 0
    while engine.has_unfinished() or steps < 5:
        if steps == 4:
            engine.add_request("late", late_prompt, _greedy([7])[0])
        if steps == abort_at:
            assert engine.abort("r1")
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        steps += 1
    return out


@pytest.mark.parametrize("abort_at", [None, 3])
def test_arrivals_and_aborts_drain_the_step_in_flight(llama, abort_at):
    late = _prompts([11], seed=9)[0]
    ahead, plain = _llm(llama, "on"), _llm(llama, "off")
    got = _run_by_hand(ahead, late, abort_at)
    want = _run_by_hand(plain, late, abort_at)
    for rid in ("r0", "r2", "late"):
        assert got[rid] == want[rid], rid
    if abort_at is not None:
        assert len(got.get("r1", [])) < MAX_TOKENS[1] or MAX_TOKENS[1] <= abort_at
    assert ahead.engine.ahead.launched > 0
    assert _all_blocks_free(ahead)


def test_a_small_cache_preempts_on_the_ordinary_path(llama):
    """With too few blocks for every sequence to grow, the step in flight is read back and the
    scheduler preempts as it always does; the tokens are the same."""
    kw = dict(num_kv_blocks=14, block_size=4)
    ahead, plain = _llm(llama, "on", **kw), _llm(llama, "off", **kw)
    got = ahead.generate(_prompts(), _greedy(MAX_TOKENS))
    want = plain.generate(_prompts(), _greedy(MAX_TOKENS))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert plain.engine.scheduler.num_preemptions > 0
    assert ahead.engine.scheduler.num_preemptions > 0
    assert _all_blocks_free(ahead)


def test_blocks_of_generated_tokens_are_committed_with_the_real_tokens(llama):
    """A follow-up whose prompt is an earlier answer's context hits the prefix cache over the
    generated tokens: their blocks were hashed with the tokens read back, not placeholders."""
    ahead = _llm(llama, "on", block_size=4)
    prompt = _prompts([8])[0]
    first = ahead.generate([prompt], _greedy([24]))[0]
    follow = prompt + first.token_ids[:20]
    again = ahead.generate([follow], _greedy([5]))[0]
    assert again.num_cached_tokens >= 24  # 6 full blocks: 2 of prompt, 4 of generated tokens
    assert (
        again.token_ids
        == _llm(llama, "off", block_size=4).generate([follow], _greedy([5]))[0].token_ids
    )


def test_decode_ahead_mode_is_checked():
    from engine.llm_engine import EngineConfig

    with pytest.raises(ValueError):
        EngineConfig(model="x", decode_ahead="sometimes")


def test_sequences_ending_at_the_context_window_sit_the_next_step_out(llama):
    """max_model_len ends some requests before their max_tokens: each sits the step after its
    last token out (never computed past the window) and the rest go on."""
    ahead, plain = _llm(llama, "on", max_model_len=40), _llm(llama, "off", max_model_len=40)
    sps = _greedy([30, 30, 8, 30])
    got, want = ahead.generate(_prompts(), sps), plain.generate(_prompts(), sps)
    assert [(o.token_ids, o.finish_reason) for o in got] == [
        (o.token_ids, o.finish_reason) for o in want
    ]
    assert [len(p) + len(o.token_ids) for p, o in zip(_prompts(), got, strict=True)] == [
        33,
        40,
        17,
        40,
    ]
    assert ahead.engine.ahead.drained == 1 and _all_blocks_free(ahead)
