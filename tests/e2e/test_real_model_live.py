"""A real model through both pools: `tandem serve` on SmolLM2-135M-Instruct's GGUF file (1
prefill + 1 decode, fp32) answers chat requests with exactly the text transformers' greedy
decoding gives on the same file; short questions take the local-prefill path, questions about
a passage the prefill worker and a NIXL hand-off (proved from the decode pool's counters), and
every KV block comes back. On the same server, lm-evaluation-harness scores a small local
multiple-choice task above chance, with transformers' choices and log-likelihoods."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import torch
from e2e_helpers import TransferCheck
from interop.lm_eval_client import encode_pair, evaluate
from interop.reference import Reference

from cluster.demo import PASSAGES, SHORT_QUESTIONS
from engine.gguf_file import converted_metadata

MC = "tandem_interop_mc"  # six everyday questions, 3-4 choices each
THRESHOLD = 64  # the chat template alone is ~30 tokens; a passage makes 100+
MAX_TOKENS = 24


def _conversations() -> list[list[dict]]:
    short = [[{"role": "user", "content": q}] for q in SHORT_QUESTIONS[:3]]
    long_ = [[{"role": "user", "content": f"{p}\n\n{q}"}] for p, q in PASSAGES[:3]]
    return short + long_


def _greedy_answer(reference: Reference, messages: list[dict]) -> tuple[str, int]:
    """transformers' greedy answer (fp32, stopping at EOS like the server) and the prompt's
    length. `generate` with its KV cache: `Reference.greedy` recomputes the whole sequence
    each step (it keeps every step's raw log-probs), 3x slower for answers this long."""
    ids = reference.chat_ids(messages)
    with torch.no_grad():
        out = reference.model.generate(
            torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False
        )
    return reference.text(out[0, len(ids) :].tolist()), len(ids)


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


@pytest.fixture(scope="module")
def reference(smollm2_hf) -> Reference:
    return Reference(*smollm2_hf)


def test_smollm2_gguf_both_pools_match_transformers(server, smollm2_gguf, reference):
    status, body = server.get("/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"
    conversations = _conversations()
    check = TransferCheck(server, smollm2_gguf)
    results = asyncio.run(_chat_all(server.url, conversations))
    remote = []
    for messages, (text, path, prompt_tokens) in zip(conversations, results, strict=True):
        expected, length = _greedy_answer(reference, messages)
        assert text == expected, (messages[-1]["content"][-60:], text, expected)
        assert prompt_tokens == length
        assert path == ("remote" if length >= THRESHOLD else "local"), (length, path)
        if path == "remote":
            remote.append(length)
    assert len(remote) == 3, remote
    check.verify(remote)
    server.wait_all_blocks_free()


def test_lm_eval_multiple_choice_above_chance_with_transformers_choices(
    server, smollm2_gguf, reference, tmp_path_factory
):
    """lm-evaluation-harness (local-completions, token-id requests) on a small local
    multiple-choice task: the real model scores above chance, and every question's choice and
    every log-likelihood equal transformers' on the same file."""
    status, body = server.get("/v1/models")
    model_name = json.loads(body)["data"][0]["id"]
    # lm-eval loads a tokenizer folder: the GGUF's, as tandem converted it.
    tokenizer = str(converted_metadata(str(smollm2_gguf)))
    result = evaluate(server.url, model_name, tokenizer, [MC], tmp_path_factory.mktemp("ds"))
    samples = result["samples"][MC]
    chance = sum(1 / len(s["doc"]["choices"]) for s in samples) / len(samples)
    assert result["results"][MC]["acc,none"] > chance + 0.25, (result["results"][MC], chance)
    for sample in samples:
        got = [resp[0][0] for resp in sample["resps"]]
        pairs = [encode_pair(reference.tokenizer, *arg) for arg in sample["arguments"]]
        want = [reference.continuation(ctx, cont)[0] for ctx, cont in pairs]
        for g, w in zip(got, want, strict=True):
            assert abs(g - w) < 1e-4, (sample["doc"]["question"], got, want)
        assert max(range(len(got)), key=got.__getitem__) == max(
            range(len(want)), key=want.__getitem__
        ), sample["doc"]["question"]
    server.wait_all_blocks_free()
