"""Synthetic request traces of known shape, for judging the planner beside the real traces.

The real traces (Azure 2023, the Mooncake slices) are four: a planner tuned on them may still
fail on a load of a kind they lack. These are one hour each, seeded, with the shapes a
deployment meets: a flat load (a planner can at best tie the static split), a day's swing, a
step up and down, arrivals in clumps (a flat mean, overdispersed: batch jobs, retries, agent
fan-out), and a long-context swing under a loose target. Arrivals are a Poisson process of the
shape's rate (drawn by thinning), lengths log-normal: chat prompts with a median of 1k tokens
(mean ~1.6k, capped at 32k) and answers with a median of 150 (mean ~200, capped at 4k); the
long-context prompts a median of 8k (capped at 128k). No prefix reuse (no block ids).

`python benchmarks/synthetic_traces.py SHAPE [--seed N]` prints the trace's request count,
mean rate and per-minute peak over mean; benchmarks/autoscale_results.py takes them as
`--traces syn-flat,syn-diurnal,...`.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # allow `python benchmarks/synthetic_traces.py` from anywhere
    sys.path.insert(0, str(REPO))

from cluster.simulator.traces import SimRequest  # noqa: E402

HOUR_S = 3600.0


@dataclass(frozen=True)
class Shape:
    rate: Callable[[float], float]  # requests/s at t seconds
    prompt: tuple[float, float, int]  # log-normal (median, sigma, cap)
    output: tuple[float, float, int]
    clump: float = 1.0  # mean requests per arrival (geometric), spread over CLUMP_SPREAD_S


CHAT_PROMPT, CHAT_OUTPUT = (1000.0, 1.0, 32768), (150.0, 0.8, 4096)
CLUMP_SPREAD_S = 2.0


def _swing(mean: float, amplitude: float, period_s: float) -> Callable[[float], float]:
    """`mean` x (1 + amplitude sin), starting at the trough."""
    return lambda t: mean * (1 + amplitude * math.sin(2 * math.pi * t / period_s - math.pi / 2))


SHAPES = {
    "flat": Shape(lambda t: 60.0, CHAT_PROMPT, CHAT_OUTPUT),
    "diurnal": Shape(_swing(60.0, 0.5, HOUR_S), CHAT_PROMPT, CHAT_OUTPUT),
    "steps": Shape(lambda t: 100.0 if 1200 <= t < 2400 else 40.0, CHAT_PROMPT, CHAT_OUTPUT),
    "clumped": Shape(lambda t: 60.0, CHAT_PROMPT, CHAT_OUTPUT, clump=10.0),
    "longctx": Shape(_swing(2.5, 0.5, HOUR_S), (8000.0, 1.2, 131072), (150.0, 0.8, 4096)),
}
# The SLO each shape is judged at (TTFT ms, TPOT ms): chat at 1 s / 50 ms, long context at
# Mooncake's 30 s / 100 ms.
SLOS = {name: (30000.0, 100.0) if name == "longctx" else (1000.0, 50.0) for name in SHAPES}


def _length(rng: random.Random, spec: tuple[float, float, int]) -> int:
    median, sigma, cap = spec
    return max(1, min(cap, int(rng.lognormvariate(math.log(median), sigma))))


def generate(name: str, seed: int = 0, duration_s: float = HOUR_S) -> list[SimRequest]:
    """The trace `name` (a key of SHAPES), in arrival order."""
    if name not in SHAPES:
        raise ValueError(f"unknown synthetic trace {name!r}; shapes are {', '.join(SHAPES)}")
    shape, rng = SHAPES[name], random.Random(seed)
    peak = max(shape.rate(t) for t in range(0, int(duration_s) + 1)) / shape.clump
    out, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            break
        if rng.random() * peak > shape.rate(t) / shape.clump:
            continue  # thinning: keep an arrival with probability rate(t) / peak
        size = 1 if shape.clump <= 1 else 1 + int(rng.expovariate(1 / (shape.clump - 1)))
        for _ in range(size):
            at = t if size == 1 else min(t + rng.uniform(0, CLUMP_SPREAD_S), duration_s)
            out.append(SimRequest(at, _length(rng, shape.prompt), _length(rng, shape.output)))
    out.sort(key=lambda r: r.arrival_s)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    reqs = generate(args.shape, args.seed)
    per_minute: dict[int, int] = {}
    for r in reqs:
        per_minute[int(r.arrival_s // 60)] = per_minute.get(int(r.arrival_s // 60), 0) + 1
    mean = len(reqs) / max(len(per_minute), 1)
    print(
        f"{args.shape}: {len(reqs)} requests, {len(reqs) / HOUR_S:.1f} req/s, "
        f"per-minute peak/mean {max(per_minute.values()) / mean:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
