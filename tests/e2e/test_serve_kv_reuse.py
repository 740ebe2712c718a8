"""Every part of KV reuse at once through `tandem serve` (1 prefill + 2 decode workers, fp32):
kv-events routing, decode-side reuse, prefix pull and a host-memory tier, with device caches
small enough that conversations evict each other into the host tier. Multi-turn chats (each
turn the last prompt + an answer + new tokens, 8 at a time) must come back token-exact
against transformers, and the counters must show the parts were really used: remote prompts
whose leading blocks the decode worker took from its own cache, blocks demoted to the host
tier, later turns prefilled on the decode worker holding their history. Every block comes
back."""

from __future__ import annotations

import asyncio
import functools
import random

import pytest
from e2e_helpers import hf_greedy_ids

from benchmarks import multiturn

FLAGS = (
    "--dtype", "float32", "--prefill", "1", "--decode", "2", "--disagg-threshold", "8",
    "--num-kv-blocks", "24", "--kv-host-cache-gb", "0.05",
)  # fmt: skip


@functools.cache
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _hf_answer(path, prompt: list[int], max_tokens: int) -> str:
    ids = hf_greedy_ids(path, prompt, max_tokens)
    return _tokenizer(str(path)).decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def server(start_serve, e2e_model):
    with start_serve(e2e_model, *FLAGS) as sp:
        yield sp


def _conversations(seed: int, count: int = 8, turns: int = 4) -> list[list[tuple]]:
    """(prompt, max_tokens) per turn. A first prompt of 72 tokens (remote); each later turn
    either adds 9 tokens to the last prompt (the decode worker lacks at least 9: remote, its
    history reused) or keeps the last prompt's whole blocks and adds 3 (it lacks 3: prefilled
    on the decode worker holding the rest)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(10, 1000) for _ in range(72)]
        conv = [(prompt, 4)]
        for _ in range(turns - 1):
            new = [rng.randrange(10, 1000) for _ in range(9 if rng.random() < 0.5 else 3)]
            keep = prompt if len(new) == 9 else prompt[: len(prompt) // 16 * 16]
            prompt = keep + new
            conv.append((prompt, 4))
        out.append(conv)
    return out


def test_every_reuse_part_on_is_token_exact_and_each_part_is_used(server, e2e_model):
    convs = _conversations(7)
    before = server.metrics()
    results = asyncio.run(multiturn.replay(server.url, convs, 8))
    for (i, k), r in sorted(results.items()):
        prompt, max_tokens = convs[i][k]
        assert r["prompt_tokens"] == len(prompt)
        assert r["text"] == _hf_answer(e2e_model, prompt, max_tokens), (i, k, r["where"])
    after = multiturn.settled_metrics(server)
    delta = {
        role: {name: v - multiturn.pool_counters(before).get(role, {}).get(name, 0.0)
               for name, v in counters.items()}
        for role, counters in multiturn.pool_counters(after).items()
    }  # fmt: skip
    dec = delta["decode"]
    assert dec["kv_remote_prefills"] > 0 and dec["kv_reused_blocks"] > 0, dec
    assert dec["kv_host_demotions"] + delta["prefill"]["kv_host_demotions"] > 0, delta
    assert sum(r["where"].startswith("local") for r in results.values()) > 0
    assert dec["kv_recomputes"] == 0, dec
    server.wait_all_blocks_free()
