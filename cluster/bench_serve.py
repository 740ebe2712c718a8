"""`tandem bench serve`: an async streaming load generator for any OpenAI-compatible server.

Lifecycle of a run (`run_benchmark`):
1. workload: lengths (random: U[L(1-r), L(1+r)]; trace: the scaled CSV rows), arrival offsets
   (random: Poisson / gamma at --request-rate; trace: its timestamps) and prompts (token ids
   for /v1/completions so the prompt length is exact; random words for /v1/chat/completions,
   so lengths are approximate) are all built up front from --seed;
2. dispatch: each request is started at its arrival offset; --max-concurrency holds it in a
   semaphore until a slot frees (arrivals keep their schedule; the wait is recorded as the
   gap between arrival_s and start_s and drawn on the timeline, while TTFT and E2E are timed
   from the send, as vLLM does);
3. stream: one aiohttp POST with `stream: true`, `stream_options.include_usage`, `ignore_eos`
   and `max_tokens`; each SSE content chunk's arrival is a token timestamp, the usage chunk
   gives the token count (see cluster/bench_metrics.py for how multi-token chunks count);
   HTTP errors, error events, disconnects and streams that end without `[DONE]` or a
   finish_reason are failures, kept with their error and left out of every latency;
4. report: metrics (cluster/bench_metrics.py), a printed table, JSON, PNG plots.

Python API (benchmarks/ call it in-process): `result = await run_benchmark(BenchConfig(...))`,
then `result.to_dict()` / `result.to_json()` / `result.write_json(path)`; `finish(result)` prints
the report and writes the JSON and plots the config names. JSON floats that are infinite (an
all-at-once request rate) are written as the string "inf".

aiohttp is used rather than the openai client so every timestamp is taken as the bytes arrive
and any server works, including ones that only speak the wire format.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import numpy as np
from tqdm import tqdm

from cluster.bench_metrics import BenchMetrics, RequestRecord, compute_metrics, measure_request
from cluster.traces import TraceSummary, load_trace, scale_trace, summarize_trace

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
DEFAULT_RANDOM_PROMPTS = 100

# Short common words: most tokenizers give about one token each, so a chat prompt of N words is
# roughly N tokens (the usage chunk reports the exact count).
_WORD_TEXT = (
    "the of and to in is that it for was on are as with his they at be this from have or by "
    "one had not but what all were when we there can an your which their said if do will each "
    "about how up out them then she many some so these would other into has more her two like "
    "him see time could no make than first been its who now people my made over did down only "
    "way find use may water long little very after words called just where most know"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(slots=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = COMPLETIONS
    model: str | None = None  # None: ask GET /v1/models, else send no model field
    dataset: str = "random"  # "random" or "trace:PATH"
    num_prompts: int | None = None  # random: default 100; trace: the first N rows (None: all)
    input_len: int = 1024
    input_range: float = 0.0
    output_len: int = 128
    output_range: float = 0.0
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    vocab_low: int = 10
    vocab_high: int = 1000
    temperature: float = 0.0
    ignore_eos: bool = True
    api_key: str | None = None
    request_timeout_s: float = 3600.0
    trace_length_scale: float = 1.0
    trace_time_scale: float = 1.0
    trace_max_input: int | None = None
    trace_max_output: int | None = None
    result_json: str | None = None
    plot_dir: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in (COMPLETIONS, CHAT):
            raise ValueError(f"endpoint must be {COMPLETIONS} or {CHAT}, got {self.endpoint!r}")
        if self.dataset != "random" and not (
            self.dataset.startswith("trace:") and len(self.dataset) > len("trace:")
        ):
            raise ValueError(f"dataset must be 'random' or 'trace:PATH', got {self.dataset!r}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input_len and output_len must be >= 1")
        for name in ("input_range", "output_range"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not self.request_rate > 0:
            raise ValueError(
                f"request_rate must be > 0 (inf: all at once), got {self.request_rate}"
            )
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not 0 <= self.vocab_low < self.vocab_high:
            raise ValueError(
                f"need 0 <= vocab_low < vocab_high, got {self.vocab_low}, {self.vocab_high}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if not (self.trace_length_scale > 0 and self.trace_time_scale >= 0):
            raise ValueError("trace_length_scale must be > 0 and trace_time_scale >= 0")
        for name in ("trace_max_input", "trace_max_output"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @property
    def trace_path(self) -> str | None:
        return self.dataset[len("trace:") :] if self.dataset.startswith("trace:") else None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["api_key"] = None if self.api_key is None else "<redacted>"
        out["request_rate"] = _json_float(self.request_rate)
        return out


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    index: int
    arrival_s: float
    prompt_len: int  # requested; exact for token-id prompts
    output_len: int
    prompt: list[int] | str


@dataclass(slots=True)
class Workload:
    requests: list[WorkloadRequest]
    trace: TraceSummary | None = None  # set for trace replays (after scaling)


@dataclass(slots=True)
class BenchResult:
    config: BenchConfig
    metrics: BenchMetrics
    records: list[RequestRecord]
    model: str | None
    started_at: str
    trace: TraceSummary | None = None
    errors: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The JSON document: headline metrics at the top level, then config and requests."""
        out: dict = self.metrics.to_dict()
        cfg = self.config
        out.update(
            {
                "request_rate": (
                    _json_float(self.trace.rate_rps)
                    if self.trace
                    else _json_float(cfg.request_rate)
                ),
                "arrivals": "trace"
                if self.trace
                else (
                    "all-at-once"
                    if math.isinf(cfg.request_rate)
                    else "poisson"
                    if cfg.burstiness == 1.0
                    else "gamma"
                ),
                "burstiness": None if self.trace else cfg.burstiness,
                "max_concurrency": cfg.max_concurrency,
                "slo": {"ttft_ms": cfg.slo_ttft_ms, "tpot_ms": cfg.slo_tpot_ms},
                "model": self.model,
                "endpoint": cfg.endpoint,
                "dataset": cfg.dataset,
                "started_at": self.started_at,
                "errors": dict(self.errors),
                "config": cfg.to_dict(),
                "requests": [r.to_dict() for r in self.records],
            }
        )
        if self.trace:
            out["trace"] = {
                "path": cfg.trace_path,
                "length_scale": cfg.trace_length_scale,
                "time_scale": cfg.trace_time_scale,
                "max_input": cfg.trace_max_input,
                "max_output": cfg.trace_max_output,
                **self.trace.to_dict(),
            }
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n")
        return path


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


# --------------------------------------------------------------------------- workload


def sample_lengths(
    rng: np.random.Generator, n: int, mean_len: int, range_ratio: float
) -> np.ndarray:
    """n integers uniform on [floor(L(1-r)), floor(L(1+r))], inclusive, never below 1."""
    if n < 0 or mean_len < 1 or not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"bad length spec n={n} L={mean_len} r={range_ratio}")
    lo = max(1, math.floor(mean_len * (1.0 - range_ratio)))
    hi = max(lo, math.floor(mean_len * (1.0 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n)


def arrival_offsets(
    rng: np.random.Generator, n: int, request_rate: float, burstiness: float = 1.0
) -> np.ndarray:
    """Arrival offsets in seconds, the first at 0. Intervals are gamma(shape=B, scale=1/(R*B)):
    mean 1/R whatever B; B=1 is a Poisson process, B<1 burstier, B>1 more regular (the
    coefficient of variation of the intervals is 1/sqrt(B)). R=inf sends everything at 0."""
    if n < 0 or not request_rate > 0 or not burstiness > 0:
        raise ValueError(f"bad arrival spec n={n} rate={request_rate} burstiness={burstiness}")
    if n == 0:
        return np.zeros(0)
    if math.isinf(request_rate):
        return np.zeros(n)
    intervals = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(intervals)])


def random_token_ids(rng: np.random.Generator, n: int, low: int, high: int) -> list[int]:
    return rng.integers(low, high, size=n).tolist()


def random_words(rng: np.random.Generator, n: int) -> str:
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=n))


def build_workload(config: BenchConfig) -> Workload:
    """Every request's arrival, lengths and prompt, from the config and its seed alone."""
    rng = np.random.default_rng(config.seed)
    trace_summary = None
    if config.trace_path is not None:
        rows = scale_trace(
            load_trace(config.trace_path, limit=config.num_prompts),
            length_scale=config.trace_length_scale,
            time_scale=config.trace_time_scale,
            max_input=config.trace_max_input,
            max_output=config.trace_max_output,
        )
        arrivals = [r.arrival_s for r in rows]
        prompt_lens = [r.prompt_len for r in rows]
        output_lens = [r.output_len for r in rows]
        trace_summary = summarize_trace(rows)
    else:
        n = config.num_prompts or DEFAULT_RANDOM_PROMPTS
        prompt_lens = sample_lengths(rng, n, config.input_len, config.input_range).tolist()
        output_lens = sample_lengths(rng, n, config.output_len, config.output_range).tolist()
        arrivals = arrival_offsets(rng, n, config.request_rate, config.burstiness).tolist()
    requests = []
    for i, (arrival, p_len, o_len) in enumerate(
        zip(arrivals, prompt_lens, output_lens, strict=False)
    ):
        if config.endpoint == COMPLETIONS:
            prompt: list[int] | str = random_token_ids(
                rng, p_len, config.vocab_low, config.vocab_high
            )
        else:
            prompt = random_words(rng, p_len)
        requests.append(WorkloadRequest(i, float(arrival), int(p_len), int(o_len), prompt))
    return Workload(requests, trace_summary)


# --------------------------------------------------------------------------- client


def endpoint_url(base_url: str, endpoint: str) -> str:
    """Join base and endpoint; a base that already ends in /v1 is accepted too."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base + endpoint


def build_payload(config: BenchConfig, req: WorkloadRequest, model: str | None) -> dict:
    payload: dict = {
        "max_tokens": req.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        payload["ignore_eos"] = True
    if model is not None:
        payload["model"] = model
    if config.endpoint == COMPLETIONS:
        payload["prompt"] = req.prompt
    else:
        payload["messages"] = [{"role": "user", "content": req.prompt}]
    return payload


_JSON = {"Content-Type": "application/json"}


class RequestFailed(Exception):
    """A request the server answered badly (status, error event, truncated stream)."""


@dataclass(slots=True)
class _Stream:
    chunk_times: list[float] = field(default_factory=list)
    usage_output: int | None = None
    usage_prompt: int | None = None
    finished: bool = False  # [DONE] or a finish_reason seen
    end: float = 0.0


def _chunk_text(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def _read_stream(resp: aiohttp.ClientResponse, chat: bool) -> _Stream:
    """Consume SSE `data:` lines (one JSON event per line, as OpenAI servers send them)."""
    s = _Stream()
    async for raw in resp.content:
        now = time.perf_counter()
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, `: keep-alive` comments, `event:` lines
        data = line[len(b"data:") :].strip()
        if data == b"[DONE]":
            s.finished = True
            s.end = now
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RequestFailed(f"error event: {json.dumps(chunk['error'])[:300]}")
        if _chunk_text(chunk, chat):
            s.chunk_times.append(now)
        for choice in chunk.get("choices") or []:
            if choice.get("finish_reason"):
                s.finished = True
        usage = chunk.get("usage")
        if usage:
            s.usage_output = usage.get("completion_tokens", s.usage_output)
            s.usage_prompt = usage.get("prompt_tokens", s.usage_prompt)
        s.end = now
    return s


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    chat: bool,
    record: RequestRecord,
    t0: float,
) -> None:
    start = time.perf_counter()
    record.start_s = max(0.0, start - t0)
    try:
        async with session.post(url, data=body, headers=_JSON) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300].strip()
                raise RequestFailed(f"HTTP {resp.status}: {body}")
            s = await _read_stream(resp, chat)
        if not s.finished:
            raise RequestFailed("stream ended before [DONE] or a finish_reason")
        if not s.chunk_times:
            raise RequestFailed("stream carried no content")
        timing = measure_request(
            start, s.chunk_times, max(s.end, s.chunk_times[-1]), s.usage_output
        )
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        record.error = f"timeout after {session.timeout.total:g} s"
        return
    except RequestFailed as exc:
        record.error = str(exc)
        return
    except Exception as exc:  # noqa: BLE001 -- one bad request must not end the run: it is counted
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return
    record.ttft_s = timing.ttft_s
    record.e2e_s = timing.e2e_s
    record.itls_s = timing.itls_s
    record.output_len = timing.output_len
    if s.usage_prompt is not None:
        record.prompt_len = s.usage_prompt


async def resolve_model(session: aiohttp.ClientSession, base_url: str) -> str | None:
    """The first model the server lists, or None when it lists none (then no model is sent)."""
    try:
        # A short limit of its own: a server without this route must not stall the start.
        async with session.get(
            endpoint_url(base_url, "/v1/models"), timeout=aiohttp.ClientTimeout(total=10)
        ) as resp:
            if resp.status != 200:
                return None
            data = (await resp.json(content_type=None)).get("data") or []
            return data[0].get("id") if data else None
    except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
        return None


async def run_benchmark(config: BenchConfig) -> BenchResult:
    """Run the whole benchmark in the caller's event loop and return its result (nothing is
    printed or written; `run` does that)."""
    workload = build_workload(config)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # aiohttp caps a session at 100 connections by default, which would silently act as a
    # concurrency limit; the semaphore below is the only limit.
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    sem = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    chat = config.endpoint == CHAT
    url = endpoint_url(config.base_url, config.endpoint)
    records = [
        RequestRecord(r.index, r.arrival_s, r.arrival_s, r.prompt_len, r.output_len)
        for r in workload.requests
    ]
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as session:
        model = config.model or await resolve_model(session, config.base_url)
        bar = tqdm(
            total=len(records),
            disable=not config.progress,
            unit="req",
            desc="bench serve",
            file=sys.stderr,
        )

        async def one(req: WorkloadRequest, record: RequestRecord, t0: float) -> None:
            # Encoded before the clock starts: a long prompt's JSON is not the server's time.
            body = json.dumps(build_payload(config, req, model)).encode()
            if sem is None:
                await _send(session, url, body, chat, record, t0)
            else:
                async with sem:
                    await _send(session, url, body, chat, record, t0)
            bar.update(1)

        t0 = time.perf_counter()
        tasks = []
        for req, record in zip(workload.requests, records, strict=False):
            delay = t0 + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, record, t0)))
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            bar.close()
        duration = time.perf_counter() - t0
    metrics = compute_metrics(records, duration, config.slo_ttft_ms, config.slo_tpot_ms)
    errors = collections.Counter(r.error for r in records if r.error is not None)
    return BenchResult(
        config, metrics, records, model, started_at, workload.trace, dict(errors.most_common())
    )


# --------------------------------------------------------------------------- report


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def format_report(result: BenchResult) -> str:
    m, cfg = result.metrics, result.config
    width = 60
    lines = ["=" * width, " tandem bench serve ".center(width, "="), "=" * width]

    def row(name: str, value: object) -> None:
        lines.append(f"{name:<40}{value!s:>20}")

    row("Endpoint:", cfg.endpoint)
    row("Model:", result.model or "(none sent)")
    row("Dataset:", "trace" if result.trace else "random")
    if result.trace:
        lines.append(f"  trace file: {cfg.trace_path}")
        row(
            "  length scale / time scale:", f"{cfg.trace_length_scale:g} / {cfg.trace_time_scale:g}"
        )
        row("  max input / max output:", f"{cfg.trace_max_input} / {cfg.trace_max_output}")
        row(
            "  offered rate (req/s):",
            _fmt(result.trace.rate_rps) if math.isfinite(result.trace.rate_rps) else "inf",
        )
        row(
            "  mean prompt / output len:",
            f"{result.trace.mean_prompt_len:.1f} / {result.trace.mean_output_len:.1f}",
        )
    else:
        row("Request rate (req/s):", f"{cfg.request_rate:g}")
        row("Burstiness:", f"{cfg.burstiness:g}")
        row("Input len / range:", f"{cfg.input_len} / {cfg.input_range:g}")
        row("Output len / range:", f"{cfg.output_len} / {cfg.output_range:g}")
    row("Max concurrency:", cfg.max_concurrency or "unbounded")
    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    for error, count in list(result.errors.items())[:5]:
        lines.append(f"  {count} x {error[: width - 8]}")
    row("Benchmark duration (s):", _fmt(m.duration_s))
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", _fmt(m.request_throughput))
    slos = [
        f"TTFT<={cfg.slo_ttft_ms:g}ms" if cfg.slo_ttft_ms else "",
        f"TPOT<={cfg.slo_tpot_ms:g}ms" if cfg.slo_tpot_ms else "",
    ]
    row(f"Goodput (req/s) {' '.join(s for s in slos if s) or '(no SLO)'}:", _fmt(m.goodput_rps))
    row("Output token throughput (tok/s):", _fmt(m.output_tok_s))
    row("Total token throughput (tok/s):", _fmt(m.total_tok_s))
    sections = (
        ("Time to First Token", "TTFT", m.ttft_ms),
        ("Time per Output Token (excl. 1st token)", "TPOT", m.tpot_ms),
        ("Inter-token Latency", "ITL", m.itl_ms),
        ("End-to-end Latency", "E2E", m.e2e_ms),
    )
    for title, short, stats in sections:
        lines.append(f" {title} ".center(width, "-"))
        for key in ("mean", "p50", "p90", "p99"):
            row(f"{key.capitalize()} {short} (ms):", _fmt(getattr(stats, key)))
    lines.append("=" * width)
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def _float_or_inf(text: str) -> float:
    return float(text)  # accepts "inf"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    p = parser
    p.add_argument("--base-url", default=d.base_url, help="server root, e.g. http://host:8000")
    p.add_argument("--endpoint", default=d.endpoint, choices=[COMPLETIONS, CHAT])
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--dataset", default=d.dataset, help="'random' or 'trace:PATH' (CSV)")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"requests to send (random: default {DEFAULT_RANDOM_PROMPTS}; "
        "trace: the first N rows, default all)",
    )
    p.add_argument("--input-len", type=int, default=d.input_len)
    p.add_argument(
        "--input-range",
        type=float,
        default=d.input_range,
        help="prompt lengths are uniform on [L(1-r), L(1+r)]",
    )
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--output-range", type=float, default=d.output_range)
    p.add_argument(
        "--request-rate",
        type=_float_or_inf,
        default=d.request_rate,
        help="requests/s of the arrival process (inf: all at once)",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=d.burstiness,
        help="gamma shape of the inter-arrival times (1: Poisson, <1: burstier)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="cap on requests in flight (arrivals keep their schedule)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument(
        "--vocab-low",
        type=int,
        default=d.vocab_low,
        help="prompt token ids are drawn from [low, high)",
    )
    p.add_argument("--vocab-high", type=int, default=d.vocab_high)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let the model stop early (output lengths are then not exact)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout_s,
        help="seconds before one request counts as failed",
    )
    p.add_argument(
        "--trace-length-scale",
        type=float,
        default=d.trace_length_scale,
        help="multiply trace prompt and output lengths by F",
    )
    p.add_argument(
        "--trace-time-scale",
        type=float,
        default=d.trace_time_scale,
        help="stretch trace inter-arrival times by F (2: half the rate)",
    )
    p.add_argument("--trace-max-input", type=int, default=None)
    p.add_argument("--trace-max-output", type=int, default=None)
    p.add_argument("--result-json", default=None, help="write the result JSON here")
    p.add_argument("--plot-dir", default=None, help="write PNG plots into this directory")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        input_range=args.input_range,
        output_len=args.output_len,
        output_range=args.output_range,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        vocab_low=args.vocab_low,
        vocab_high=args.vocab_high,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        api_key=args.api_key,
        request_timeout_s=args.request_timeout,
        trace_length_scale=args.trace_length_scale,
        trace_time_scale=args.trace_time_scale,
        trace_max_input=args.trace_max_input,
        trace_max_output=args.trace_max_output,
        result_json=args.result_json,
        plot_dir=args.plot_dir,
        progress=args.progress,
    )


def finish(result: BenchResult) -> list[Path]:
    """Print the report and write the JSON and plots the config asks for."""
    cfg = result.config
    print(format_report(result))
    written: list[Path] = []
    if cfg.result_json:
        written.append(result.write_json(cfg.result_json))
    if cfg.plot_dir:
        from cluster.bench_plots import plot_results  # matplotlib only when plots are asked

        written += plot_results(
            result.records,
            cfg.plot_dir,
            slo_ttft_ms=cfg.slo_ttft_ms,
            slo_tpot_ms=cfg.slo_tpot_ms,
            label=cfg.dataset,
        )
    for path in written:
        print(f"wrote {path}")
    return written


def run(args: argparse.Namespace) -> int:
    """Exit status 0 when at least one request completed, 1 when none did, 2 on bad flags."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"tandem bench serve: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run_benchmark(config))
    except (ValueError, OSError) as exc:  # unreadable trace, bad trace values
        print(f"tandem bench serve: {exc}", file=sys.stderr)
        return 2
    finish(result)
    return 0 if result.metrics.completed > 0 else 1
