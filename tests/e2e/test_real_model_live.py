"""A real model through both pools: `tandem serve` on SmolLM2-135M-Instruct's GGUF file (1
prefill + 1 decode, fp32) answers chat requests with exactly the text transformers' greedy
decoding gives on the same file; short questions take the local-prefill path, questions about
a passage the prefill worker and a NIXL hand-off (proved from the decode pool's counters), and
every KV block comes back."""

from __future__ import annotations

import asyncio
import functools
import json

import openai
import torch
from e2e_helpers import TransferCheck

from cluster.demo import PASSAGES, SHORT_QUESTIONS

THRESHOLD = 64  # the chat template alone is ~30 tokens; a passage makes 100+
MAX_TOKENS = 24


def _conversations() -> list[list[dict]]:
    short = [[{"role": "user", "content": q}] for q in SHORT_QUESTIONS[:3]]
    long_ = [[{"role": "user", "content": f"{p}\n\n{q}"}] for p, q in PASSAGES[:3]]
    return short + long_


@functools.cache
def _hf(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = path.rsplit("/", 1)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder, gguf_file=name)


def hf_answer(path: str, messages: list[dict]) -> tuple[str, int]:
    """transformers' greedy answer (fp32, stopping at EOS like the server) and the prompt's
    length in tokens."""
    model, tok = _hf(path)
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


def test_smollm2_gguf_both_pools_match_transformers(start_serve, smollm2_gguf):
    flags = ("--dtype", "float32", "--prefill", "1", "--decode", "1")
    flags += ("--disagg-threshold", str(THRESHOLD))
    with start_serve(smollm2_gguf, *flags) as server:
        status, body = server.get("/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"
        conversations = _conversations()
        check = TransferCheck(server, smollm2_gguf)
        results = asyncio.run(_chat_all(server.url, conversations))
        remote = []
        for messages, (text, path, prompt_tokens) in zip(conversations, results, strict=True):
            expected, length = hf_answer(str(smollm2_gguf), messages)
            assert text == expected, (messages[-1]["content"][-60:], text, expected)
            assert prompt_tokens == length
            assert path == ("remote" if length >= THRESHOLD else "local"), (length, path)
            if path == "remote":
                remote.append(length)
        assert len(remote) == 3, remote
        check.verify(remote)
        server.wait_all_blocks_free()
