"""Requests drawn from a slice of ServeGen's production characterization.

ServeGen (github.com/alibaba/ServeGen, arXiv 2505.09999) publishes two weeks of one Alibaba
Cloud Model Studio language model's traffic per client: per 10-minute window each client's
rate, the CV of its inter-arrival times and the distribution fitted to them (Gamma or
Weibull), and every 6 hours its prompt and answer length PDFs. A slice of it is one gzip JSON
file (`benchmarks/traces/servegen_slice.py` cuts it; format `tandem-servegen-slice/1`).

What the draw keeps from the data, per client and window: the request count (rate x window,
the fraction drawn), the burstiness (inter-arrival times from the fitted family and shape,
then scaled to span the window as the published rate says; a Gamma of shape 0.03 is a client
that sends in bursts minutes apart), and the lengths (each request's prompt and answer drawn
from the client's own PDFs at that time). What it cannot keep: the order of one client's
requests within a window beyond its distribution, and correlation between clients beyond
their shared windows. Seeded: the same file and seed give the same requests.
"""

from __future__ import annotations

import bisect
import gzip
import itertools
import json
import math
import random
from pathlib import Path

SLICE_FORMAT = "tandem-servegen-slice/1"
PATTERNS = ("Gamma", "Weibull")


def draw_servegen(path: str | Path, seed: int = 0) -> list[tuple[float, int, int]]:
    """(arrival s from the slice's start, prompt tokens, answer tokens) per request, in
    arrival order. Raises ValueError naming the file for anything but a slice of the format."""
    path = Path(path)
    doc = _read(path)
    try:
        return _draw(doc, random.Random(seed))
    except (KeyError, TypeError, ValueError) as e:  # a field missing or of the wrong kind
        raise ValueError(f"{path}: bad ServeGen slice ({type(e).__name__}: {e})") from e


def _draw(doc: dict, rng: random.Random) -> list[tuple[float, int, int]]:
    source = doc["source"]
    start, window = float(source["start_s"]), float(source["window_s"])
    rows: list[tuple[float, int, int]] = []
    for client in doc["clients"]:
        pdfs = {
            t: (_Sampler(v["input"]), _Sampler(v["output"])) for t, v in client["lengths"].items()
        }
        for t, rate, _cv, pattern, p1, p2 in client["windows"]:
            count = _count(float(rate) * window, rng)
            if not count:
                continue
            prompts, answers = pdfs[str(t)]
            for at in _arrivals(pattern, p1, p2, count, window, rng):
                rows.append((t - start + at, prompts.draw(rng), answers.draw(rng)))
    rows.sort(key=lambda r: r[0])
    return rows


def _read(path: Path) -> dict:
    try:
        with gzip.open(path, "rt") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a gzip JSON ServeGen slice ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != SLICE_FORMAT:
        raise ValueError(f"{path}: not a {SLICE_FORMAT} file")
    return doc


def _count(mean: float, rng: random.Random) -> int:
    """The whole part of `mean` requests, plus one with the fraction's probability."""
    whole = math.floor(mean)
    return whole + (rng.random() < mean - whole)


def _arrivals(
    pattern: str, p1: float, p2: float, count: int, window: float, rng: random.Random
) -> list[float]:
    """`count` arrival offsets within [0, window): gaps from the fitted family (shape p1,
    scale p2), scaled so that they span the window, starting at a uniform phase of the first
    gap (a window does not begin with an arrival)."""
    if pattern not in PATTERNS or p1 <= 0 or p2 <= 0:
        return sorted(rng.uniform(0, window) for _ in range(count))  # no fit: Poisson
    gaps = [_gap(pattern, p1, p2, rng) for _ in range(count)]
    gaps[0] *= rng.random()
    total = sum(gaps) + _gap(pattern, p1, p2, rng) * rng.random()
    scale = window / total if total > 0 else 0.0
    return [min(t * scale, math.nextafter(window, 0)) for t in itertools.accumulate(gaps)]


def _gap(pattern: str, shape: float, scale: float, rng: random.Random) -> float:
    if pattern == "Gamma":
        return rng.gammavariate(shape, scale)
    return rng.weibullvariate(scale, shape)


class _Sampler:
    """Draws from a published PDF: [[tokens, probability], ...] ascending; at least 1 token."""

    def __init__(self, pairs: list[list[float]]) -> None:
        if not pairs:
            raise ValueError("a ServeGen length PDF is empty")
        self.values = [max(1, int(v)) for v, _ in pairs]
        self.cumulative = list(itertools.accumulate(float(p) for _, p in pairs))

    def draw(self, rng: random.Random) -> int:
        u = rng.random() * self.cumulative[-1]
        return self.values[min(bisect.bisect_right(self.cumulative, u), len(self.values) - 1)]
