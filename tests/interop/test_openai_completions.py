"""The `openai` client's /v1/completions against a live `tandem serve` (1 prefill + 1 decode,
fp32): every supported field asserted by what it does, against transformers on the same
weights where the answer is determined (greedy, or a filter that leaves only the argmax);
plus vLLM's /tokenize, /detokenize, /version and /v1/models' max_model_len.

SHORT prompts are prefilled on the decode worker, LONG ones on the prefill worker with the KV
handed over (conftest.THRESHOLD), so both paths answer every kind of request.
"""

from __future__ import annotations

import json
import math
import random
import urllib.request

import pytest

from .conftest import THRESHOLD
from .reference import TOL, Processing

SHORT = "The quick brown fox"
LONG = (
    "Once upon a time there was a small village by the sea where the people of the town "
    "would gather every evening to share stories and songs"
)
PROMPTS = pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["local", "remote"])
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def complete(client, model_name):
    def create(**kwargs):
        return client.completions.create(model=model_name, **kwargs)

    return create


def test_prompts_take_both_paths(client, model_name, reference):
    assert len(reference.encode(SHORT)) < THRESHOLD <= len(reference.encode(LONG))
    for prompt, path in ((SHORT, "local"), (LONG, "remote")):
        raw = client.completions.with_raw_response.create(
            model=model_name, prompt=prompt, max_tokens=2
        )
        assert raw.headers["X-Tandem-Path"] == path


def _check_top(reference, top: dict, step, k: int) -> None:
    """A completions top_logprobs dict: the k likeliest tokens plus the chosen one, by their
    strings (several ids can share one string), with transformers' values."""
    candidates: dict[str, list[float]] = {}
    for token, lp in [*step.top(k), (step.token, step.logprob)]:
        candidates.setdefault(reference.token_str(token), []).append(lp)
    assert set(top) == set(candidates), (top, candidates)
    for s, value in top.items():
        assert any(abs(value - c) < TOL for c in candidates[s]), (s, value, candidates[s])


@PROMPTS
def test_logprobs_0_to_5_equal_transformers(complete, reference, prompt):
    steps = reference.greedy(reference.encode(prompt), 6)
    for k in range(6):
        r = complete(prompt=prompt, max_tokens=6, temperature=0, logprobs=k, extra_body=NO_EOS)
        (choice,) = r.choices
        lp = choice.logprobs
        assert choice.text == reference.text([s.token for s in steps])
        assert lp.tokens == [reference.token_str(s.token) for s in steps]
        for got, step in zip(lp.token_logprobs, steps, strict=True):
            assert abs(got - step.logprob) < TOL, (k, got, step.logprob)
        for top, step in zip(lp.top_logprobs, steps, strict=True):
            _check_top(reference, top, step, k)
        offsets = [0]
        for token in lp.tokens[:-1]:
            offsets.append(offsets[-1] + len(token))
        assert lp.text_offset == offsets


@PROMPTS
def test_echo_with_logprobs_scores_the_prompt(complete, reference, prompt):
    ids = reference.encode(prompt)
    steps = reference.greedy(ids, 4)
    r = complete(prompt=prompt, max_tokens=4, temperature=0, echo=True, extra_body=NO_EOS)
    assert r.choices[0].text == prompt + reference.text([s.token for s in steps])
    r = complete(
        prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1, extra_body=NO_EOS
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt)
    assert lp.tokens == [reference.token_str(t) for t in ids + [s.token for s in steps]]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = reference.prompt_logprobs(ids)[1:] + [s.logprob for s in steps]
    for got, exp in zip(lp.token_logprobs[1:], want, strict=True):
        assert abs(got - exp) < TOL, (got, exp)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 4


@PROMPTS
def test_echo_max_tokens_0_scores_the_prompt_alone(complete, reference, prompt):
    ids = reference.encode(prompt)
    r = complete(prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    (choice,) = r.choices
    assert choice.text == prompt
    assert choice.logprobs.tokens == [reference.token_str(t) for t in ids]
    want = reference.prompt_logprobs(ids)
    assert choice.logprobs.token_logprobs[0] is None
    for got, exp in zip(choice.logprobs.token_logprobs[1:], want[1:], strict=True):
        assert abs(got - exp) < TOL, (got, exp)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0


@PROMPTS
def test_n2_seeded_choices_differ_and_reproduce(complete, prompt):
    kwargs = dict(prompt=prompt, n=2, max_tokens=12, temperature=1.0, seed=7, extra_body=NO_EOS)
    r = complete(**kwargs)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text != r.choices[1].text
    assert r.usage.completion_tokens == 24
    again = complete(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


@PROMPTS
def test_best_of_3_answers_the_likeliest_choice(complete, prompt):
    """Choice c of a seeded request samples from seed + c, so n=3 shows the 3 candidates that
    best_of=3 ranks; it answers the one with the highest cumulative logprob."""
    common = dict(prompt=prompt, max_tokens=8, temperature=1.0, seed=11, extra_body=NO_EOS)
    three = complete(n=3, logprobs=0, **common).choices
    assert len({c.text for c in three}) == 3
    best = max(three, key=lambda c: sum(c.logprobs.token_logprobs))
    (choice,) = complete(n=1, best_of=3, **common).choices
    assert choice.index == 0
    assert choice.text == best.text


def test_prompt_list_with_n2_is_prompt_major(complete, reference):
    r = complete(
        prompt=[SHORT, LONG], n=2, echo=True, max_tokens=4, temperature=1.0, seed=3,
        extra_body=NO_EOS,
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c, prompt in zip(r.choices, [SHORT, SHORT, LONG, LONG], strict=True):
        assert c.text.startswith(prompt), (c.index, c.text)
    assert r.choices[2].text != r.choices[3].text
    assert r.usage.prompt_tokens == len(reference.encode(SHORT)) + len(reference.encode(LONG))
    assert r.usage.completion_tokens == 16


PROCESSING = {
    "presence": ({"presence_penalty": 1.5}, Processing(presence=1.5)),
    "frequency": ({"frequency_penalty": 0.7}, Processing(frequency=0.7)),
    "negative-presence": ({"presence_penalty": -2.0}, Processing(presence=-2.0)),
    "repetition": ({"extra_body": {"repetition_penalty": 1.3}}, Processing(repetition=1.3)),
    "all-penalties": (
        {"presence_penalty": 0.5, "frequency_penalty": 0.5,
         "extra_body": {"repetition_penalty": 1.2}},
        Processing(presence=0.5, frequency=0.5, repetition=1.2),
    ),
}  # fmt: skip


@PROMPTS
@pytest.mark.parametrize("case", list(PROCESSING))
def test_penalties_equal_vllm_semantics(complete, reference, prompt, case):
    kwargs, processing = PROCESSING[case]
    ids = reference.encode(prompt)
    steps = reference.greedy(ids, 16, processing)
    plain = reference.greedy(ids, 16)
    assert [s.token for s in steps] != [s.token for s in plain], "the case changes nothing"
    extra = {**NO_EOS, **kwargs.get("extra_body", {})}
    fields = {k: v for k, v in kwargs.items() if k != "extra_body"}
    r = complete(
        prompt=prompt, max_tokens=16, temperature=0, logprobs=1, extra_body=extra, **fields
    )
    assert r.choices[0].text == reference.text([s.token for s in steps])
    # Log-probs are the model's, before any processing.
    for got, step in zip(r.choices[0].logprobs.token_logprobs, steps, strict=True):
        assert abs(got - step.logprob) < TOL, (got, step.logprob)


@PROMPTS
def test_logit_bias_equals_vllm_semantics(complete, reference, prompt):
    ids = reference.encode(prompt)
    first = reference.greedy(ids, 1)[0].token
    bias = {first: -100.0, 500: 4.0}  # the greedy first token banned, one token favoured
    steps = reference.greedy(ids, 12, Processing(bias=bias))
    assert steps[0].token != first
    r = complete(
        prompt=prompt, max_tokens=12, temperature=0, logprobs=0, extra_body=NO_EOS,
        logit_bias={str(t): b for t, b in bias.items()},
    )  # fmt: skip
    assert r.choices[0].text == reference.text([s.token for s in steps])
    for got, step in zip(r.choices[0].logprobs.token_logprobs, steps, strict=True):
        assert abs(got - step.logprob) < TOL, (got, step.logprob)


@PROMPTS
@pytest.mark.parametrize("extra", [{"top_k": 1}, {"min_p": 1.0}], ids=["top_k", "min_p"])
def test_top_k_1_and_min_p_1_sample_the_argmax(complete, reference, prompt, extra):
    want = reference.greedy_text(reference.encode(prompt), 12)
    for seed in (1, 2):
        r = complete(
            prompt=prompt, max_tokens=12, temperature=1.0, seed=seed, extra_body={**NO_EOS, **extra}
        )
        assert r.choices[0].text == want


@PROMPTS
def test_min_tokens_holds_back_eos(complete, reference, prompt):
    eos = reference.eos[0]
    bias = {str(eos): 100}
    r = complete(prompt=prompt, max_tokens=8, temperature=0, logit_bias=bias)
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens <= 1
    steps = reference.greedy(
        reference.encode(prompt), 8, Processing(bias={eos: 100}, min_tokens=3), ignore_eos=False
    )
    assert [s.token for s in steps][3:] == [eos]
    r = complete(
        prompt=prompt, max_tokens=8, temperature=0, logit_bias=bias, extra_body={"min_tokens": 3}
    )
    assert r.choices[0].text == reference.text([s.token for s in steps])
    assert r.choices[0].finish_reason == "stop"


def _stop_string(text: str) -> str:
    """Three printable ASCII characters (a letter among them) from the middle of `text`."""
    for i in range(4, len(text) - 3):
        s = text[i : i + 3]
        if all(c.isascii() and c.isprintable() for c in s) and any(c.isalpha() for c in s):
            return s
    raise AssertionError(f"no stop string in {text!r}")


@PROMPTS
def test_stop_with_and_without_the_stop_string(complete, reference, prompt):
    full = reference.greedy_text(reference.encode(prompt), 16)
    stop = _stop_string(full)
    at = full.index(stop)
    r = complete(prompt=prompt, max_tokens=16, temperature=0, stop=[stop], extra_body=NO_EOS)
    assert r.choices[0].text == full[:at] and r.choices[0].finish_reason == "stop"
    r = complete(
        prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
        extra_body={**NO_EOS, "include_stop_str_in_output": True},
    )  # fmt: skip
    assert r.choices[0].text == full[: at + len(stop)] and r.choices[0].finish_reason == "stop"


def test_skip_special_tokens(complete, reference):
    turn = reference.tokenizer.convert_tokens_to_ids("<|im_start|>")
    common = dict(prompt=SHORT, max_tokens=3, temperature=0, logit_bias={str(turn): 100})
    r = complete(**common)
    assert r.choices[0].text == "" and r.usage.completion_tokens == 3
    r = complete(**common, extra_body={"skip_special_tokens": False})
    assert r.choices[0].text == "<|im_start|>" * 3


@PROMPTS
def test_seed_reproducible(complete, prompt):
    def text(seed):
        r = complete(prompt=prompt, max_tokens=16, temperature=1.0, seed=seed, extra_body=NO_EOS)
        return r.choices[0].text

    first = text(42)
    assert text(42) == first
    assert text(43) != first


@PROMPTS
def test_stream_with_logprobs_equals_non_stream(complete, prompt):
    common = dict(prompt=prompt, max_tokens=10, temperature=0, logprobs=2, extra_body=NO_EOS)
    whole = complete(**common).choices[0]
    text, tokens, lps, tops, finish = "", [], [], [], None
    for chunk in complete(stream=True, **common):
        (c,) = chunk.choices
        assert c.index == 0
        text += c.text
        if c.logprobs is not None:
            tokens += c.logprobs.tokens
            lps += c.logprobs.token_logprobs
            tops += c.logprobs.top_logprobs
        finish = c.finish_reason or finish
    assert text == whole.text and finish == whole.finish_reason == "length"
    assert tokens == whole.logprobs.tokens
    assert tops == whole.logprobs.top_logprobs
    want = whole.logprobs.token_logprobs
    assert len(lps) == len(want)
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(lps, want, strict=True))


@PROMPTS
def test_stream_n2_chunks_carry_both_indexes(complete, prompt):
    common = dict(prompt=prompt, n=2, max_tokens=8, temperature=1.0, seed=5, extra_body=NO_EOS)
    whole = complete(**common)
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in complete(stream=True, **common):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == {0: "length", 1: "length"}


def test_stream_usage_counts_cached_prompt_tokens(complete, reference):
    rng = random.Random(1234)
    words = LONG.split()
    prompt = " ".join(rng.choice(words) for _ in range(120))  # used by no other test
    n_prompt = len(reference.encode(prompt))
    cached = []
    for _ in range(2):
        chunks = list(
            complete(
                prompt=prompt, max_tokens=4, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body=NO_EOS,
            )
        )  # fmt: skip
        *body, last = chunks
        assert all(c.usage is None for c in body) and last.choices == []
        assert last.usage.prompt_tokens == n_prompt and last.usage.completion_tokens == 4
        cached.append(last.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0, cached
    assert 0 < cached[1] <= n_prompt, cached


# ------------------------------------------------------------------ utility endpoints


def _http(url: str, body: dict | None = None) -> dict:
    """GET (no body) or POST a JSON body; the answer's JSON (a non-2xx raises HTTPError)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_tokenize_detokenize_round_trip(server, reference, model_name):
    text = "Hello world, tandem serves tokens."
    body = _http(f"{server.url}/tokenize", {"model": model_name, "prompt": text})
    assert body["tokens"] == reference.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    back = _http(f"{server.url}/detokenize", {"model": model_name, "tokens": body["tokens"]})
    assert back["prompt"] == text
    messages = [{"role": "user", "content": text}]
    chat = _http(f"{server.url}/tokenize", {"model": model_name, "messages": messages})
    assert chat["tokens"] == reference.chat_ids(messages)


def test_version_and_models(server, client, interop_model):
    version = _http(f"{server.url}/version")["version"]
    assert isinstance(version, str) and version
    (model,) = client.models.list().data
    assert model.id == interop_model.name  # the directory's name: clients split ids on "/"
    assert model.max_model_len == 1024  # the tiny llama's max_position_embeddings


def test_every_kv_block_returned(server):
    server.wait_all_blocks_free()
