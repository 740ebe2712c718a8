"""Request-length traces: load a CSV of arrivals and lengths, and scale it for replay.

The format is the Azure LLM inference traces' (2023, the Splitwise traces in ../shared/traces,
and 2024, DynamoLLM's week-long ones): columns `TIMESTAMP` (`2023-11-16 18:17:03.9799600`,
`2024-05-10 00:00:00.009930+00:00`, or plain seconds), `ContextTokens` (prompt length) and
`GeneratedTokens` (output length). Extra columns are ignored.

Lifecycle: `load_trace(path)` -> raw `TraceRequest`s, arrivals in seconds relative to the
earliest row (the first row of a time-sorted trace) -> `scale_trace(...)` -> what a benchmark
replays or a simulator feeds its planner. Both return new lists; nothing is mutated.
"""

from __future__ import annotations

import csv
import functools
import gzip
import math
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

TIMESTAMP_COLUMN = "TIMESTAMP"
PROMPT_COLUMN = "ContextTokens"
OUTPUT_COLUMN = "GeneratedTokens"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: when it arrives and how long its prompt and output are."""

    arrival_s: float  # seconds after the trace's first request
    prompt_len: int
    output_len: int

    def __post_init__(self) -> None:
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"arrival_s must be finite and >= 0, got {self.arrival_s}")
        if self.prompt_len < 0 or self.output_len < 0:
            raise ValueError(
                f"lengths must be >= 0, got prompt_len={self.prompt_len} "
                f"output_len={self.output_len}"
            )


@dataclass(frozen=True, slots=True)
class TraceSummary:
    """What a report says about a (scaled) trace."""

    num_requests: int
    span_s: float  # first to last arrival
    rate_rps: float  # requests per second over the span (inf for a single instant)
    mean_prompt_len: float
    mean_output_len: float

    def to_dict(self) -> dict[str, float | int | str]:
        return {
            "num_requests": self.num_requests,
            "span_s": self.span_s,
            "rate_rps": self.rate_rps if math.isfinite(self.rate_rps) else "inf",
            "mean_prompt_len": self.mean_prompt_len,
            "mean_output_len": self.mean_output_len,
        }


# `2023-11-16 18:17:03.9799600` (Azure 2023: 7 fractional digits, no zone) and
# `2024-05-10 00:00:00.009930+00:00` (Azure 2024: microseconds or none, a UTC offset); a `T`
# between date and time and a `Z` zone are ISO 8601's and read too.
_TIMESTAMP = re.compile(
    r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?"
)
_EPOCH = datetime(1970, 1, 1)


def parse_timestamp(text: str) -> tuple[int, float]:
    """(whole seconds since the epoch, fraction) of a date-time (see `_TIMESTAMP`) or of a
    number. Kept in two parts because a float of epoch seconds keeps only microseconds, and
    the Azure 2023 traces carry 7 fractional digits (more than `datetime` parses). A UTC
    offset is taken off, so rows in different zones (or either side of a DST change) keep
    their true order and spacing; a date-time without one is read as UTC."""
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(value):
            raise ValueError(f"unreadable timestamp {text!r}")
        whole = math.floor(value)
        return whole, value - whole
    match = _TIMESTAMP.fullmatch(text)
    if match is None:
        raise ValueError(f"unreadable timestamp {text!r}")
    day, clock, frac, zone = match.groups()
    try:
        whole = _whole_seconds(day, clock, zone)
    except ValueError as exc:  # a well-formed but impossible date (2024-02-30)
        raise ValueError(f"unreadable timestamp {text!r}") from exc
    return whole, float("0." + frac) if frac else 0.0


@functools.lru_cache(maxsize=4096)
def _whole_seconds(day: str, clock: str, zone: str | None) -> int:
    """Epoch seconds of a date and a clock time in `zone` (cached: a trace's consecutive rows
    share their second, and `strptime` is most of a row's parse)."""
    base = datetime.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M:%S")
    whole = (base - _EPOCH) // timedelta(seconds=1)
    if zone and zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        digits = zone[1:].replace(":", "")
        whole -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    return int(whole)


def load_trace(
    path: str | Path,
    limit: int | None = None,
    start_s: float = 0.0,
    duration_s: float | None = None,
) -> list[TraceRequest]:
    """Read a trace CSV. Rows are put in time order (stable), arrivals made relative to the
    earliest one; `limit` keeps the first N rows kept. `start_s`/`duration_s` keep only
    the rows arriving in [start_s, start_s + duration_s) (times still relative to the
    earliest row): the same rows a cut after loading keeps, without holding the rest. Azure
    2024's week-long files hold 17M and 27M rows; every row is still read (one out of order
    must be found), but only the window's are kept."""
    path = Path(path)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if not start_s >= 0 or (duration_s is not None and not duration_s > 0):
        raise ValueError(f"want start_s >= 0 and duration_s > 0, got {start_s}, {duration_s}")
    end = math.inf if duration_s is None else start_s + duration_s
    windowed = start_s > 0 or math.isfinite(end)
    rows, in_order, first = _read_rows(path, limit, (start_s, end) if windowed else None)
    if windowed and not in_order:  # the earliest row is not the first: keep all, then cut
        rows, _, _ = _read_rows(path, limit, None)
    if not rows:
        raise ValueError(f"{path}: no requests" + (" in the window" if windowed else ""))
    rows.sort(key=lambda r: r[0])
    (w0, f0) = first if windowed and in_order else rows[0][0]
    out = [TraceRequest((w - w0) + (f - f0), p, o) for (w, f), p, o in rows]
    if windowed and not in_order:
        out = [r for r in out if start_s <= r.arrival_s < end]
        if not out:
            raise ValueError(f"{path}: no requests in the window")
    return out


Row = tuple[tuple[int, float], int, int]


def _read_rows(
    path: Path, limit: int | None, window: tuple[float, float] | None
) -> tuple[list[Row], bool, tuple[int, float] | None]:
    """(the rows, whether their timestamps never went back, the first row's timestamp).
    With `window`, only rows whose time after the first row falls in it are kept, which is
    the window relative to the earliest row exactly when the file is in time order (the
    caller rereads otherwise)."""
    rows: list[Row] = []
    in_order, first, last = True, None, None
    # A .gz trace (a committed slice) is read through gzip.
    opened = gzip.open(path, "rt", newline="") if path.suffix == ".gz" else path.open(newline="")
    with opened as f:
        reader = csv.reader(f)
        header = [name.strip() for name in next(reader, [])]
        missing = {TIMESTAMP_COLUMN, PROMPT_COLUMN, OUTPUT_COLUMN} - set(header)
        if missing:
            raise ValueError(f"{path}: missing column(s) {sorted(missing)}; found {header}")
        cols = [header.index(c) for c in (TIMESTAMP_COLUMN, PROMPT_COLUMN, OUTPUT_COLUMN)]
        for lineno, row in enumerate(reader, start=2):
            if not row:
                continue
            try:
                ts, prompt, output = (row[i] for i in cols)
                stamp = parse_timestamp(ts)
                lengths = int(prompt), int(output)
            except (IndexError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: {exc or 'missing field'}") from exc
            first = first or stamp
            in_order = in_order and (last is None or stamp >= last)
            last = stamp
            if window is not None:
                t = (stamp[0] - first[0]) + (stamp[1] - first[1])
                if not window[0] <= t < window[1]:
                    continue
            rows.append((stamp, *lengths))
            if limit is not None and len(rows) >= limit:
                break
    return rows, in_order, first


def scale_trace(
    requests: list[TraceRequest],
    *,
    length_scale: float = 1.0,
    time_scale: float = 1.0,
    max_input: int | None = None,
    max_output: int | None = None,
    num_requests: int | None = None,
) -> list[TraceRequest]:
    """Shrink or stretch a trace for replay.

    `length_scale` multiplies prompt and output lengths (rounded, at least 1 token, then capped
    by `max_input`/`max_output`); `time_scale` multiplies every arrival offset, so 2.0 halves
    the request rate; `num_requests` keeps the first N requests."""
    if not (length_scale > 0 and math.isfinite(length_scale)):
        raise ValueError(f"length_scale must be > 0, got {length_scale}")
    if not (time_scale >= 0 and math.isfinite(time_scale)):
        raise ValueError(f"time_scale must be >= 0, got {time_scale}")
    for name, cap in (("max_input", max_input), ("max_output", max_output)):
        if cap is not None and cap < 1:
            raise ValueError(f"{name} must be >= 1, got {cap}")
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    chosen = requests if num_requests is None else requests[:num_requests]
    out = []
    for r in chosen:
        prompt = max(1, round(r.prompt_len * length_scale))
        output = max(1, round(r.output_len * length_scale))
        if max_input is not None:
            prompt = min(prompt, max_input)
        if max_output is not None:
            output = min(output, max_output)
        out.append(TraceRequest(r.arrival_s * time_scale, prompt, output))
    return out


def summarize_trace(requests: list[TraceRequest]) -> TraceSummary:
    if not requests:
        raise ValueError("empty trace")
    n = len(requests)
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    return TraceSummary(
        num_requests=n,
        span_s=span,
        # n-1 intervals cover the span: the rate a Poisson process with that mean would have.
        rate_rps=(n - 1) / span if span > 0 else math.inf,
        mean_prompt_len=sum(r.prompt_len for r in requests) / n,
        mean_output_len=sum(r.output_len for r in requests) / n,
    )
