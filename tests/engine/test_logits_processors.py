"""Logits processors: each one and their combinations against plain-Python references (rows that
ask for nothing stay bit-identical), then through `LLM` against transformers' own logits with
the processing applied by hand (greedy token for token; min_p's sampled tokens all inside the
min_p set of the reference distribution)."""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch
from msgspec.structs import replace

from engine import LLM, SamplingParams
from engine.sampler import apply_logits_processors, min_p_mask
from engine.scheduler import Sequence

INF = float("inf")
EOS = (2,)
VOCAB = 48

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _seq(prompt: list[int], output: list[int], **sampling) -> Sequence:
    sp = SamplingParams(max_tokens=64, **sampling)
    return Sequence("r", list(prompt), sp, token_ids=list(prompt) + list(output))


def reference(
    row: list[float], prompt: list[int], out: list[int], sp: SamplingParams, eos: tuple[int, ...]
) -> list[float]:
    """The processing spelled out token by token (vLLM's semantics and order)."""
    x = list(row)
    vocab = len(x)
    if len(out) < sp.min_tokens:
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos))
        for t in stops:
            if t < vocab:
                x[t] = -INF
    for t, b in dict(sp.logit_bias).items():
        if t < vocab:
            x[t] += b
    p = sp.repetition_penalty
    for t in set(prompt) | set(out):
        x[t] = x[t] / p if x[t] > 0 else x[t] * p
    for t in set(out):
        x[t] -= sp.frequency_penalty * out.count(t) + sp.presence_penalty
    return x


def _random_logits(n: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[:, 5] = 0.0  # the repetition penalty's x > 0 boundary
    return logits


def _random_tokens(rng: random.Random, n: int, vocab: int = VOCAB) -> list[int]:
    # Draws from a small range so tokens repeat (counts > 1) and prompt and output overlap.
    return [rng.randrange(3, min(vocab, 20)) for _ in range(n)]


def _check(logits: torch.Tensor, seqs: list[Sequence], device: str) -> None:
    before = logits.clone()
    on_device = logits.to(device)
    apply_logits_processors(on_device, seqs, EOS)
    got = on_device.cpu()
    for i, seq in enumerate(seqs):
        if not seq.sampling.needs_processing:
            assert torch.equal(got[i], before[i]), f"row {i} asks for nothing but changed"
            continue
        ref = reference(
            before[i].tolist(), seq.prompt_token_ids, seq.output_token_ids, seq.sampling, EOS
        )
        want = torch.tensor(ref, dtype=torch.float32)
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-5, msg=f"row {i}")


# ---------------------------------------------------------------------------- unit tests


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "sampling",
    [
        {"presence_penalty": 1.5},
        {"presence_penalty": -0.7},
        {"frequency_penalty": 0.8},
        {"frequency_penalty": -2.0},
        {"repetition_penalty": 1.7},
        {"repetition_penalty": 0.5},
        {"logit_bias": ((4, 5.0), (7, -100.0), (3, 0.25))},
        {"min_tokens": 10},
        {"min_tokens": 10, "stop_token_ids": (9, 11)},
        {"min_tokens": 10, "stop_token_ids": (9,), "ignore_eos": True},
    ],
    ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items())[:40],
)
def test_each_processor_matches_reference(device, sampling):
    rng = random.Random(1)
    seqs = [_seq(_random_tokens(rng, 12), _random_tokens(rng, k), **sampling) for k in (0, 1, 9)]
    _check(_random_logits(len(seqs)), seqs, device)


@pytest.mark.parametrize("device", DEVICES)
def test_combinations_and_untouched_rows(device):
    rng = random.Random(2)
    combos = [
        {},
        {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.3},
        {"temperature": 0.7, "top_p": 0.9, "seed": 3},  # sampling settings alone: no processing
        {"min_tokens": 4, "logit_bias": ((2, 50.0), (6, 1.0)), "repetition_penalty": 1.2},
        {"logit_bias": ((4, -3.0),), "frequency_penalty": 1.1, "stop_token_ids": (8,)},
        {"min_tokens": 2, "presence_penalty": -1.0, "ignore_eos": True},
        {},
    ]
    seqs = [_seq(_random_tokens(rng, 7), _random_tokens(rng, 3), **c) for c in combos]
    want = [False, True, False, True, True, True, False]
    assert [s.sampling.needs_processing for s in seqs] == want
    _check(_random_logits(len(seqs), seed=5), seqs, device)


def test_no_processing_returns_before_reading_anything():
    # A mismatched batch would be refused if the function looked at it: proof that the common
    # case stops at the needs_processing scan.
    seqs = [_seq([3, 4], [5]), _seq([6], [])]
    logits = _random_logits(5)
    before = logits.clone()
    apply_logits_processors(logits, seqs, EOS)
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="do not match"):
        apply_logits_processors(logits, [*seqs, _seq([3], [], presence_penalty=1.0)], EOS)


def test_min_tokens_boundary():
    # Masked while fewer than min_tokens are out; released at exactly min_tokens.
    logits = torch.zeros(3, VOCAB)
    seqs = [_seq([3], [4] * k, min_tokens=3, stop_token_ids=(9,)) for k in (0, 2, 3)]
    apply_logits_processors(logits, seqs, EOS)
    for i, masked in enumerate([True, True, False]):
        assert bool(torch.isinf(logits[i, 2])) is masked
        assert bool(torch.isinf(logits[i, 9])) is masked
    assert int(torch.isinf(logits).sum()) == 4


def test_logit_bias_ignores_ids_past_vocab_and_last_repeat_wins():
    logits = torch.zeros(1, VOCAB)
    seq = _seq([3], [], logit_bias=((VOCAB, 9.0), (VOCAB + 100, 1.0), (4, 1.0), (4, 2.5)))
    apply_logits_processors(logits, [seq], EOS)
    want = torch.zeros(VOCAB)
    want[4] = 2.5
    assert torch.equal(logits[0], want)


def test_penalties_keep_masked_tokens_masked_without_nan():
    logits = torch.randn(1, VOCAB)
    seq = _seq(
        [2, 2, 3],
        [2, 4],
        min_tokens=5,
        repetition_penalty=1.5,
        frequency_penalty=2.0,
        presence_penalty=-2.0,
    )
    apply_logits_processors(logits, [seq], EOS)
    assert logits[0, 2] == -INF
    assert not torch.isnan(logits).any()


def test_many_rows_with_mixed_penalties():
    rng = random.Random(3)
    seqs = []
    for i in range(150):
        sampling = {} if i % 7 == 0 else {"frequency_penalty": 0.01 * (i % 50) + 0.1}
        if i % 3 == 0:
            sampling["repetition_penalty"] = 1.0 + 0.01 * i
        seqs.append(_seq(_random_tokens(rng, 1 + i % 11), _random_tokens(rng, i % 5), **sampling))
    _check(_random_logits(len(seqs), seed=9), seqs, "cpu")


def test_non_contiguous_logits_are_written_back():
    # A column slice (as a padded vocabulary would give) cannot be flattened as a view.
    rng = random.Random(4)
    wide = _random_logits(3, vocab=VOCAB + 16, seed=4)
    logits = wide[:, :VOCAB]
    assert not logits.is_contiguous()
    sampling = {"repetition_penalty": 1.4, "frequency_penalty": 0.6, "presence_penalty": 0.2}
    seqs = [_seq(_random_tokens(rng, 6), _random_tokens(rng, 4), **sampling) for _ in range(3)]
    before = wide.clone()
    apply_logits_processors(logits, seqs, EOS)
    assert torch.equal(wide[:, VOCAB:], before[:, VOCAB:])
    for i, seq in enumerate(seqs):
        ref = reference(
            before[i, :VOCAB].tolist(),
            seq.prompt_token_ids,
            seq.output_token_ids,
            seq.sampling,
            EOS,
        )
        torch.testing.assert_close(logits[i], torch.tensor(ref), rtol=1e-6, atol=1e-5)


def _min_p_reference(row: list[float], min_p: float) -> list[float]:
    m = max(row)
    probs = [math.exp(v - m) for v in row]
    total = sum(probs)
    probs = [q / total for q in probs]
    top = max(probs)
    return [v if q >= min_p * top else -INF for v, q in zip(row, probs, strict=True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_mask(device, min_p):
    logits = _random_logits(4, seed=11)
    for row in logits:
        got = min_p_mask(row.to(device), min_p).cpu()
        kept = ~torch.isinf(got)
        want_kept = ~torch.isinf(torch.tensor(_min_p_reference(row.tolist(), min_p)))
        assert torch.equal(kept, want_kept)
        assert torch.equal(got[kept], row[kept])  # survivors keep their logits exactly
        assert kept[row.argmax()]  # the likeliest token always survives
    batched = min_p_mask(logits.to(device), min_p).cpu()
    assert torch.equal(batched, torch.stack([min_p_mask(r, min_p) for r in logits]))
    if min_p == 0.0:
        assert min_p_mask(logits, 0.0) is logits


# ---------------------------------------------------------------------------- through LLM

MAX_TOKENS = 24
PROMPT_LENGTHS = (5, 17, 40)


@functools.cache
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logits(path, ids: list[int]) -> list[float]:
    """The last position's logits, recomputed over the whole prefix (no cache to get wrong)."""
    with torch.no_grad():
        return _hf_model(str(path))(torch.tensor([ids])).logits[0, -1].float().tolist()


def hf_processed_greedy(path, prompt: list[int], sp: SamplingParams, eos) -> list[int]:
    """transformers' logits, `reference` processing, argmax; stops as the engine does."""
    out: list[int] = []
    while len(out) < sp.max_tokens:
        x = reference(_hf_logits(path, prompt + out), prompt, out, sp, eos)
        token = max(range(len(x)), key=x.__getitem__)
        out.append(token)
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in eos):
            break
    return out


@pytest.fixture(scope="module")
def tiny(make_tiny_model):
    path = make_tiny_model("llama")
    llm = LLM(path, dtype="float32")
    return path, llm, tuple(llm.engine.model_config.eos_token_ids)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


GREEDY_CASES = {
    "presence": {"presence_penalty": 2.0},
    "presence-negative": {"presence_penalty": -2.0},
    "frequency": {"frequency_penalty": 1.5},
    "frequency-negative": {"frequency_penalty": -1.0},
    "repetition": {"repetition_penalty": 2.0},
    "repetition-below-1": {"repetition_penalty": 0.6},
    "logit-bias": {"logit_bias": ((100, 5.0), (200, 5.0), (300, 4.0), (938, -100.0))},
    "all": {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.3,
        "logit_bias": ((100, 3.0),),
    },
}


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_processing_matches_hf(tiny, case):
    path, llm, eos = tiny
    prompts = _prompts()
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **GREEDY_CASES[case])
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    # Processed and plain requests share each batch: the plain rows must stay plain greedy.
    outs = llm.generate(prompts + prompts, [sp] * len(prompts) + [plain] * len(prompts))
    processed, untouched = outs[: len(prompts)], outs[len(prompts) :]
    for p, o in zip(prompts, processed, strict=True):
        assert o.token_ids == hf_processed_greedy(path, p, sp, eos), f"{len(p)}-token prompt"
    for p, o in zip(prompts, untouched, strict=True):
        assert o.token_ids == hf_processed_greedy(path, p, plain, eos)
    # The case must matter here, or this test would prove nothing about it.
    assert any(a.token_ids != b.token_ids for a, b in zip(processed, untouched, strict=True))


def test_min_tokens_holds_off_a_forced_eos(tiny):
    path, llm, eos = tiny
    bias = tuple((e, 100.0) for e in eos)
    cases = [
        SamplingParams(max_tokens=16, temperature=0, min_tokens=5, logit_bias=bias),
        # A stop token is held off the same way; eos pushed down so the stop token decides.
        SamplingParams(
            max_tokens=16,
            temperature=0,
            min_tokens=3,
            stop_token_ids=(777,),
            logit_bias=((777, 100.0), *((e, -100.0) for e in eos)),
        ),
        # ignore_eos: eos is no stop token, so min_tokens does not mask it (vLLM).
        SamplingParams(max_tokens=8, temperature=0, min_tokens=5, ignore_eos=True, logit_bias=bias),
        SamplingParams(max_tokens=16, temperature=0, logit_bias=bias),  # no min_tokens: at once
    ]
    prompt = _prompts()[1]
    outs = llm.generate([prompt] * len(cases), cases)
    for sp, o in zip(cases, outs, strict=True):
        assert o.token_ids == hf_processed_greedy(path, prompt, sp, eos)
    forced, stopped, ignored, immediate = (o.token_ids for o in outs)
    assert len(forced) == 6 and forced[-1] in eos and not set(forced[:5]) & set(eos)
    assert outs[0].finish_reason == "stop"
    assert stopped[3:] == [777] and 777 not in stopped[:3] and outs[1].finish_reason == "stop"
    assert ignored == [eos[0]] * 8 and outs[2].finish_reason == "length"
    assert immediate == [eos[0]]


def _min_p_violations(path, prompt, out, sp, eos, min_p: float) -> list[int]:
    """Steps whose sampled token is outside the min_p set of the reference distribution
    (penalties, then temperature, then min_p, as the sampler orders them)."""
    bad = []
    for k, token in enumerate(out):
        x = reference(_hf_logits(path, prompt + out[:k]), prompt, out[:k], sp, eos)
        probs = torch.tensor(x, dtype=torch.float64).div(sp.temperature).softmax(-1)
        # Slack for the engine's fp32 logits differing from transformers' in the last bits.
        if probs[token] < min_p * probs.max() * (1 - 1e-4):
            bad.append(k)
    return bad


def test_min_p_samples_only_inside_the_min_p_set(tiny):
    path, llm, eos = tiny
    prompts = _prompts()
    common = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "ignore_eos": True}
    with_min_p = [
        SamplingParams(seed=7, min_p=0.3, **common),
        SamplingParams(seed=8, min_p=0.1, presence_penalty=1.0, **common),
        SamplingParams(seed=9, min_p=0.5, top_k=50, **common),
    ]
    outs = llm.generate(prompts, with_min_p)
    for p, sp, o in zip(prompts, with_min_p, outs, strict=True):
        assert len(o.token_ids) == MAX_TOKENS
        assert _min_p_violations(path, p, o.token_ids, sp, eos, sp.min_p) == []
    # Same seeds without min_p: the check above has teeth (plain sampling leaves the set).
    without = [replace(sp, min_p=0.0) for sp in with_min_p]
    free = llm.generate(prompts, without)
    assert any(
        _min_p_violations(path, p, o.token_ids, sp, eos, w.min_p)
        for p, sp, w, o in zip(prompts, without, with_min_p, free, strict=True)
    )
