"""Logits processors: each one and their combinations against plain-Python references (rows that
ask for nothing stay bit-identical), then through `LLM` against transformers' own logits with
the processing applied by hand (greedy token for token; min_p's sampled tokens all inside the
min_p set of the reference distribution; allowed_token_ids also against transformers' own
`prefix_allowed_tokens_fn`; a bad word across the prefill / decode hand-off). The fields' wire
round trip and bounds are in test_wire.py."""

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
    if sp.allowed_token_ids:
        allowed = {t for t in sp.allowed_token_ids if t < vocab}
        x = [v if t in allowed else -INF for t, v in enumerate(x)]
    for word in sp.bad_words_token_ids:
        if len(word) > len(out) + 1 or word[-1] >= vocab:
            continue
        prefix = list(word[:-1])
        if not prefix or out[-len(prefix) :] == prefix:
            x[word[-1]] = -INF
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
        {"allowed_token_ids": (3, 5, 7, 19, 40)},
        {"allowed_token_ids": (4, 4, VOCAB - 1, VOCAB, VOCAB + 7)},
        # Two-token words drawn from the tokens' range, so some prefixes match the output tail.
        {"bad_words_token_ids": ((4,), (5, 6), (7, 8, 9), *((t, 12) for t in range(3, 20)))},
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
        # allowed ids with logit_bias (on an allowed and a disallowed id) and the penalties
        {
            "allowed_token_ids": tuple(range(2, 20, 2)),
            "logit_bias": ((4, 3.0), (5, 100.0)),
            "repetition_penalty": 1.5,
            "frequency_penalty": 0.7,
            "presence_penalty": 0.4,
            "min_tokens": 5,
        },
        {"bad_words_token_ids": tuple((t, u) for t in range(3, 20) for u in (6, 7))},
        {"bad_words_token_ids": ((9,),), "allowed_token_ids": (9, 10, 11), "logit_bias": ((9, 5),)},
        {"stop_token_ids": (3,), "n": 2},  # stop tokens alone: no processing
    ]
    seqs = [_seq(_random_tokens(rng, 7), _random_tokens(rng, 3), **c) for c in combos]
    want = [False, True, False, True, True, True, False, True, True, True, False]
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


def test_bad_words_match_the_output_tail_only():
    prompt, out = [30, 31, 9], [10, 11, 12]
    words = {
        (12, 20): True,  # prefix (12,) is the output's tail
        (11, 12, 25): True,  # a two-token prefix that is the tail
        (10, 11, 12, 22): True,  # as long as the output + 1: the whole output is the prefix
        (24,): True,  # one token: banned at every step
        (11, 21): False,  # 11 is in the output, but not at its end
        (10, 12, 26): False,
        (9, 10, 11, 12, 23): False,  # longer than output + 1 (the prompt's 9 never counts)
        (12, VOCAB): False,  # past the logits: skipped, no error
        (VOCAB + 3,): False,
    }
    seq = _seq(prompt, out, bad_words_token_ids=tuple(words))
    fresh = _seq(prompt, [], bad_words_token_ids=((24,), (9, 27), (10, 28)))
    logits = torch.zeros(2, VOCAB)
    apply_logits_processors(logits, [seq, fresh], EOS)
    masked = {w[-1] for w, banned in words.items() if banned}
    assert set(torch.isinf(logits[0]).nonzero().flatten().tolist()) == masked
    # No output yet: only the one-token word (the prompt's 9 is no prefix for (9, 27)).
    assert torch.isinf(logits[1]).nonzero().flatten().tolist() == [24]


def test_allowed_token_ids_keep_their_logits_and_mask_the_rest():
    logits = _random_logits(3, seed=12)
    before = logits.clone()
    seqs = [
        _seq([3], [4], allowed_token_ids=(7, 3, 7, VOCAB, VOCAB + 100)),
        _seq([3], [4]),
        # Only ids past the logits: every logit -inf (refusing such a list is the router's job).
        _seq([3], [4], allowed_token_ids=(VOCAB,)),
    ]
    apply_logits_processors(logits, seqs, EOS)
    kept = ~torch.isinf(logits[0])
    assert kept.nonzero().flatten().tolist() == [3, 7]
    assert torch.equal(logits[0, kept], before[0, kept])  # exactly, not recomputed
    assert torch.equal(logits[1], before[1])
    assert bool(torch.isinf(logits[2]).all()) and bool((logits[2] < 0).all())


def test_a_bias_does_not_lift_a_disallowed_or_bad_token():
    # allowed_token_ids and bad words come first: a +100 bias on a masked token stays -inf.
    logits = torch.zeros(2, VOCAB)
    seqs = [
        _seq([3], [], allowed_token_ids=(4, 5), logit_bias=((6, 100.0), (4, 1.0))),
        _seq([3], [8], bad_words_token_ids=((8, 6),), logit_bias=((6, 100.0),)),
    ]
    apply_logits_processors(logits, seqs, EOS)
    assert logits[0, 6] == -INF and logits[0, 4] == 1.0 and logits[0, 5] == 0.0
    assert logits[1, 6] == -INF


def test_allowed_ids_on_non_contiguous_logits():
    wide = _random_logits(2, vocab=VOCAB + 16, seed=13)
    logits = wide[:, :VOCAB]
    before = wide.clone()
    seqs = [_seq([3], [4], allowed_token_ids=(1, 2, 30)), _seq([3], [4], repetition_penalty=1.5)]
    apply_logits_processors(logits, seqs, EOS)
    assert torch.equal(wide[:, VOCAB:], before[:, VOCAB:])
    assert torch.isinf(logits[0]).sum() == VOCAB - 3
    assert torch.equal(logits[0, [1, 2, 30]], before[0, [1, 2, 30]])


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


def _allowed_ids(eos) -> tuple[int, ...]:
    # No eos among them: transformers' generate would stop at one, the engine (ignore_eos) not.
    g = torch.Generator().manual_seed(1)
    return tuple(sorted(set(torch.randint(3, 1000, (40,), generator=g).tolist()) - set(eos)))


def _hf_generate_allowed(path, prompt: list[int], allowed, max_new: int, eos) -> list[int]:
    """transformers' own constrained greedy decoding (PrefixConstrainedLogitsProcessor)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = _hf_model(str(path)).generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            prefix_allowed_tokens_fn=lambda batch, sent: list(allowed),
            pad_token_id=eos[0],
        )
    return out[0, len(prompt) :].tolist()


def test_allowed_token_ids_greedy_matches_hf(tiny):
    path, llm, eos = tiny
    prompts = _prompts()
    allowed = _allowed_ids(eos)
    sp = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, allowed_token_ids=allowed
    )
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts + prompts, [sp] * len(prompts) + [plain] * len(prompts))
    processed, untouched = outs[: len(prompts)], outs[len(prompts) :]
    for p, o in zip(prompts, processed, strict=True):
        assert set(o.token_ids) <= set(allowed)
        assert o.token_ids == hf_processed_greedy(path, p, sp, eos), f"{len(p)}-token prompt"
        assert o.token_ids == _hf_generate_allowed(path, p, allowed, MAX_TOKENS, eos)
    for p, o in zip(prompts, untouched, strict=True):
        assert o.token_ids == hf_processed_greedy(path, p, plain, eos)
    assert all(a.token_ids != b.token_ids for a, b in zip(processed, untouched, strict=True))


def test_bad_words_greedy_matches_hf(tiny):
    path, llm, eos = tiny
    prompts = _prompts()
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    base = [o.token_ids for o in llm.generate(prompts, plain)]
    jobs = []  # (prompt, its plain output, the bad word): words taken from the plain output
    for p, b in zip(prompts, base, strict=True):
        jobs += [
            (p, b, (b[3],)),  # a token it emits at step 3: banned from the first step on
            (p, b, (b[6], b[7])),  # the pair at steps 6-7: step 7 at the latest must change
            (p, b, (b[4], b[5], b[6])),
            # Across the prompt / output boundary: not banned (output tokens only).
            (p, b, (p[-1], b[0])),
        ]
    sps = [replace(plain, bad_words_token_ids=(word,)) for _, _, word in jobs]
    outs = llm.generate([p for p, _, _ in jobs], sps)
    for (p, b, word), sp, o in zip(jobs, sps, outs, strict=True):
        assert o.token_ids == hf_processed_greedy(path, p, sp, eos), word
        if word == (p[-1], b[0]):
            assert o.token_ids[0] == b[0]
            continue
        assert o.token_ids != b
        k = len(word)
        assert all(tuple(o.token_ids[j : j + k]) != word for j in range(len(o.token_ids)))


def test_bad_word_across_the_kv_hand_off(tiny):
    """Split prefill / decode: the decode worker's output starts with the prefill worker's first
    token, so a word (first token, second token) is banned at the decode worker's first step."""
    from kv_copy import CopyConnector

    from engine.llm_engine import EngineConfig, LLMEngine

    path, llm, eos = tiny
    prompt = _prompts()[1]
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (base,) = [o.token_ids for o in llm.generate([prompt], plain)]
    sp = replace(plain, bad_words_token_ids=((base[0], base[1]),))
    kw = dict(model=str(path), dtype="float32", num_kv_blocks=32)
    pe = LLMEngine(EngineConfig(**kw, role="prefill"))
    de = LLMEngine(EngineConfig(**kw, role="decode"))
    CopyConnector(pe, de)
    out: list[int] = []
    pe.add_request("r", prompt, sp)
    for _ in range(100):  # bounded: a hang would be a failure, not a stuck suite
        out += [t for o in pe.step() for t in o.token_ids] if pe.has_unfinished() else []
    assert out == [base[0]]  # the prefill worker's first token
    de.add_remote_request("r", prompt, out[0], sp)
    for _ in range(100):
        out += [t for o in de.step() for t in o.token_ids] if de.has_unfinished() else []
    assert not de.has_unfinished()
    assert (
        out == llm.generate([prompt], sp)[0].token_ids == hf_processed_greedy(path, prompt, sp, eos)
    )
    assert out[1] != base[1]
