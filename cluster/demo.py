"""`tandem demo` (`make demo`): the whole system on this machine, on a real model.

Serves SmolLM2-135M-Instruct (the GGUF file `tandem fetch-model` keeps in the user's cache;
`make setup` fetches it) on a local Ray cluster with one prefill and one decode actor behind
the router, sends chat requests through the real HTTP API (short questions take the
local-prefill path, questions about a passage the disaggregated path; all streamed), prints each
request's question, the model's answer, where its prefill ran, TTFT and TPOT, then a summary,
and shuts everything down. `--model` serves another directory or .gguf file instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import textwrap
import time
from pathlib import Path

# Short questions: their prompts fall under the disaggregation threshold, so the decode worker
# prefills them itself. Questions about a passage: long prompts, prefilled on the prefill worker
# and handed to the decode worker over NIXL.
SHORT_QUESTIONS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "How many legs does a spider have?",
    "What is the opposite of hot?",
    "Which planet is known as the Red Planet?",
    "Give me a synonym for happy.",
]
PASSAGES = [
    (
        "The water cycle describes how water moves on, above and below the surface of the "
        "Earth. Water evaporates from oceans and lakes, rises as vapour, cools and condenses "
        "into clouds, and falls back as rain or snow. Some of it flows over the land into "
        "rivers, some soaks into the ground and feeds springs and wells, and plants return "
        "part of it to the air through their leaves.",
        "Explain in two sentences how water gets from the ocean back to a river.",
    ),
    (
        "Photosynthesis is the process plants use to make food. In their leaves, chlorophyll "
        "captures the energy of sunlight, which drives the conversion of carbon dioxide from "
        "the air and water from the soil into glucose. Oxygen is released as a by-product, "
        "which is why forests and ocean algae matter so much to the air every animal breathes.",
        "What do plants need for photosynthesis, and what do they give off?",
    ),
    (
        "The Moon is Earth's only natural satellite. It orbits the Earth about once every 27 "
        "days and always shows the same face to us, because it spins once on its axis in the "
        "time it takes to go around the Earth. Its gravity raises the tides in the oceans, and "
        "its phases, from new moon to full moon, come from how much of its sunlit side we see.",
        "Why do we always see the same side of the Moon?",
    ),
    (
        "Bees are insects that collect nectar and pollen from flowers. As a bee moves from "
        "flower to flower, pollen sticks to its hairy body and is carried to the next "
        "blossom, which lets the plant make seeds and fruit. Honey bees live in colonies with "
        "one queen, thousands of workers and a few drones, and they turn nectar into honey.",
        "Why are bees important for fruit?",
    ),
    (
        "A disaggregated LLM server splits the work of answering a prompt in two. Prefill "
        "reads the whole prompt at once and is limited by compute; decode writes the answer "
        "one token at a time and is limited by memory bandwidth. Running them in separate "
        "pools lets each pool use the batch sizes and the number of workers that suit it, and "
        "the key-value cache that prefill computed is copied to the decode worker.",
        "Why would someone run prefill and decode on different machines?",
    ),
    (
        "Recycling turns used materials into new products. Paper is soaked and pulped to make "
        "new paper, glass is crushed and melted to make new bottles, and aluminium cans can be "
        "melted and reshaped again and again without losing quality. Recycling saves energy "
        "and raw materials, and it keeps waste out of landfills.",
        "Which material in the text can be recycled without losing quality?",
    ),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="model directory or .gguf file (default: SmolLM2-135M-Instruct, `tandem fetch-model`)",
    )
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--disagg-threshold", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)


def _messages(i: int) -> tuple[str, list[dict]]:
    """The i-th request: (what to print as its question, its chat messages). Even requests ask
    a short question, odd ones ask about a passage (a long prompt)."""
    if i % 2 == 0:
        question = SHORT_QUESTIONS[(i // 2) % len(SHORT_QUESTIONS)]
        return question, [{"role": "user", "content": question}]
    passage, question = PASSAGES[(i // 2) % len(PASSAGES)]
    return f"[passage] {question}", [{"role": "user", "content": f"{passage}\n\n{question}"}]


async def _one(session, url: str, i: int, max_tokens: int, delay: float) -> dict:
    """One streamed chat completion; TTFT and TPOT measured per token at the client."""
    await asyncio.sleep(delay)
    question, messages = _messages(i)
    body = {
        "model": "demo",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    text, usage = [], {}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        headers = resp.headers
        if resp.status != 200:
            return {
                "i": i,
                "question": question,
                "error": f"HTTP {resp.status}: {await resp.text()}",
            }
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    stamps.append(time.perf_counter())
                    text.append(choice["delta"]["content"])
    end = time.perf_counter()
    return {
        "i": i,
        "question": question,
        "answer": "".join(text),
        "path": headers.get("X-Tandem-Path", "?"),
        "prefill": headers.get("X-Tandem-Prefill-Worker", "?"),
        "decode": headers.get("X-Tandem-Decode-Worker", "?"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "tokens": usage.get("completion_tokens", len(stamps)),
        "e2e": end - t0,
        "ttft": stamps[0] - t0 if stamps else None,
        "tpot": (end - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None,
    }


async def _drive(url: str, n: int, max_tokens: int) -> list[dict]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(
            *(_one(session, url, i, max_tokens, i * 0.15) for i in range(n))
        )


def _default_model() -> Path:
    from tools.real_model import fetch_model

    return fetch_model("smollm2")


def run(args: argparse.Namespace) -> int:
    from cluster.serve import Deployment, ServeSettings

    t0 = time.perf_counter()
    model = Path(args.model) if args.model else _default_model()
    settings = ServeSettings(
        model=str(model),
        prefill=1,
        decode=1,
        port=0,
        num_cpus=os.cpu_count(),
        disagg_threshold=args.disagg_threshold,
        served_model_name="demo",
        engine={"dtype": args.dtype, "max_num_batched_tokens": 1024, "seed": args.seed},
    )
    with Deployment(settings) as dep:
        print(
            f"\nsending {args.requests} chat requests to {model.name} (short questions: local "
            f"prefill on the decode worker; questions about a passage: prefill worker + NIXL "
            f"hand-off)\n",
            flush=True,
        )
        results = asyncio.run(_drive(dep.url, args.requests, args.max_tokens))
        time.sleep(1.0)  # let the last load reports reach the controller
        loads = dep.worker_loads()
    failed = [r for r in results if "error" in r]
    ok = [r for r in results if "error" not in r]
    _print_requests(results)
    _print_summary(ok, loads)
    print(f"  {len(ok)} ok, {len(failed)} failed, {time.perf_counter() - t0:.1f}s in all")
    return 1 if failed else 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _print_requests(results: list[dict]) -> None:
    """Each request: its question and answer, then where its prefill ran and its latencies."""
    for r in results:
        print(f"[{r['i']}] Q: {r['question']}")
        if "error" in r:
            print(f"    FAILED {r['error']}\n")
            continue
        answer = textwrap.fill(
            " ".join(r["answer"].split()) or "(empty)",
            width=96,
            initial_indent="    A: ",
            subsequent_indent="       ",
        )
        print(answer)
        where = "decode worker (local)" if r["path"] == "local" else f"{r['prefill']} (remote)"
        print(
            f"    prefill on {where}, decode on {r['decode']}; {r['prompt_tokens']} prompt + "
            f"{r['tokens']} answer tokens; TTFT {_ms(r['ttft'])} ms, TPOT {_ms(r['tpot'])} ms\n"
        )


def _print_summary(ok: list[dict], loads: dict) -> None:
    """Per-path latency medians, then what the pools did (from their last load reports)."""
    print("\nsummary")
    for path in ("local", "remote"):
        rs = [r for r in ok if r["path"] == path]
        if rs:
            print(
                f"  {path:<6}: {len(rs):>2} requests, TTFT p50 "
                f"{statistics.median(r['ttft'] for r in rs) * 1e3:.1f} ms, TPOT p50 "
                f"{statistics.median(r['tpot'] for r in rs) * 1e3:.1f} ms"
            )
    d, p = loads.get("decode-0", {}), loads.get("prefill-0", {})
    moved = d.get("extra", {}).get("transfer_bytes", 0)
    secs = d.get("extra", {}).get("transfer_seconds", 0) or 1e-9
    print(
        f"  prefill pool: {p.get('extra', {}).get('handoffs', 0)} hand-offs; decode pool: "
        f"{d.get('extra', {}).get('remote_prefills', 0)} remote + "
        f"{d.get('extra', {}).get('local_prefills', 0)} local prefills"
    )
    print(
        f"  KV moved over NIXL: {moved / 2**20:.1f} MiB in {secs * 1e3:.1f} ms "
        f"({moved / secs / 1e9:.2f} GB/s)"
    )
    print(
        f"  KV blocks free after the run: prefill {p.get('num_free_blocks')}/"
        f"{p.get('num_total_blocks')}, decode {d.get('num_free_blocks')}/"
        f"{d.get('num_total_blocks')}"
    )
