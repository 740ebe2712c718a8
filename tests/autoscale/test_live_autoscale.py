"""`tandem serve --autoscale` on local Ray: the planner follows a shift of the prompt mix.

A load of short prompts needs one prefill worker; a shift to long prompts (more prompt tokens
per second than the declared capacity of one prefill worker) makes the planner start a second
one, which registers and serves; a quiet period makes it drain that worker back out. Requests
keep arriving across both events. Every one completes with transformers' greedy text (fp32),
the planner's decisions and pool sizes are visible in /metrics, and every KV block is back at
the end.

The capacity profile is written by the test: it declares one prefill worker good for 1000
prompt tokens/s, so the demand that crosses it is known exactly (the measured CPU profile is
the simulator validation's business, tests/simulator and benchmarks/).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
import time
from collections.abc import Iterator
from itertools import cycle

import openai
import torch

from bench.capacity_profile import CapacityProfile

UP_PREFILL = {"pool": "prefill", "direction": "up"}
THRESHOLD = 8  # prompts of 8+ tokens take the prefill pool
PLANNER_FLAGS = (
    "--autoscale",
    "--min-prefill", "1", "--max-prefill", "2", "--min-decode", "1", "--max-decode", "1",
    "--interval-s", "2", "--down-cooldown-s", "6", "--down-stable-windows", "2",
    "--slo-ttft-ms", "3000", "--slo-tpot-ms", "500",
    "--signal-interval-s", "1",
    # The burst hold keeps the workers a recent 1-s peak needs, decaying by half every this
    # many seconds (15 min by default): short here, or the drain would come minutes later.
    "--burst-half-life-s", "3",
    # The length mix and the share of uncached prompt tokens come from this many seconds of
    # windows: the burst's must leave them before the quiet load's forecast is believed.
    "--history-s", "10",
)  # fmt: skip


def _profile(model) -> CapacityProfile:
    return CapacityProfile(
        model=str(model),
        hardware="declared by the test",
        source="measured",
        prefill_points=[(64, 0.064), (512, 0.512)],  # 1000 prompt tokens/s per worker
        decode_fixed_s=0.002,
        decode_per_seq_s=0.0002,
        decode_per_ctx_token_s=1e-7,
        kv_bytes_per_token=1024,
        transfer_latency_s=0.002,
        transfer_bytes_per_s=1e9,
        kv_capacity_tokens=100_000,
        max_batch_tokens=512,
        max_num_seqs=64,
        startup_s=6.0,
    )


WORDS = "the quick brown fox jumps over a lazy dog while tandem serves prefill and decode".split()


@functools.cache
def _hf(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the requests ignore EOS too
    return model, AutoTokenizer.from_pretrained(path)


@functools.cache
def hf_text(path: str, prompt: str, max_tokens: int) -> str:
    """transformers' greedy continuation (fp32), as text."""
    model, tok = _hf(path)
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
        )
    return tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def _prompts(rng: random.Random, n: int, words: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def _interleave(rare: Iterator[str], common: Iterator[str], every: int) -> Iterator[str]:
    """`rare`'s next prompt as every `every`-th, `common`'s between."""
    for i in itertools.count():
        yield next(rare) if i % every == 0 else next(common)


class Load:
    """Sends completions at a rate from a rotating prompt set; keeps every answer."""

    def __init__(self, url: str) -> None:
        self.client = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=0, timeout=180
        )
        self.results: list[tuple[str, int, str | BaseException]] = []
        self.tasks: list[asyncio.Task] = []

    async def _one(self, prompt: str, max_tokens: int) -> None:
        try:
            r = await self.client.completions.create(
                model="autoscale-model",
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            self.results.append((prompt, max_tokens, r.choices[0].text))
        except Exception as e:  # judged below: every request must complete
            self.results.append((prompt, max_tokens, e))

    async def phase(self, prompts: Iterator[str], rate: float, seconds: float, max_tokens: int):
        """Send the next prompts of `prompts` at `rate` per second for `seconds`; the iterator
        carries on where the previous phase left it."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.tasks.append(asyncio.create_task(self._one(next(prompts), max_tokens)))
            await asyncio.sleep(1.0 / rate)

    async def finish(self) -> None:
        await asyncio.gather(*self.tasks)
        await self.client.close()


def _gauge(server, name: str, pool: str) -> float:
    return server.metrics().get(f'{name}{{pool="{pool}"}}', -1.0)


async def _until(server, name: str, pool: str, value: float, load: Load, feed, limit: float):
    """Keep `feed` sending while waiting for a planner gauge to reach `value`."""
    deadline = time.monotonic() + limit
    while _gauge(server, name, pool) != value:
        planner = {k: v for k, v in server.metrics().items() if k.startswith("tandem_planner")}
        assert time.monotonic() < deadline, (name, pool, planner, server.log_text()[-4000:])
        await feed()


def _log_with(server, lines: tuple[str, ...], timeout_s: float = 30.0) -> str:
    """The server's log once it holds every one of `lines`, or after `timeout_s`: Ray
    forwards an actor's output (the controller's) to the driver's log asynchronously, so a
    line the metrics already reflect can still be on its way."""
    deadline = time.monotonic() + timeout_s
    log = server.log_text()
    while not all(line in log for line in lines) and time.monotonic() < deadline:
        time.sleep(0.5)
        log = server.log_text()
    return log


def test_prompt_shift_adds_a_prefill_worker_and_idle_drains_it(start_serve, e2e_model, tmp_path):
    profile = _profile(e2e_model).save(tmp_path / "profile.json")
    rng = random.Random(7)
    short = cycle(_prompts(rng, 4, 4))
    # The burst's long prompts are all different: a prompt seen before would be a prefix-cache
    # hit, and the planner sizes for the prompt tokens left to compute, not those that arrive.
    burst = iter(_prompts(rng, 2000, 300))
    # The quiet phase: short prompts (prefilled on the decode worker) with a long one every
    # 12th request, so that requests keep crossing the prefill pool's drain while its demand
    # stays a small share of one worker's even at the forecast's upper margin. A steady rate
    # near the burst's keeps the rate forecast's noise estimate low, and 10 requests/s replace
    # the burst's length mix in the planner's history (200 samples) within ~20 s.
    quiet = _interleave(cycle(_prompts(rng, 4, 300)), short, every=12)
    flags = ("--dtype", "float32", "--disagg-threshold", str(THRESHOLD))
    flags += ("--served-model-name", "autoscale-model", "--capacity-profile", str(profile))
    with start_serve(e2e_model, *flags, *PLANNER_FLAGS) as server:

        async def scenario() -> Load:
            load = Load(server.url)
            await load.phase(short, rate=4, seconds=6, max_tokens=6)
            assert _gauge(server, "tandem_planner_desired_replicas", "prefill") == 1
            # ~8 new long prompts/s of ~300 tokens: 2400 uncached tokens/s, over one worker's
            # 1000.
            await _until(
                server, "tandem_planner_replicas", "prefill", 2, load,
                lambda: load.phase(burst, rate=8, seconds=1, max_tokens=6), limit=120,
            )  # fmt: skip
            await _until(
                server, "tandem_planner_replicas", "prefill", 1, load,
                lambda: load.phase(quiet, rate=10, seconds=2, max_tokens=24), limit=120,
            )  # fmt: skip
            await load.finish()
            return load

        try:
            load = asyncio.run(scenario())
        finally:
            import os

            if os.environ.get("TANDEM_TEST_DUMP"):
                print(server.log_text())
        log = _log_with(server, ("started by the planner", "drained by the planner"))
        assert "started by the planner" in log and "drained by the planner" in log, log[-3000:]
        failed = [(p[:30], r) for p, _, r in load.results if isinstance(r, BaseException)]
        assert not failed, failed[:5]
        for prompt, max_tokens, text in load.results:
            assert text == hf_text(str(e2e_model), prompt, max_tokens), prompt[:40]
        planner = {k: v for k, v in server.metrics().items() if k.startswith("tandem_planner")}
        ups = [
            v
            for k, v in planner.items()
            if k.startswith("tandem_planner_decisions_total")
            and all(f'{label}="{value}"' in k for label, value in UP_PREFILL.items())
        ]
        assert ups and ups[0] >= 1, planner
        server.wait_blocks_free(timeout_s=30)
