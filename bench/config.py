"""`BenchConfig`: every setting of one `tandem bench serve` run, validated on construction.

Each field carries its CLI help (`engine.config_flags.setting`), so `bench/cli.py` generates
the flags from this class and every default is written here only (`--goodput`, which takes
several words, is added by bench/cli.py beside them). `to_dict` is the form the result JSON
stores (the API key redacted, an infinite rate as the string "inf").

Datasets: `random`, `trace:PATH` (a request-length CSV, bench/traces.py) or `sharegpt:PATH`
(a ShareGPT JSON, bench/sharegpt.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from bench.vllm_compat import (
    check_goodput,
    parse_metric_percentiles,
    parse_percentile_metrics,
)
from engine.config_flags import parse_float_or_inf, setting

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
DEFAULT_RANDOM_PROMPTS = 100
DATASET_PREFIXES = ("trace:", "sharegpt:")


def json_float(x: float) -> float | str:
    """JSON has no infinity: an infinite float is written as the string "inf" ("-inf")."""
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


@dataclass(slots=True)
class BenchConfig:
    """One `tandem bench serve` run; each field is also its flag (`--base-url`, ...)."""

    base_url: str = setting("http://127.0.0.1:8000", "server root, e.g. http://host:8000")
    endpoint: str = setting(COMPLETIONS, "OpenAI route to load", choices=(COMPLETIONS, CHAT))
    model: str | None = setting(
        None, "model name (unset: the first of GET /v1/models, or none if it lists none)"
    )
    dataset: str = setting(
        "random", "'random', 'trace:PATH' (CSV) or 'sharegpt:PATH' (ShareGPT JSON)"
    )
    num_prompts: int | None = setting(
        None,
        f"requests to send (random, sharegpt: {DEFAULT_RANDOM_PROMPTS} if unset; "
        "trace: the first N rows, all if unset)",
    )
    input_len: int = setting(1024, "mean prompt length in tokens")
    input_range: float = setting(0.0, "prompt lengths are uniform on [L(1-r), L(1+r)]")
    output_len: int = setting(128, "mean output length in tokens (max_tokens)")
    output_range: float = setting(0.0, "output lengths are uniform on [L(1-r), L(1+r)]")
    request_rate: float = setting(
        math.inf, "requests/s of the arrival process (inf: all at once)", parse=parse_float_or_inf
    )
    burstiness: float = setting(
        1.0, "gamma shape of the inter-arrival times (1: Poisson, <1: burstier)"
    )
    max_concurrency: int | None = setting(
        None, "cap on requests in flight (arrivals keep their schedule)"
    )
    seed: int = setting(0, "seed of lengths, arrivals and prompts")
    slo_ttft_ms: float | None = setting(None, "TTFT SLO for goodput, in ms")
    slo_ttft_ms_per_1k: float = setting(
        0.0, "TTFT allowance per 1k prompt tokens added to --slo-ttft-ms for goodput, in ms"
    )
    slo_tpot_ms: float | None = setting(None, "TPOT SLO for goodput, in ms")
    goodput: dict[str, float] | None = setting(
        None, "SLOs in ms by metric (ttft, tpot, e2el): `--goodput ttft:500 tpot:50`", cli=False
    )
    percentile_metrics: str = setting(
        "ttft,tpot,itl",
        "comma-separated metrics (ttft, tpot, itl, e2el) whose mean/median/std/percentiles "
        "the result JSON carries under vLLM's keys (mean_ttft_ms, p99_ttft_ms, ...)",
    )
    metric_percentiles: str = setting(
        "99", "comma-separated percentiles of those metrics, e.g. 25,50,99.9"
    )
    vocab_low: int = setting(10, "prompt token ids are drawn from [low, high)")
    vocab_high: int = setting(1000, "prompt token ids are drawn from [low, high)")
    temperature: float = setting(0.0, "sampling temperature sent with every request")
    ignore_eos: bool = setting(
        True, "send ignore_eos (--no-ignore-eos lets the model stop early: lengths not exact)"
    )
    api_key: str | None = setting(None, "sent as 'Authorization: Bearer KEY'")
    request_timeout_s: float = setting(
        3600.0, "seconds before one request counts as failed", aliases=("--request-timeout",)
    )
    trace_length_scale: float = setting(1.0, "multiply trace prompt and output lengths by F")
    trace_time_scale: float = setting(
        1.0, "stretch trace inter-arrival times by F (2: half the rate)"
    )
    trace_max_input: int | None = setting(None, "cap on a scaled trace prompt length")
    trace_max_output: int | None = setting(None, "cap on a scaled trace output length")
    tokenizer: str | None = setting(
        None,
        "Hugging Face tokenizer (directory or hub id) counting ShareGPT tokens "
        "(unset: --model, else the model the server lists)",
    )
    sharegpt_output_len: int | None = setting(
        None, "max_tokens of every ShareGPT request (unset: the token count of its reply)"
    )
    result_json: str | None = setting(None, "write the result JSON here")
    plot_dir: str | None = setting(None, "write PNG plots into this directory")
    progress: bool = setting(True, "show a progress bar on stderr")

    def __post_init__(self) -> None:
        if self.endpoint not in (COMPLETIONS, CHAT):
            raise ValueError(f"endpoint must be {COMPLETIONS} or {CHAT}, got {self.endpoint!r}")
        if self.dataset != "random" and not any(
            self.dataset.startswith(p) and len(self.dataset) > len(p) for p in DATASET_PREFIXES
        ):
            raise ValueError(
                f"dataset must be 'random', 'trace:PATH' or 'sharegpt:PATH', got {self.dataset!r}"
            )
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
        if not (self.slo_ttft_ms_per_1k >= 0 and math.isfinite(self.slo_ttft_ms_per_1k)):
            raise ValueError(f"slo_ttft_ms_per_1k must be >= 0, got {self.slo_ttft_ms_per_1k}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if not (self.trace_length_scale > 0 and self.trace_time_scale >= 0):
            raise ValueError("trace_length_scale must be > 0 and trace_time_scale >= 0")
        for name in ("trace_max_input", "trace_max_output", "sharegpt_output_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self._check_vllm_keys()

    def _check_vllm_keys(self) -> None:
        parse_percentile_metrics(self.percentile_metrics)
        parse_metric_percentiles(self.metric_percentiles)
        if self.goodput is not None:
            check_goodput(self.goodput)
            for name, flag in (("ttft", self.slo_ttft_ms), ("tpot", self.slo_tpot_ms)):
                if flag is not None and name in self.goodput and self.goodput[name] != flag:
                    raise ValueError(
                        f"--goodput {name}:{self.goodput[name]:g} contradicts "
                        f"--slo-{name}-ms {flag:g}"
                    )

    @property
    def slos(self) -> dict[str, float]:
        """Every goodput SLO in ms by metric (ttft, tpot, e2el): --slo-*-ms and --goodput."""
        out = {"ttft": self.slo_ttft_ms, "tpot": self.slo_tpot_ms} | dict(self.goodput or {})
        return {k: v for k, v in out.items() if v is not None}

    @property
    def percentile_metric_names(self) -> tuple[str, ...]:
        return parse_percentile_metrics(self.percentile_metrics)

    @property
    def metric_percentile_values(self) -> tuple[float, ...]:
        return parse_metric_percentiles(self.metric_percentiles)

    @property
    def dataset_kind(self) -> str:
        """random, trace or sharegpt."""
        return self.dataset.partition(":")[0]

    @property
    def trace_path(self) -> str | None:
        return self.dataset[len("trace:") :] if self.dataset.startswith("trace:") else None

    @property
    def sharegpt_path(self) -> str | None:
        prefix = "sharegpt:"
        return self.dataset[len(prefix) :] if self.dataset.startswith(prefix) else None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["api_key"] = None if self.api_key is None else "<redacted>"
        out["request_rate"] = json_float(self.request_rate)
        return out
