"""`tandem plan`: size the pools for hardware not at hand, from a roofline model.

Lifecycle of a run: the model shape (a preset such as `llama-3-8b`, or a config.json) and the
hardware (a GPU of cluster/planner/gpus.py, or `--bandwidth-gbs/--tflops/--memory-gb`, times
`--tp`) -> the efficiency factors (defaults, flags, or `--calibrate PROFILE.json`: a profile
measured on known hardware, given that hardware's peak `--calibrate-bandwidth-gbs` and
`--calibrate-tflops`) -> the roofline `CapacityProfile` (cluster/planner/roofline.py) ->
printed: the profile's key numbers; for each `--prompt/--output` pair the TTFT, TPOT and total
time of a lone request on idle workers; and with `--rate` (the mix of the pairs, or `--trace`'s
length histograms and, without --rate, its mean rate) the prefill and decode workers the
planner (cluster/planner/policy.py, the same code `tandem serve --autoscale` and `tandem
simulate` run) asks for at that steady load. `--out` writes the profile for `tandem simulate`.

Flags come from `PlanConfig` and the planner's `PlannerConfig` (SLOs, disaggregation
threshold, start-up time, bounds; the pools' maximums default to 1000 here, so a sizing is not
cut at the live defaults).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.capacity_model import IdleRequest, idle_request
from bench.capacity_profile import CapacityProfile
from cluster.planner.config import PlannerConfig
from cluster.planner.gpus import GPUS, gpu
from cluster.planner.model_shapes import PRESETS, ModelShape, model_shape, shape_from_config
from cluster.planner.roofline import (
    Efficiency,
    Hardware,
    RooflineSettings,
    calibrate,
    roofline_profile,
    step_weight_bytes,
)
from engine.config_flags import add_flags, parse_int_list, setting, values_from_args
from router.signals import LengthHistogram, WindowSignals

PLANNER_EXCLUDE = (
    "expected_rate_rps",
    "expected_prompt_tokens",
    "expected_output_tokens",
    "expected_peak_prompt_tokens_1s",
)
PLAN_MAX_WORKERS = 1000
MIN_WINDOW_ARRIVALS = 2000  # a synthetic window holds this many requests (length resolution)


@dataclass(slots=True)
class PlanConfig:
    """One `tandem plan` run; each field is also its flag."""

    model: str | None = setting(
        None, f"a preset ({', '.join(PRESETS)}) or a config.json path / model directory"
    )
    model_config: str | None = setting(None, "a Hugging Face config.json (or its directory)")
    gpu: str | None = setting(None, f"a GPU of the table ({', '.join(GPUS)})")
    bandwidth_gbs: float | None = setting(None, "memory bandwidth per GPU, GB/s (overrides --gpu)")
    tflops: float | None = setting(None, "dense tensor TFLOP/s per GPU (overrides --gpu)")
    memory_gb: float | None = setting(None, "memory per GPU, GB (overrides --gpu)")
    link_gbs: float | None = setting(
        None, "KV hand-off link per GPU, GB/s (overrides --gpu; custom hardware: 50)"
    )
    tp: int = setting(1, "GPUs per worker (tensor parallel)")
    weight_dtype: str = setting("bf16", "projection weights", choices=("bf16", "fp8"))
    kv_dtype: str = setting("auto", "KV cache dtype (auto: bf16)", choices=("auto", "fp8_e4m3"))
    kv_link: str = setting("network", "the KV hand-off's link", choices=("network", "nvlink"))
    bw_efficiency: float | None = setting(None, "share of peak bandwidth reached (unset: 0.7)")
    flops_efficiency: float | None = setting(None, "share of peak FLOP/s reached (unset: 0.5)")
    step_overhead_ms: float | None = setting(
        None, "per-step launch overhead, ms (unset: 0.5; with --calibrate: 0)"
    )
    calibrate: str | None = setting(None, "efficiencies from this measured profile JSON")
    calibrate_bandwidth_gbs: float | None = setting(
        None, "peak memory bandwidth of the --calibrate profile's hardware, GB/s"
    )
    calibrate_tflops: float | None = setting(
        None, "peak TFLOP/s of the --calibrate profile's hardware (its dtype)"
    )
    calibrate_model_config: str | None = setting(
        None, "config.json of the --calibrate profile's model (unset: the path it records)"
    )
    gpu_memory_utilization: float = setting(0.9, "share of GPU memory the engine takes")
    activation_reserve_gb: float = setting(2.0, "GiB per GPU kept for activations and graphs")
    max_num_seqs: int = setting(256, "sequences per step")
    max_batch_tokens: int = setting(8192, "token budget of one step")
    transfer_latency_ms: float = setting(1.0, "fixed cost of one KV hand-off, ms")
    request_overhead_ms: float | None = setting(
        None, "a request's cost outside the engine, ms (unset: --calibrate's profile's, else 0)"
    )
    token_overhead_ms: float | None = setting(
        None,
        "each later token's cost outside the engine, ms (unset: --calibrate's profile's, else 0)",
    )
    prompt: tuple[int, ...] | None = setting(
        None, "prompt lengths, comma-separated", parse=parse_int_list
    )
    output: tuple[int, ...] | None = setting(
        None, "output lengths, comma-separated (unset: 1)", parse=parse_int_list
    )
    rate: float | None = setting(None, "requests/s to size the pools for")
    trace: str | None = setting(None, "take the length mix (and rate) from this trace")
    out: str | None = setting(None, "write the profile JSON here")
    list_known: bool = setting(False, "list the GPUs and model presets, then exit")

    def __post_init__(self) -> None:
        if self.list_known:
            return
        if (self.model is None) == (self.model_config is None):
            raise ValueError("give one of --model (a preset or path) and --model-config")
        custom = (self.bandwidth_gbs, self.tflops, self.memory_gb)
        if self.gpu is None and None in custom:
            raise ValueError("give --gpu, or all of --bandwidth-gbs, --tflops and --memory-gb")
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        explicit = (self.bw_efficiency, self.flops_efficiency)
        if self.calibrate and any(v is not None for v in explicit):
            raise ValueError("--calibrate sets the efficiencies: drop --bw/--flops-efficiency")
        if self.calibrate and None in (self.calibrate_bandwidth_gbs, self.calibrate_tflops):
            raise ValueError("--calibrate needs --calibrate-bandwidth-gbs and --calibrate-tflops")
        prompts, outputs = self.prompt or (), self.output or ()
        if outputs and not prompts:
            raise ValueError("--output needs --prompt")
        if any(n < 1 for n in (*prompts, *outputs)):
            raise ValueError("--prompt and --output lengths must be >= 1")
        if (
            prompts
            and outputs
            and len(prompts) != len(outputs)
            and 1 not in (len(prompts), len(outputs))
        ):
            raise ValueError("--prompt and --output must have as many lengths (or one of them one)")
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"--rate must be > 0, got {self.rate}")
        if self.rate is not None and not (prompts or self.trace):
            raise ValueError("--rate needs a length mix: --prompt/--output or --trace")

    def pairs(self) -> list[tuple[int, int]]:
        """(prompt, output) pairs; a single length is paired with every other one."""
        prompts, outputs = list(self.prompt or ()), list(self.output or ())
        if not prompts:
            return []
        outputs = outputs or [1]
        n = max(len(prompts), len(outputs))
        prompts = prompts * n if len(prompts) == 1 else prompts
        outputs = outputs * n if len(outputs) == 1 else outputs
        return list(zip(prompts, outputs, strict=True))


# -- building the profile --------------------------------------------------------------------
def build_model(cfg: PlanConfig) -> ModelShape:
    if cfg.model_config is not None:
        return shape_from_config(cfg.model_config)
    return model_shape(cfg.model)


def build_hardware(cfg: PlanConfig) -> Hardware:
    base = Hardware.of(gpu(cfg.gpu), cfg.weight_dtype, cfg.tp, cfg.kv_link) if cfg.gpu else None
    name = base.name if base else f"custom x{cfg.tp}" if cfg.tp > 1 else "custom"
    return Hardware(
        name,
        cfg.bandwidth_gbs or base.bandwidth_gbs,
        cfg.tflops or base.tflops,
        cfg.memory_gb or base.memory_gb,
        cfg.link_gbs or (base.link_gbs if base else 50.0),
        cfg.tp,
        # The TP all-reduces' in-node link: the GPU's NVLink (else PCIe); custom: the KV link.
        base.tp_link_gbs if base else None,
    )


def build_efficiency(cfg: PlanConfig) -> Efficiency:
    if cfg.calibrate:
        measured = CapacityProfile.load(cfg.calibrate)
        model_path = cfg.calibrate_model_config or measured.measurements.get("config", {}).get(
            "model"
        )
        if not model_path or not Path(model_path).exists():
            raise ValueError("--calibrate: give --calibrate-model-config (the profile's model)")
        dtype = measured.measurements.get("config", {}).get("dtype", "bfloat16")
        hw = Hardware(
            f"calibration ({measured.hardware})",
            cfg.calibrate_bandwidth_gbs,
            cfg.calibrate_tflops,
            1.0,  # memory and link play no part in the efficiencies
            1.0,
        )
        weight_dtype = "fp32" if dtype == "float32" else "bf16"
        overhead_s = (cfg.step_overhead_ms or 0.0) / 1e3
        return calibrate(measured, shape_from_config(model_path), hw, weight_dtype, overhead_s)
    d = Efficiency()
    return Efficiency(
        cfg.bw_efficiency if cfg.bw_efficiency is not None else d.bandwidth,
        cfg.flops_efficiency if cfg.flops_efficiency is not None else d.flops,
        cfg.step_overhead_ms / 1e3 if cfg.step_overhead_ms is not None else d.step_overhead_s,
        source={"kind": "flags" if cfg.bw_efficiency or cfg.flops_efficiency else "defaults"},
    )


def _overheads(cfg: PlanConfig) -> tuple[float, float]:
    """(request, token) overhead seconds: the flags, else the calibration profile's, else 0."""
    measured = CapacityProfile.load(cfg.calibrate) if cfg.calibrate else None
    out = []
    for flag, name in ((cfg.request_overhead_ms, "request"), (cfg.token_overhead_ms, "token")):
        if flag is not None:
            out.append(flag / 1e3)
        else:
            out.append(getattr(measured, f"{name}_overhead_s") if measured else 0.0)
    return out[0], out[1]


def build_profile(cfg: PlanConfig, planner: PlannerConfig) -> CapacityProfile:
    request_s, token_s = _overheads(cfg)
    settings = RooflineSettings(
        weight_dtype=cfg.weight_dtype,
        kv_dtype=cfg.kv_dtype,
        efficiency=build_efficiency(cfg),
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        activation_reserve_gb=cfg.activation_reserve_gb,
        max_num_seqs=cfg.max_num_seqs,
        max_batch_tokens=cfg.max_batch_tokens,
        transfer_latency_s=cfg.transfer_latency_ms / 1e3,
        startup_s=planner.startup_s,
        request_overhead_s=request_s,
        token_overhead_s=token_s,
    )
    return roofline_profile(build_model(cfg), build_hardware(cfg), settings)


# -- a load to size for ----------------------------------------------------------------------
def mix_histograms(cfg: PlanConfig) -> tuple[LengthHistogram, LengthHistogram, float | None]:
    """(prompt lengths, output lengths, the trace's mean rate or None): the trace's requests,
    else the --prompt/--output pairs in equal shares."""
    prompts, outputs = LengthHistogram(), LengthHistogram()
    if cfg.trace:
        from cluster.simulator.traces import DrawnArrivals, detect_format, load_requests

        # A ShareGPT file has lengths and no arrivals: its mix, and no rate of its own.
        fmt = detect_format(cfg.trace)
        timed = fmt != "sharegpt"
        requests = load_requests(cfg.trace, fmt, drawn=None if timed else DrawnArrivals(1.0))
        for r in requests:
            prompts.add(r.prompt_len)
            outputs.add(r.output_len)
        span = requests[-1].arrival_s - requests[0].arrival_s
        rate = (len(requests) - 1) / span if span > 0 and timed else None
        return prompts, outputs, rate
    for p, o in cfg.pairs():
        prompts.add(p)
        outputs.add(o)
    return prompts, outputs, None


def _scaled(hist: LengthHistogram, total: int) -> LengthHistogram:
    """`hist` with its counts scaled to `total` requests, each bucket keeping its mean."""
    out = LengthHistogram()
    n = hist.count
    for i, (c, s) in enumerate(zip(hist.counts, hist.sums, strict=True)):
        if c:
            k = max(1, round(c * total / n))
            out.counts[i], out.sums[i] = k, round(s / c * k)
    return out


def synthetic_window(
    rate: float, duration: float, prompts: LengthHistogram, outputs: LengthHistogram, threshold: int
) -> WindowSignals:
    """A planner window of a steady load: `rate` requests/s with these length mixes, every
    prompt token uncached, nothing queued, no latency observed (so no correction)."""
    arrivals = max(1, round(rate * duration))
    p = _scaled(prompts, arrivals)
    local = sum(c for c, s in zip(p.counts, p.sums, strict=True) if c and s / c < threshold)
    return WindowSignals(
        start_s=0.0,
        duration_s=arrivals / rate,  # the exact rate, after rounding the arrivals
        arrivals=p.count,
        prompt_lengths=p,
        output_lengths=_scaled(outputs, p.count),
        uncached_prompt_tokens=p.total,
        local_prefills=local,
        finished=p.count,
    )


def size_for_rate(
    profile: CapacityProfile,
    config: PlannerConfig,
    rate: float,
    prompts: LengthHistogram,
    outputs: LengthHistogram,
    rounds: int = 12,
) -> Any:
    """The planner's decision once a steady load at `rate` has been seen for a few windows
    (its workers ready as it asked). Windows hold MIN_WINDOW_ARRIVALS requests, so the
    interval is stretched at low rates (a steady load: only the rate and mix matter)."""
    from cluster.planner.policy import Planner
    from cluster.planner.types import PoolCounts

    duration = max(config.interval_s, MIN_WINDOW_ARRIVALS / rate)
    window = synthetic_window(rate, duration, prompts, outputs, config.disagg_threshold)
    duration = window.duration_s
    config = replace(config, interval_s=duration, history_s=max(config.history_s, 3 * duration))
    planner = Planner(profile, config)
    ready = planner.initial()
    decision = None
    for i in range(rounds):
        now = (i + 1) * duration
        seen = replace(window, start_s=i * duration)
        decision = planner.decide(now, seen, PoolCounts(ready=dict(ready)))
        if i > 0 and all(decision.desired.get(p, n) == n for p, n in ready.items()):
            break
        ready = {**ready, **decision.desired}
    return decision


# -- output ----------------------------------------------------------------------------------
def describe_profile(profile: CapacityProfile) -> list[str]:
    r = profile.measurements.get("roofline", {})
    eff = r.get("efficiency", {})
    head = f"{profile.model} on {profile.hardware} ({profile.source}"
    if eff:
        head += (
            f": bandwidth x{eff['bandwidth']:.2f} (KV reads x{eff['kv_bandwidth']:.2f}), "
            f"FLOP/s x{eff['flops']:.2f}, "
            f"step overhead {eff['step_overhead_s'] * 1e3:.2f} ms, {eff['source']['kind']}"
        )
    lines = [head + ")"]
    if r:
        lines.append(
            f"  weights {r['weight_memory_bytes'] / 1e9:.1f} GB ({r['weight_dtype']}), "
            f"KV {profile.kv_bytes_per_token} B/token, {profile.kv_capacity_tokens:,} tokens "
            f"of KV per worker, {profile.gpus_per_worker} GPU(s) per worker"
        )
    lines += [
        f"  prefill: {profile.prefill_tokens_per_s():,.0f} tok/s in {profile.max_batch_tokens}-"
        f"token steps; decode step {profile.decode_fixed_s * 1e3:.2f} ms + "
        f"{profile.decode_per_seq_s * 1e3:.4f} ms/seq + "
        f"{profile.decode_per_ctx_token_s * 1e6:.4f} us/context token",
        f"  KV hand-off {profile.transfer_latency_s * 1e3:.2f} ms + "
        f"{profile.transfer_bytes_per_s / 1e9:.1f} GB/s; start-up {profile.startup_s:.0f} s; "
        f"outside the engine {profile.request_overhead_s * 1e3:.2f} ms per request, "
        f"{profile.token_overhead_s * 1e3:.3f} ms per token",
    ]
    return lines


def describe_requests(rows: list[IdleRequest]) -> list[str]:
    lines = [
        f"  {'prompt':>7} {'output':>7} {'path':<7} {'TTFT ms':>9} {'TPOT ms':>9} {'total s':>9}"
    ]
    for r in rows:
        tpot = f"{r.tpot_s * 1e3:9.2f}" if r.tpot_s is not None else f"{'-':>9}"
        path = "disagg" if r.disaggregated else "local"
        lines.append(
            f"  {r.prompt:>7} {r.output:>7} {path:<7} {r.ttft_s * 1e3:9.1f} {tpot} {r.total_s:9.2f}"
        )
    return lines


def describe_sizing(decision: Any, rate: float, gpus_per_worker: int) -> list[str]:
    desired = decision.desired
    workers = sum(desired.values())
    lines = [
        f"at {rate:g} req/s: "
        + ", ".join(f"{pool} {n}" for pool, n in desired.items())
        + f" ({workers * gpus_per_worker} GPUs)"
    ]
    lines += [f"  {pool}: {decision.reasons[pool]}" for pool in desired if pool in decision.reasons]
    pred = decision.predicted
    if "ttft_p90_s" in pred or "tpot_p50_s" in pred:
        lines.append(
            f"  predicted TTFT p90 {pred.get('ttft_p90_s', math.nan) * 1e3:.0f} ms, "
            f"TPOT p50 {pred.get('tpot_p50_s', math.nan) * 1e3:.1f} ms"
        )
    return lines


# -- CLI -------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, PlanConfig)
    add_flags(p, PlannerConfig, title="planner", exclude=PLANNER_EXCLUDE)
    p.set_defaults(max_prefill=PLAN_MAX_WORKERS, max_decode=PLAN_MAX_WORKERS)


def list_known() -> str:
    gpus = [
        f"  {g.name:<10} {g.bandwidth_gbs:>6.0f} GB/s {g.bf16_tflops:>7.1f} TFLOP/s bf16 "
        f"{g.fp8_tflops or 0:>7.1f} fp8 {g.memory_gb:>5.0f} GB"
        for g in GPUS.values()
    ]
    models = [
        f"  {m.name:<13} {m.num_params / 1e9:5.2f} B params, {m.num_layers} layers, "
        f"{m.num_heads}/{m.num_kv_heads} heads, weights {step_weight_bytes(m, 'bf16') / 1e9:.1f} GB"
        # A MoE model's compute per token is its active params' (its top-k experts).
        + (
            f", {m.num_experts} experts (top {m.experts_per_token}), "
            f"{m.active_params / 1e9:.2f} B active"
            if m.is_moe
            else ""
        )
        for m in PRESETS.values()
    ]
    return "\n".join(["GPUs:", *gpus, "models:", *models])


def run(args: argparse.Namespace) -> int:
    try:
        cfg = PlanConfig(**values_from_args(PlanConfig, args))
        if cfg.list_known:
            print(list_known())
            return 0
        planner = PlannerConfig(**values_from_args(PlannerConfig, args, exclude=PLANNER_EXCLUDE))
        profile = build_profile(cfg, planner)
        lines = describe_profile(profile)
        if cfg.prompt:
            rows = [
                idle_request(profile, p, o, p >= planner.disagg_threshold) for p, o in cfg.pairs()
            ]
            lines += ["a lone request on idle workers:", *describe_requests(rows)]
        if cfg.rate or cfg.trace:
            prompts, outputs, trace_rate = mix_histograms(cfg)
            rate = cfg.rate or trace_rate
            if rate is None:
                raise ValueError("the trace has no time span: give --rate")
            decision = size_for_rate(profile, planner, rate, prompts, outputs)
            lines += describe_sizing(decision, rate, profile.gpus_per_worker)
    except ValueError as e:
        print(f"tandem plan: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    if cfg.out:
        print(f"wrote {profile.save(cfg.out)}")
    return 0
