"""A real model through both pools: `tandem serve` on SmolLM2-135M-Instruct's GGUF file (1
prefill + 1 decode, fp32) answers chat requests with exactly the text transformers' greedy
decoding gives on the same file; short questions take the local-prefill path, questions about
a passage the prefill worker and a NIXL hand-off (proved from the decode pool's counters), and
every KV block comes back. On the same server, lm-evaluation-harness scores a small local
multiple-choice task above chance, with transformers' choices and log-likelihoods."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
import torch
from e2e_helpers import TransferCheck

from cluster.demo import PASSAGES, SHORT_QUESTIONS

TASKS = Path(__file__).resolve().parents[1] / "interop" / "tasks"
MC = "tandem_interop_mc"  # six everyday questions, 3-4 choices each
THRESHOLD = 64  # the chat template alone is ~30 tokens; a passage makes 100+
MAX_TOKENS = 24


def _conversations() -> list[list[dict]]:
    short = [[{"role": "user", "content": q}] for q in SHORT_QUESTIONS[:3]]
    long_ = [[{"role": "user", "content": f"{p}\n\n{q}"}] for p, q in PASSAGES[:3]]
    return short + long_


def hf_answer(hf, messages: list[dict]) -> tuple[str, int]:
    """transformers' greedy answer (fp32, stopping at EOS like the server) and the prompt's
    length in tokens."""
    model, tok = hf
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return tok.decode(out[0, len(ids) :], skip_special_tokens=True), len(ids)


async def _chat_all(url: str, conversations: list[list[dict]]) -> list[tuple[str, str, int]]:
    """(text, X-Tandem-Path, prompt tokens) per conversation; odd ones streamed."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=180)
    model = (await client.models.list()).data[0].id

    async def one(i: int, messages: list[dict]):
        kwargs = dict(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        if i % 2 == 0:
            raw = await client.chat.completions.with_raw_response.create(**kwargs)
            r = raw.parse()
            return r.choices[0].message.content, raw.headers["x-tandem-path"], r.usage.prompt_tokens
        text, usage = "", None
        async with client.chat.completions.with_streaming_response.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        ) as resp:
            path = resp.headers["x-tandem-path"]
            async for chunk in await resp.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                usage = chunk.usage or usage
        return text, path, usage.prompt_tokens

    try:
        return await asyncio.gather(*(one(i, m) for i, m in enumerate(conversations)))
    finally:
        await client.close()


@pytest.fixture(scope="module")
def server(start_serve, smollm2_gguf):
    flags = ("--dtype", "float32", "--prefill", "1", "--decode", "1")
    flags += ("--disagg-threshold", str(THRESHOLD))
    with start_serve(smollm2_gguf, *flags) as sp:
        yield sp


def test_smollm2_gguf_both_pools_match_transformers(server, smollm2_gguf, smollm2_hf):
    status, body = server.get("/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"
    conversations = _conversations()
    check = TransferCheck(server, smollm2_gguf)
    results = asyncio.run(_chat_all(server.url, conversations))
    remote = []
    for messages, (text, path, prompt_tokens) in zip(conversations, results, strict=True):
        expected, length = hf_answer(smollm2_hf, messages)
        assert text == expected, (messages[-1]["content"][-60:], text, expected)
        assert prompt_tokens == length
        assert path == ("remote" if length >= THRESHOLD else "local"), (length, path)
        if path == "remote":
            remote.append(length)
    assert len(remote) == 3, remote
    check.verify(remote)
    server.wait_all_blocks_free()


def _continuation_logprob(hf, context: str, continuation: str) -> float:
    """transformers' log-likelihood of `continuation` after `context` (fp32), split as
    lm-eval's TemplateLM._encode_pair splits them (no special tokens)."""
    model, tok = hf
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    n = len(tok(context, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].double()
    lp = torch.log_softmax(logits[n - 1 : -1], dim=-1)
    return float(lp.gather(1, torch.tensor(whole[n:])[:, None]).sum())


def test_lm_eval_multiple_choice_above_chance_with_transformers_choices(
    server, smollm2_gguf, smollm2_hf, tmp_path_factory, monkeypatch
):
    """lm-evaluation-harness (local-completions, token-id requests) on a small local
    multiple-choice task: the real model scores above chance, and every question's choice and
    every log-likelihood equal transformers' on the same file."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from engine.gguf_file import converted_metadata

    monkeypatch.chdir(TASKS)  # the task YAML names its jsonl relative to the working dir
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets")))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    status, body = server.get("/v1/models")
    result = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{server.url}/v1/completions",
            "model": json.loads(body)["data"][0]["id"],
            # lm-eval loads a tokenizer folder: the GGUF's, as tandem converted it.
            "tokenizer": str(converted_metadata(str(smollm2_gguf))),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "num_concurrent": 2,
            "batch_size": 4,
            "max_retries": 1,
            "timeout": 120,
        },
        tasks=[MC],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )
    samples = result["samples"][MC]
    chance = sum(1 / len(s["doc"]["choices"]) for s in samples) / len(samples)
    assert result["results"][MC]["acc,none"] > chance + 0.25, (result["results"][MC], chance)
    for sample in samples:
        got = [resp[0][0] for resp in sample["resps"]]
        want = [_continuation_logprob(smollm2_hf, *arg) for arg in sample["arguments"]]
        for g, w in zip(got, want, strict=True):
            assert abs(g - w) < 1e-4, (sample["doc"]["question"], got, want)
        assert max(range(len(got)), key=got.__getitem__) == max(
            range(len(want)), key=want.__getitem__
        ), sample["doc"]["question"]
    server.wait_all_blocks_free()
