"""Log-probabilities through `tandem serve` on every architecture, disaggregated (1 prefill + 1
decode: the prompt scored on the prefill worker, its KV handed to the decode worker, which
must then be the one that decodes) and colocated: `echo` with `logprobs` gives each prompt
token's and each generated token's log-probability equal to transformers' fp32 log-softmax;
n seeded choices fork from one prompt and repeat exactly; every KV block comes back."""

from __future__ import annotations

import functools

import openai
import pytest
import torch
from e2e_helpers import TransferCheck

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral")
MODES = {"1p1d": ["--prefill", "1", "--decode", "1"], "colocated": ["--mode", "colocated"]}
PROMPT = " ".join(["tandem serves prefill and decode pools with paged caches"] * 4)


@functools.cache
def _hf(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
        AutoTokenizer.from_pretrained(path),
    )


# Every architecture disaggregated; colocated on one (the engine-level test in
# tests/engine/test_logprobs_and_choices.py runs them all colocated; tests/interop and
# test_serve_parity serve llama in every mode). Each case is a server start (~15 s).
CASES = [(a, "1p1d") for a in ARCHS] + [("qwen3", "colocated")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{m}" for a, m in CASES])
def served(request, start_serve, make_tiny_model):
    arch, mode = request.param
    model = make_tiny_model(arch)
    args = ("--dtype", "float32", *MODES[mode], "--disagg-threshold", "8")
    with start_serve(model, *args) as sp:
        sp.model, sp.mode = model, mode
        yield sp
        sp.wait_all_blocks_free()


def _client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def test_echo_logprobs_equal_transformers(served):
    hf, tok = _hf(str(served.model))
    client = _client(served)
    name = client.models.list().data[0].id
    check = TransferCheck(served, served.model) if served.mode == "1p1d" else None
    raw = client.completions.with_raw_response.create(
        model=name, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    r = raw.parse()
    ids = tok(PROMPT)["input_ids"]
    assert raw.headers["X-Tandem-Path"] == ("remote" if served.mode == "1p1d" else "local")
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 4 and lp.token_logprobs[0] is None
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) < 1e-4, p
        assert len(lp.top_logprobs[p]) >= 2
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, pad_token_id=0)
        full = hf(out).logits[0].log_softmax(-1)
    generated = out[0, len(ids) :].tolist()
    for j, token in enumerate(generated):
        got = lp.token_logprobs[len(ids) + j]
        assert abs(got - full[len(ids) - 1 + j, token].item()) < 1e-4, j
    assert r.choices[0].text.startswith(tok.decode(ids, skip_special_tokens=False))
    if check is not None:
        check.verify([len(ids)])


def test_seeded_choices_fork_and_repeat(served):
    client = _client(served)
    name = client.models.list().data[0].id

    def run():
        r = client.completions.create(
            model=name, prompt=PROMPT, max_tokens=6, temperature=1.0, n=3, seed=7,
            logprobs=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert [c.index for c in r.choices] == [0, 1, 2]
        return [c.text for c in r.choices]

    first = run()
    assert len(set(first)) > 1
    assert run() == first
