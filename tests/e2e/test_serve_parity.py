"""`tandem serve` end to end with the real `openai` client: 32 concurrent greedy requests
(mixed lengths, shared prefixes, some short enough for the local-prefill path) return exactly
the text of transformers' greedy output on the same weights; streaming equals non-streaming;
1 prefill + 1 decode and 2 + 2; every KV block comes back afterwards."""

from __future__ import annotations

import asyncio
import functools
import random

import openai
import pytest
import torch
from e2e_helpers import TransferCheck

THRESHOLD = 24  # prompts shorter than this many tokens take the local-prefill path

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "tandem",
    "serves",
    "many",
    "requests",
    "across",
    "prefill",
    "and",
    "decode",
    "pools",
    "with",
    "paged",
    "caches",
    "and",
    "fast",
    "transfers",
]


def _prompts(n: int = 32, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    shared = " ".join(rng.choice(WORDS) for _ in range(40))
    out = []
    for i in range(n):
        tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
        if i % 3 == 0:
            out.append(shared + " " + tail)  # shares a long prefix: prefix-cache hits
        elif i % 5 == 1:
            out.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))))  # short
        else:
            out.append(tail)
    return out


@functools.cache
def _hf(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


@functools.cache
def hf_text(path, prompt: str, max_tokens: int, ignore_eos: bool) -> tuple[str, int]:
    model, tok = _hf(str(path))
    ids = tok(prompt)["input_ids"]
    eos = model.generation_config.eos_token_id
    if ignore_eos:
        model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
            )
    finally:
        model.generation_config.eos_token_id = eos
    return tok.decode(out[0, len(ids) :], skip_special_tokens=True), len(ids)


async def _complete_all(url: str, prompts, max_tokens, stream: bool, ignore_eos=True):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(prompt, m):
        kwargs = dict(
            model=client_model,
            prompt=prompt,
            max_tokens=m,
            temperature=0,
            extra_body={"ignore_eos": ignore_eos},
        )
        if not stream:
            r = await client.completions.create(**kwargs)
            return r.choices[0].text, r.usage.completion_tokens
        text, n = "", 0
        s = await client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        async for chunk in s:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                n = chunk.usage.completion_tokens
        return text, n

    client_model = (await client.models.list()).data[0].id
    try:
        return await asyncio.gather(*(one(p, m) for p, m in zip(prompts, max_tokens, strict=False)))
    finally:
        await client.close()


POOLS = {
    "1p1d": ["--prefill", "1", "--decode", "1"],
    "2p2d": ["--prefill", "2", "--decode", "2"],
    "colocated": ["--mode", "colocated", "--replicas", "2"],
}


@pytest.fixture(scope="module", params=list(POOLS))
def server(request, start_serve, e2e_model):
    with start_serve(
        e2e_model,
        "--dtype",
        "float32",
        *POOLS[request.param],
        "--disagg-threshold",
        str(THRESHOLD),
        "--max-num-batched-tokens",
        "256",
        # These tests count local/remote decisions and transferred blocks by prompt length,
        # the affinity policy's rule; kv-events decides by what the decode worker already
        # holds (tests/e2e/test_serve_robustness.py covers it live).
        "--routing",
        "affinity",
    ) as sp:
        sp.pools = request.param
        yield sp


def _remote_lengths(model, prompts, max_tokens) -> list[int]:
    lengths = [
        hf_text(model, p, m, ignore_eos=True)[1] for p, m in zip(prompts, max_tokens, strict=True)
    ]
    return [n for n in lengths if n >= THRESHOLD]


def test_32_concurrent_match_hf(server, e2e_model):
    prompts = _prompts()
    max_tokens = [8 + (i * 7) % 17 for i in range(len(prompts))]
    before = server.metrics()
    check = TransferCheck(server, e2e_model)
    results = asyncio.run(_complete_all(server.url, prompts, max_tokens, stream=False))
    local = 0
    for p, m, (text, n) in zip(prompts, max_tokens, results, strict=True):
        expected, plen = hf_text(e2e_model, p, m, ignore_eos=True)
        assert text == expected, f"prompt {p!r} diverged"
        assert n == m
        local += plen < THRESHOLD
    after = server.metrics()
    decisions = {
        k: after[k] - before.get(k, 0)
        for k in after
        if k.startswith("tandem_disagg_decisions_total")
    }
    if server.pools == "colocated":
        assert decisions['tandem_disagg_decisions_total{path="local"}'] == len(prompts)
        server.wait_all_blocks_free()
        return
    assert decisions['tandem_disagg_decisions_total{path="local"}'] == local
    assert decisions['tandem_disagg_decisions_total{path="remote"}'] == len(prompts) - local
    assert 0 < local < len(prompts)
    # Every remote request was answered from KV that crossed over NIXL: none recomputed,
    # none failed, and the decode pool read exactly the prompts' KV blocks.
    check.verify(_remote_lengths(e2e_model, prompts, max_tokens))
    server.wait_all_blocks_free()


def test_stream_equals_non_stream(server, e2e_model):
    prompts = _prompts(12, seed=1)
    max_tokens = [16] * len(prompts)
    plain = asyncio.run(_complete_all(server.url, prompts, max_tokens, stream=False))
    check = TransferCheck(server, e2e_model)
    streamed = asyncio.run(_complete_all(server.url, prompts, max_tokens, stream=True))
    assert streamed == plain
    for p, (text, _) in zip(prompts, streamed, strict=True):
        assert text == hf_text(e2e_model, p, 16, ignore_eos=True)[0]
    server.wait_all_blocks_free()
    if server.pools != "colocated":
        check.verify(_remote_lengths(e2e_model, prompts, max_tokens))


def test_eos_respected_like_hf(server, e2e_model):
    prompts = _prompts(8, seed=2)
    check = TransferCheck(server, e2e_model)
    res = asyncio.run(_complete_all(server.url, prompts, [40] * 8, stream=False, ignore_eos=False))
    for p, (text, _) in zip(prompts, res, strict=True):
        assert text == hf_text(e2e_model, p, 40, ignore_eos=False)[0]
    server.wait_all_blocks_free()
    if server.pools != "colocated":
        check.verify(_remote_lengths(e2e_model, prompts, [40] * 8))


def test_multiturn_benchmark_replay_on_this_server(server):
    """benchmarks/multiturn.py's replay and accounting on this module's server (its smoke
    test: the whole script starts a server per configuration, too slow for the suite): three
    two-turn chats, every turn answered with its exact prompt length, the second turns served
    partly from cache, computed tokens = prompt - cached, per-pool counters summed."""
    from argparse import Namespace

    from benchmarks import multiturn
    from benchmarks import multiturn_workload as mw

    shape = Namespace(conversations=3, turns=2, first_tokens=80, user_tokens=6, answer_tokens=4)
    convs = mw.synthetic_conversations(shape, random.Random(1), 1000)
    before = server.metrics()
    results = asyncio.run(multiturn.replay(server.url, convs, 3))
    assert sorted(results) == [(i, k) for i in range(3) for k in range(2)]
    assert all(results[(i, k)]["prompt_tokens"] == len(convs[i][k][0]) for i, k in results)
    assert sum(results[(i, 1)]["cached_tokens"] for i in range(3)) >= 3 * 64
    pools = multiturn.pool_counters(before)
    if server.pools != "colocated":  # every turn over the threshold: handed off and READ
        was = pools["decode"]["kv_remote_prefills"]
        name = "tandem_kv_remote_prefills_total"
        assert server.wait_counter(name, "decode", was + 6) == was + 6
    s = multiturn.summarize(results, server.metrics(), 1.0)
    cached = sum(r["cached_tokens"] for r in results.values())
    assert s["prefill_tokens_computed"] == s["prompt_tokens"] - cached
    roles = {"colocated"} if server.pools == "colocated" else {"prefill", "decode"}
    assert set(s["pools"]) == roles and s["ttft_ms_p50"] > 0
