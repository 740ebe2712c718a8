"""Request-length traces: load a CSV of arrivals and lengths, and scale it for replay.

The format is the Azure LLM inference trace 2023 (the Splitwise traces in ../shared/traces):
columns `TIMESTAMP` (`2023-11-16 18:17:03.9799600`, or plain seconds), `ContextTokens`
(prompt length) and `GeneratedTokens` (output length). Extra columns are ignored.

Lifecycle: `load_trace(path)` -> raw `TraceRequest`s, arrivals in seconds relative to the
earliest row (the first row of a time-sorted trace) -> `scale_trace(...)` -> what a benchmark
replays or a simulator feeds its planner. Both return new lists; nothing is mutated.
"""

from __future__ import annotations

import csv
import gzip
import math
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


def parse_timestamp(text: str) -> tuple[int, float]:
    """(whole seconds since the epoch, fraction) of `2023-11-16 18:17:03.9799600` or of a
    number. Kept in two parts because a float of epoch seconds keeps only microseconds, and
    the Azure traces carry 7 fractional digits (more than `datetime` parses too)."""
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
    whole_text, _, frac = text.partition(".")
    try:
        base = datetime.strptime(whole_text, "%Y-%m-%d %H:%M:%S")
    except ValueError:
        try:
            base = datetime.fromisoformat(whole_text)
        except ValueError as exc:
            raise ValueError(f"unreadable timestamp {text!r}") from exc
    if frac and not frac.isdigit():
        raise ValueError(f"unreadable timestamp {text!r}")
    # Naive datetimes: only differences are used, so the time zone is moot.
    whole = (base.replace(tzinfo=None) - datetime(1970, 1, 1)) // timedelta(seconds=1)
    return int(whole), float("0." + frac) if frac else 0.0


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace CSV. Rows are put in time order (stable), arrivals made relative to the
    earliest one; `limit` keeps the first N rows of the file."""
    path = Path(path)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    rows: list[tuple[tuple[int, float], int, int]] = []
    # A .gz trace (a committed slice) is read through gzip.
    opened = gzip.open(path, "rt", newline="") if path.suffix == ".gz" else path.open(newline="")
    with opened as f:
        reader = csv.DictReader(f)
        fields = [name.strip() for name in (reader.fieldnames or [])]
        missing = {TIMESTAMP_COLUMN, PROMPT_COLUMN, OUTPUT_COLUMN} - set(fields)
        if missing:
            raise ValueError(f"{path}: missing column(s) {sorted(missing)}; found {fields}")
        for lineno, row in enumerate(reader, start=2):
            row = {k.strip(): v for k, v in row.items() if k is not None}
            try:
                rows.append(
                    (
                        parse_timestamp(row[TIMESTAMP_COLUMN]),
                        int(row[PROMPT_COLUMN]),
                        int(row[OUTPUT_COLUMN]),
                    )
                )
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from exc
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    (w0, f0) = rows[0][0]
    return [TraceRequest((w - w0) + (f - f0), p, o) for (w, f), p, o in rows]


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
