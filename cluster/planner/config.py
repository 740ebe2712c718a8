"""`PlannerConfig`: the SLO targets, bounds and tuning of the planner and its baselines.

One validated dataclass, built once (from `tandem serve --autoscale` / `tandem simulate` flags,
which `engine.config_flags.add_flags(parser, PlannerConfig)` generates from the fields) and
then only read: every policy keeps its own state elsewhere. The knobs a person should not need
(forecast and correction smoothing, length priors) are kept off the command line (`cli=False`)
but stay settable from code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config_flags import setting


@dataclass(slots=True)
class PlannerConfig:
    slo_ttft_ms: float = setting(1000.0, "time-to-first-token target (p90), ms")
    slo_ttft_ms_per_1k: float = setting(
        0.0,
        "TTFT allowance per 1k prompt tokens on top of --slo-ttft-ms, ms (a long prompt is "
        "judged by its length; the planner, the simulator's attainment and `tandem bench "
        "serve`'s goodput use the same rule; 0: one target)",
    )
    slo_tpot_ms: float = setting(100.0, "time-per-output-token target (p50), ms")
    interval_s: float = setting(10.0, "seconds between two planner decisions (one window)")
    min_prefill: int = setting(1, "fewest prefill workers (0: short loads prefill on decode)")
    max_prefill: int = setting(8, "most prefill workers")
    min_decode: int = setting(1, "fewest decode workers")
    max_decode: int = setting(8, "most decode workers")
    gpu_budget: int | None = setting(
        None, "most GPUs both pools may hold together, draining workers included (none: no cap)"
    )
    # A worker of a pool holds this many GPUs (its TP size; `tandem serve` sets them from
    # --prefill-tp/--decode-tp): the budget counts workers x these. None: the profile's.
    prefill_gpus_per_worker: int | None = setting(
        None, "GPUs of one prefill worker (its TP size; none: the profile's gpus_per_worker)"
    )
    decode_gpus_per_worker: int | None = setting(
        None, "GPUs of one decode worker (its TP size; none: the profile's gpus_per_worker)"
    )
    startup_s: float | None = setting(
        None, "seconds from asking for a worker to its first request (none: the profile's)"
    )
    disagg_threshold: int = setting(
        0, "prompts shorter than this are prefilled on decode workers (the router's threshold)"
    )
    up_cooldown_s: float = setting(0.0, "seconds after a pool's last change before it grows")
    down_cooldown_s: float = setting(120.0, "seconds after a pool's last change before it shrinks")
    down_stable_windows: int = setting(
        3, "consecutive windows that must want fewer workers before a pool shrinks"
    )
    headroom: float = setting(0.1, "share of each latency target kept in reserve (0..1)")
    down_margin: float = setting(
        0.15, "a pool shrinks only if the smaller pool would carry this much more load (0..1)"
    )
    down_step: int = setting(1, "most workers one decision takes from a pool (at least)")
    down_fraction: float = setting(
        0.25,
        "share of a pool one decision may take when that is more than down_step (0..1): a "
        "large pool left from a burst comes down in minutes, not one worker per cooldown",
    )
    burst_half_life_s: float = setting(
        900.0,
        "half-life of the burst hold: the pools keep the workers the recent peak 1-s prompt "
        "burst needs (prefill to clear it, decode for its answers in flight at once), that "
        "peak decaying by half every this many seconds "
        "(bursts that recur sooner than a worker starts are met by capacity held; 0: off)",
    )
    down_hold_s: float = setting(
        0.0,
        "a pool shrinks only below the largest size scale-ups asked for in this many seconds "
        "(holds capacity for bursts that recur sooner than a worker starts)",
    )
    up_noise_sigmas: float = setting(
        0.5,
        "standard deviations of the rate's window-to-window noise added to the forecast a "
        "scale-up provisions for (a worker asked for now serves only after its start-up)",
    )
    history_s: float = setting(
        60.0, "seconds of recent windows whose length histograms size the pools"
    )
    tpot_tail_share: float = setting(
        0.05,
        "share of answers (the shortest) the decode pool may leave over the TPOT target: a "
        "short answer's first gap also holds the KV hand-off and a step boundary",
    )
    arrival_scv: float = setting(
        1.0,
        "squared coefficient of variation of inter-arrival times in the queue model (1: Poisson)",
    )
    expected_rate_rps: float | None = setting(
        None, "expected request rate at start-up: size the pools for it before any traffic"
    )
    expected_prompt_tokens: int | None = setting(
        None, "expected prompt length at start-up (and the prior before any request arrived)"
    )
    expected_output_tokens: int | None = setting(
        None,
        "expected output length at start-up (and the prior while finished answers are still "
        "the short ones: until traffic has run as long as long answers take)",
    )
    expected_peak_prompt_tokens_1s: float | None = setting(
        None,
        "expected peak of prompt tokens arriving within 1 s (e.g. the same hour yesterday): "
        "the burst hold starts from it, so the first burst meets held capacity",
    )
    # Tuning kept off the command line.
    forecast_alpha: float = setting(0.3, "Holt level smoothing (0..1]", cli=False)
    forecast_beta: float = setting(0.1, "Holt trend smoothing (0..1]", cli=False)
    forecast_damping: float = setting(0.85, "Holt trend damping per step (0..1]", cli=False)
    correction_alpha: float = setting(0.3, "EWMA weight of a new correction sample", cli=False)
    correction_min_samples: int = setting(20, "latency samples a correction needs", cli=False)
    correction_decay: float = setting(
        0.05, "share of a correction's distance to 1 lost per window without evidence", cli=False
    )
    default_prompt_tokens: int = setting(1024, "prompt length prior", cli=False)
    default_output_tokens: int = setting(256, "output length prior", cli=False)

    def __post_init__(self) -> None:
        for name in ("slo_ttft_ms", "slo_tpot_ms", "interval_s"):
            _positive(name, getattr(self, name))
        for name in (
            "slo_ttft_ms_per_1k",
            "up_cooldown_s",
            "down_cooldown_s",
            "down_hold_s",
            "arrival_scv",
            "up_noise_sigmas",
            "burst_half_life_s",
        ):
            _non_negative(name, getattr(self, name))
        _pool_bounds("prefill", self.min_prefill, self.max_prefill, lowest=0)
        _pool_bounds("decode", self.min_decode, self.max_decode, lowest=1)
        if self.gpu_budget is not None and self.gpu_budget < 1:
            raise ValueError(f"gpu_budget must be >= 1 (or unset), got {self.gpu_budget}")
        for name in ("prefill_gpus_per_worker", "decode_gpus_per_worker"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {getattr(self, name)}")
        if self.startup_s is not None:
            _non_negative("startup_s", self.startup_s)
        if self.disagg_threshold < 0:
            raise ValueError(f"disagg_threshold must be >= 0, got {self.disagg_threshold}")
        for name in ("down_stable_windows", "down_step", "correction_min_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "headroom",
            "down_margin",
            "correction_decay",
            "tpot_tail_share",
            "down_fraction",
        ):
            value = getattr(self, name)
            if not (0 <= value < 1):
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        for name in ("forecast_alpha", "forecast_beta", "forecast_damping", "correction_alpha"):
            value = getattr(self, name)
            if not (0 < value <= 1):
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        _positive("history_s", self.history_s)
        self._check_expected()

    def _check_expected(self) -> None:
        for name in ("expected_rate_rps", "expected_peak_prompt_tokens_1s"):
            if getattr(self, name) is not None:
                _non_negative(name, getattr(self, name))
        for name in (
            "expected_prompt_tokens",
            "expected_output_tokens",
            "default_prompt_tokens",
            "default_output_tokens",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @property
    def slo_ttft_s(self) -> float:
        return self.slo_ttft_ms / 1000.0

    @property
    def slo_tpot_s(self) -> float:
        return self.slo_tpot_ms / 1000.0

    @property
    def prior_prompt_tokens(self) -> int:
        return self.expected_prompt_tokens or self.default_prompt_tokens

    @property
    def prior_output_tokens(self) -> int:
        return self.expected_output_tokens or self.default_output_tokens

    def resolved_startup_s(self, profile_startup_s: float) -> float:
        """The start-up time to plan for: this config's, else the profile's."""
        return profile_startup_s if self.startup_s is None else self.startup_s

    def pool_gpus(self, profile_gpus: int) -> dict[str, int]:
        """GPUs one worker of each pool holds (pool name -> TP size); `profile_gpus` (the
        capacity profile's gpus_per_worker) where this config leaves a pool's unset."""
        return {
            "prefill": self.prefill_gpus_per_worker or profile_gpus,
            "decode": self.decode_gpus_per_worker or profile_gpus,
        }

    def budget_gpus(self, gpus: dict[str, int]) -> int | None:
        """The GPU budget both pools share (workers x their pool's GPUs, `gpus` from
        `pool_gpus`); None without one. Raises if even the pools' minimums do not fit, so a
        bad budget fails at start-up."""
        if self.gpu_budget is None:
            return None
        floor = self.min_prefill * gpus["prefill"] + self.min_decode * gpus["decode"]
        if floor > self.gpu_budget:
            raise ValueError(
                f"gpu_budget={self.gpu_budget} GPUs is less than the pools' minimums need: "
                f"min_prefill {self.min_prefill} x {gpus['prefill']} GPU(s) + min_decode "
                f"{self.min_decode} x {gpus['decode']} GPU(s) = {floor}"
            )
        return self.gpu_budget


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be > 0, got {value}")


def _non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be >= 0, got {value}")


def _pool_bounds(pool: str, low: int, high: int, lowest: int) -> None:
    if low < lowest:
        raise ValueError(f"min_{pool} must be >= {lowest}, got {low}")
    if high < max(low, 1):
        raise ValueError(f"max_{pool} must be >= max(min_{pool}, 1), got {high}")
