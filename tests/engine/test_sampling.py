"""Sampling: seeds make a request reproducible whatever batch it runs in; top-k/top-p
degenerate to greedy at their limits; temperature spreads the choice."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.sampler import _filter, argmax_rows


def test_filter_top_k_and_top_p():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    assert torch.isinf(_filter(logits, 2, 1.0)).tolist() == [True, False, False, True]
    probs = logits.softmax(-1)  # ~[0.09, 0.67, 0.24, 0.03]
    kept = ~torch.isinf(_filter(logits, -1, 0.8))
    assert kept.tolist() == [False, True, True, False]
    assert probs[1] < 0.8 <= probs[1] + probs[2]
    assert (~torch.isinf(_filter(logits, -1, 0.1))).sum() == 1


def test_argmax_rows_is_torchs_argmax_ties_nan_and_masked_rows_included():
    """The greedy choice (numpy's argmax on CPU rows) picks what torch.argmax picks: the first
    of tied maxima, a NaN, a row masked to -inf (its first token)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49152, generator=gen)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie: the first wins
    logits[2, 100] = float("nan")
    logits[2, 5] = float("nan")
    logits[3] = float("-inf")
    logits[4, -1] = float("inf")
    logits[5] = logits[5].round()  # many ties
    want = logits.argmax(dim=-1).tolist()
    assert argmax_rows(logits) == want
    assert want[1] == 7 and want[2] == 5 and want[3] == 0 and want[4] == 49151
    strided = logits[:, ::2]  # not contiguous
    assert argmax_rows(strided) == strided.argmax(dim=-1).tolist()
    with torch.inference_mode():
        assert argmax_rows(logits.clone()) == want


def test_seeded_sampling_is_batch_independent(make_tiny_model):
    llm = LLM(make_tiny_model("llama"), dtype="float32")
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([[10, 11, 12]], sp)[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batch = llm.generate([[1, 2], [10, 11, 12], [5] * 20], [others, sp, others])
    assert batch[1].token_ids == alone
    different = llm.generate(
        [[10, 11, 12]], SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    )[0].token_ids
    assert different != alone


def test_limits_equal_greedy(make_tiny_model):
    llm = LLM(make_tiny_model("qwen2"), dtype="float32")
    prompt = [[3, 4, 5, 6, 7]]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    k1 = llm.generate(prompt, SamplingParams(max_tokens=12, top_k=1, seed=3, ignore_eos=True))
    p0 = llm.generate(prompt, SamplingParams(max_tokens=12, top_p=1e-6, seed=3, ignore_eos=True))
    assert greedy[0].token_ids == k1[0].token_ids == p0[0].token_ids
    hot = llm.generate(
        prompt, SamplingParams(max_tokens=12, temperature=2.0, seed=3, ignore_eos=True)
    )
    assert hot[0].token_ids != greedy[0].token_ids


def test_extreme_settings_never_fail_the_batch(make_tiny_model):
    """A temperature of 5e-324 is greedy; a repetition penalty of 5e-324 overflows its row to
    inf/NaN, which takes the row's most likely token instead of failing the whole step: the
    other request in the batch is unaffected."""
    llm = LLM(make_tiny_model("llama"), dtype="float32")
    prompt = [3, 4, 5, 6, 7]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tiny_t = SamplingParams(max_tokens=8, temperature=5e-324, ignore_eos=True)
    overflow = SamplingParams(max_tokens=8, repetition_penalty=5e-324, seed=1, ignore_eos=True)
    alone = llm.generate([prompt], greedy)[0].token_ids
    out = llm.generate([prompt, prompt, prompt], [greedy, tiny_t, overflow])
    assert out[0].token_ids == out[1].token_ids == alone
    assert len(out[2].token_ids) == 8
