"""The simulator's input: a trace of requests (arrival, prompt and output length, and the
prompt's block hash ids where the trace has them).

The formats (any of them gzip-compressed, `.gz`):
- the Azure LLM inference trace CSVs (`TIMESTAMP`, `ContextTokens`, `GeneratedTokens`;
  `../shared/traces/*.csv`; 2024's week-long ones, whose timestamps carry a UTC offset), read by
  `bench.traces`;
- BurstGPT's CSV (`Timestamp` in seconds, `Request tokens`, `Response tokens`);
- the Mooncake JSONL format: one JSON object a line with `timestamp` (milliseconds),
  `input_length`, `output_length` and `hash_ids` (one id per `BLOCK_TOKENS`-token block of the
  prompt; equal ids at the same place mean a shared prefix, which a prefix cache can hit);
- ShareGPT conversations (a JSON array, or JSON Lines): no timestamps, so arrivals are drawn
  at a given rate and the lengths counted (`sharegpt.py`);
- a slice of ServeGen's per-client characterization (`*.servegen.json.gz`): not a log of
  requests but rates, burstiness and length PDFs per client, drawn from with a seed
  (`servegen.py`).

Lifecycle: `load_requests(path, fmt)` -> `SimRequest`s in arrival order, arrivals relative to
the first (a ServeGen draw's: to its slice's start) -> `shape_requests(...)` (cut a window,
scale time and lengths, superimpose copies for a higher rate) -> `simulate`.
Every function returns a new list.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from bench.traces import load_trace

from .servegen import draw_servegen
from .sharegpt import is_sharegpt, load_tokenizer_for, sharegpt_requests

FORMATS = ("auto", "azure", "mooncake", "burstgpt", "servegen", "sharegpt")
# BurstGPT's CSV (github.com/HPMLL/BurstGPT): seconds from the trace's start, and token counts.
BURSTGPT_FIELDS = ("Timestamp", "Request tokens", "Response tokens")
# Mooncake's hash_ids cover the prompt in blocks of this many tokens.
BLOCK_TOKENS = 512
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length")


@dataclass(frozen=True, slots=True)
class DrawnArrivals:
    """How to draw arrivals for a trace without timestamps (ShareGPT, `sharegpt.py`): the
    rate (req/s), the gamma shape of the inter-arrivals, the model directory whose tokenizer
    counts the lengths (None: estimated), and whether each conversation gives its first
    exchange or a session of all of them (with the mean think time between turns)."""

    rate: float | None = None
    burstiness: float = 1.0
    tokenizer: str | None = None
    turns: str = "first"  # "all": each conversation a session, one request per exchange
    think_time_s: float = 30.0  # mean seconds between a session's turns


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a trace. Lengths are at least 1: every request has a prompt and makes at
    least its first token. `hash_ids` is empty when the trace has no block ids."""

    arrival_s: float
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"arrival_s must be finite and >= 0, got {self.arrival_s}")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(
                f"prompt_len and output_len must be >= 1, got {self.prompt_len}, {self.output_len}"
            )


def detect_format(path: str | Path) -> str:
    """`servegen` for a .servegen.json(.gz), `azure` (or `burstgpt` by its header) for a
    .csv; otherwise by the first non-empty line: a JSON array or an object with
    `conversations` is ShareGPT, another object (or any line of a .jsonl/.json) Mooncake,
    anything else Azure."""
    path = Path(path)
    suffixes = [x.lower() for x in path.suffixes]
    if suffixes[-1:] == [".gz"]:
        suffixes.pop()
    if suffixes[-2:] == [".servegen", ".json"]:
        return "servegen"
    suffix = suffixes[-1] if suffixes else ""
    if suffix == ".csv":  # Azure unless the header is BurstGPT's
        try:
            with open_text(path) as f:
                header = f.readline()
        except OSError:
            return "azure"
        return "burstgpt" if all(k in header for k in BURSTGPT_FIELDS) else "azure"
    try:
        with open_text(path) as f:
            for line in f:
                if line.strip():
                    if is_sharegpt(line):
                        return "sharegpt"
                    if suffix in (".jsonl", ".json") or line.lstrip().startswith("{"):
                        return "mooncake"
                    return "azure"
    except OSError as e:
        if suffix in (".jsonl", ".json"):
            return "mooncake"  # by its name; reading it will say what is wrong
        raise ValueError(f"cannot read trace {path}: {e}") from e
    raise ValueError(f"{path}: empty trace")


def open_text(path: Path):
    """A trace file as text; `.gz` files are read through gzip (the committed slices under
    benchmarks/traces/ are compressed)."""
    if path.suffix.lower() == ".gz":
        return gzip.open(path, "rt", newline="")
    return path.open(newline="")


def load_requests(
    path: str | Path,
    fmt: str = "auto",
    seed: int = 0,
    start_s: float = 0.0,
    duration_s: float | None = None,
    drawn: DrawnArrivals | None = None,
) -> list[SimRequest]:
    """Read a trace of any format (`fmt` one of FORMATS), in arrival order. `seed`: the draw
    from a ServeGen slice (the other formats are logs of requests and ignore it).
    `start_s`/`duration_s`: the window `shape_requests` will cut, passed down so that an
    Azure CSV keeps only its rows while read (a week of Azure 2024 is 27M rows); the times
    stay relative to the trace's first request, so the cut after it keeps the same rows.
    `drawn`: the arrivals of a ShareGPT trace, which has none (its rate is required)."""
    if fmt not in FORMATS:
        raise ValueError(f"trace format must be one of {FORMATS}, got {fmt!r}")
    path = Path(path)
    if not path.exists():
        raise ValueError(f"no trace at {path}")
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt != "sharegpt" and drawn is not None and drawn != DrawnArrivals():
        raise ValueError(
            f"{path} is a {fmt} trace with its own arrivals and lengths: --request-rate, "
            "--burstiness, --tokenizer, --sharegpt-turns and --think-time-s are for ShareGPT"
        )
    if fmt == "mooncake":
        return load_mooncake(path)
    if fmt == "burstgpt":
        return load_burstgpt(path)
    if fmt == "servegen":
        return [SimRequest(t, p, o) for t, p, o in draw_servegen(path, seed)]
    if fmt == "sharegpt":
        return load_sharegpt(path, drawn or DrawnArrivals(), seed)
    # The Azure CSVs have no zero lengths, but other CSVs might: a request makes >= 1 token.
    return [
        SimRequest(r.arrival_s, max(1, r.prompt_len), max(1, r.output_len))
        for r in load_trace(path, start_s=start_s, duration_s=duration_s)
    ]


def load_sharegpt(path: Path, drawn: DrawnArrivals, seed: int) -> list[SimRequest]:
    """A ShareGPT file as requests (`sharegpt.py`), arrivals drawn at `drawn.rate`."""
    if drawn.rate is None:
        raise ValueError(
            f"{path} is a ShareGPT trace, which has no timestamps: give a request rate "
            "(--request-rate) to draw its arrivals"
        )
    tokenizer = load_tokenizer_for(drawn.tokenizer)
    with open_text(path) as f:
        rows = sharegpt_requests(
            f,
            str(path),
            drawn.rate,
            seed=seed,
            burstiness=drawn.burstiness,
            tokenizer=tokenizer,
            turns=drawn.turns,
            think_time_s=drawn.think_time_s,
            block_tokens=BLOCK_TOKENS,
        )
    return [SimRequest(t, p, o, ids) for t, p, o, ids in rows]


def load_mooncake(path: str | Path) -> list[SimRequest]:
    """Read a Mooncake JSONL trace; a bad line is a ValueError naming the file, line and
    field."""
    path = Path(path)
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    with open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                rows.append(_mooncake_row(line, f"{path}:{lineno}"))
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])  # stable: equal timestamps keep the file's order
    t0 = rows[0][0]
    return [SimRequest((t - t0) / 1000.0, p, o, h) for t, p, o, h in rows]


def load_burstgpt(path: str | Path) -> list[SimRequest]:
    """Read a BurstGPT CSV (`Timestamp` in seconds, `Request tokens`, `Response tokens`; the
    model and log-type columns are ignored; a failed request's 0 response tokens count as one
    token). A bad row is a ValueError naming the file and line."""
    path = Path(path)
    rows: list[tuple[float, int, int]] = []
    with open_text(path) as f:
        reader = csv.DictReader(f)
        missing = [k for k in BURSTGPT_FIELDS if k not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing BurstGPT column(s) {missing}")
        for lineno, row in enumerate(reader, start=2):
            try:
                t = float(row["Timestamp"])
                p, o = int(row["Request tokens"]), int(row["Response tokens"])
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from e
            if not math.isfinite(t) or t < 0 or p < 0 or o < 0:
                raise ValueError(f"{path}:{lineno}: negative or non-finite field")
            rows.append((t, max(1, p), max(1, o)))
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [SimRequest(t - t0, p, o) for t, p, o in rows]


def _mooncake_row(line: str, where: str) -> tuple[float, int, int, tuple[int, ...]]:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{where}: not JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a Mooncake line is a JSON object")
    missing = [k for k in MOONCAKE_FIELDS if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise ValueError(f"{where}: timestamp must be a number of milliseconds, got {ts!r}")
    lengths = []
    for name in ("input_length", "output_length"):
        v = obj[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{where}: {name} must be an integer >= 0, got {v!r}")
        lengths.append(max(1, v))
    hashes = obj.get("hash_ids", [])
    if not isinstance(hashes, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hashes
    ):
        raise ValueError(f"{where}: hash_ids must be a list of integers")
    return float(ts), lengths[0], lengths[1], tuple(hashes)


def shape_requests(
    requests: list[SimRequest],
    *,
    start_s: float = 0.0,
    duration_s: float | None = None,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    max_requests: int | None = None,
    rate_scale: int = 1,
    rate_jitter_s: float = 5.0,
    seed: int = 0,
) -> list[SimRequest]:
    """Cut and scale a trace: keep arrivals in [start_s, start_s + duration_s) (trace seconds),
        re-based to 0; then multiply arrival offsets by `time_scale` (2.0 halves the rate) and
        lengths by `length_scale` (rounded, >= 1); keep the first `max_requests`. Block hash ids
        beyond a scaled prompt are dropped (a block id stands for BLOCK_TOKENS tokens). Then
    `rate_scale` copies are superimposed (`superimpose`)."""
    for name, v, ok in (
        ("start_s", start_s, start_s >= 0),
        ("time_scale", time_scale, time_scale > 0),
        ("length_scale", length_scale, length_scale > 0),
        ("duration_s", duration_s, duration_s is None or duration_s > 0),
        ("max_requests", max_requests, max_requests is None or max_requests >= 1),
    ):
        if not ok or (isinstance(v, float) and not math.isfinite(v)):
            raise ValueError(f"{name} must be > 0 (start_s >= 0), got {v}")
    end = math.inf if duration_s is None else start_s + duration_s
    kept = [r for r in requests if start_s <= r.arrival_s < end]
    if max_requests is not None:
        kept = kept[:max_requests]
    if not kept:
        raise ValueError(f"no requests in [{start_s}, {end}) s of the trace")
    t0 = kept[0].arrival_s
    out = []
    for r in kept:
        prompt = max(1, round(r.prompt_len * length_scale))
        output = max(1, round(r.output_len * length_scale))
        hashes = r.hash_ids[: math.ceil(prompt / BLOCK_TOKENS)]
        out.append(SimRequest((r.arrival_s - t0) * time_scale, prompt, output, hashes))
    return superimpose(out, rate_scale, rate_jitter_s, seed)


def superimpose(
    requests: list[SimRequest], copies: int, jitter_s: float = 5.0, seed: int = 0
) -> list[SimRequest]:
    """`copies` copies of the trace merged in arrival order, copy k shifted by an offset drawn
    uniformly from [0, jitter_s) (copy 0 unshifted; `seed` fixes the draws): `copies` times
    the rate with the trace's own shape kept (its minute-scale swings, length mix and bursts;
    a burst becomes `copies` bursts within `jitter_s`), where compressing time would also
    shorten every swing. Copies k >= 1 get their block hash ids offset so that they share no
    prefix with other copies (distinct users sending alike traffic)."""
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"rate_scale must be an integer >= 1, got {copies!r}")
    if not (math.isfinite(jitter_s) and jitter_s >= 0):
        raise ValueError(f"rate_jitter_s must be >= 0, got {jitter_s}")
    if copies == 1:
        return list(requests)
    rng = random.Random(seed)
    span = 1 + max((h for r in requests for h in r.hash_ids), default=0)
    merged = list(requests)
    for k in range(1, copies):
        offset = rng.uniform(0.0, jitter_s)
        merged.extend(
            SimRequest(
                r.arrival_s + offset,
                r.prompt_len,
                r.output_len,
                tuple(h + k * span for h in r.hash_ids),
            )
            for r in requests
        )
    merged.sort(key=lambda r: r.arrival_s)  # stable: a copy's order within an instant kept
    return merged
