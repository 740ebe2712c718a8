"""A `CapacityProfile` (source "roofline") for hardware not at hand: `roofline_profile(model,
hardware, settings)`, and `calibrate(measured, model, hardware)`, which turns a profile measured
on known hardware into the efficiency factors the roofline then applies elsewhere.

The model (one worker of `tp` GPUs; bytes and FLOPs of the whole worker, bandwidth and FLOP/s
summed over its GPUs: the weights and the KV are split over the N GPUs, each reading its share
in parallel; memory and the KV capacity are the N GPUs' together):

    weights W      = layers' projections at the weight dtype (bf16: 2 B, fp8: 1 B) + the LM
                     head (and a MoE's routers) in bf16: what a prefill step reads once (the
                     embedding table's few rows are not counted); a MoE's W holds every expert,
                     since a step of many tokens routes some to each
    prefill_s(T)   = max(FLOPs(T) / (F * e_f), (W + T * kv) / (BW * e_bw)) + overhead
                     FLOPs(T): 2 x projections a token runs x T (MoE: attention, router and
                     top-k experts), the LM head for the last token, causal
                     attention 2 x layers x heads x head_dim x T^2 (one T-token prompt: an idle
                     worker's TTFT, and an upper bound for a batched step of T tokens)
    decode step    = W / (BW * e_bw) + overhead                       (decode_fixed_s)
                     + batch x 2 x (projections + LM head) / (F * e_f) (decode_per_seq_s)
                     + context tokens x kv / (BW * e_kv)               (decode_per_ctx_token_s)
                     (MoE: the projections a token runs; W the fitted line below)
    KV hand-off    = transfer_latency_s + tokens x kv / (link x e_bw)
    KV capacity    = (memory x gpu_memory_utilization - weight memory - activation reserve) / kv
    all-reduce     = with N > 1 GPUs, each step adds 2 all-reduces per layer (after the
                     attention output and the MLP down projection, row-parallel) of T tokens x
                     hidden x 2 B (bf16 activations), as a ring: ALLREDUCE_LATENCY_S each, plus
                     2 (N - 1) / N x bytes over the in-node link (NVLink, else PCIe), one
                     direction. The latency goes into decode_fixed_s, the bytes per token into
                     decode_per_seq_s and every prefill point. Compute and communication do
                     not overlap (the simple, cautious reading).

A mixture-of-experts decode step of B sequences reads, per sparse layer, only the experts some
token chose: with uniform routing x(B) = rest + experts x (1 - (1 - k/E)^B) bytes on average
(`expected_decode_weight_bytes`), concave in B and saturating (E=8, k=2: 90% of the experts at
B=8; E=128, k=8: 64% at B=16). The profile's decode step is linear in B, so the roofline puts
there the line `decode_weight_bytes`: the tangent of x at the 1/x-weighted mean of the batches
1..max_num_seqs, which never under-estimates x at any batch (x is concave) and has the least
mean relative over-estimate over that range; its intercept goes into decode_fixed_s, its slope
(bytes per sequence) into decode_per_seq_s. Its worst error is at B=1: at the default 256
sequences the line is within 0.6% of reading every expert (Mixtral-8x7B: exact to 1% from
B=16, 3.7x the bytes at B=1; Qwen3-30B-A3B: 1.3% from B=64, 51% over at B=16, 9.9x at B=1), so
a lone request's TPOT is cautious; with fewer sequences the fit gains (Qwen3-30B-A3B at 64:
mean over-estimate 28% against 63% for every expert). Prefill reads every expert (16 tokens
touch 99% of Mixtral's experts, 64% of Qwen3-30B-A3B's: cautious for small prefills).
KV bytes and the all-reduces do not change: the engine's MoE block all-reduces once, like the
dense MLP. A profile records its fit and errors in `measurements["roofline"]["moe"]`.

where kv = kv_bytes_per_token (tandem's layout: bf16, or FP8 with per-head scales), e_bw and
e_f the bandwidth and FLOP/s efficiencies, e_kv the attention kernel's bandwidth efficiency over
paged KV (e_bw unless calibrated), `overhead` the per-step launch/scheduling cost.
Defaults are typical of vLLM-class engines on H100-class GPUs: e_bw 0.7 (decode reaches ~70%
of HBM bandwidth), e_f 0.5 (prefill GEMMs at ~50% of dense peak with attention and norms), a
0.5 ms step overhead (CPU scheduling, sampling and launch per step), and vLLM's step limits
(256 sequences, 8192 batched tokens) and `gpu_memory_utilization` 0.9.

startup_s defaults to 40 s + weight bytes / 1 GB/s: the fixed part is what a vLLM-class
worker spends before loading weights on an H100 node (process and CUDA context, imports,
torch.compile and CUDA-graph capture: 30-50 s in vLLM's start logs), the per-byte part weights
read from network storage at ~1 GB/s; for Llama-3-8B on one GPU it gives 56 s, near the 60 s
commonly planned for. It excludes a new node's provisioning; override with --startup-s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bench.capacity_profile import CapacityProfile

from .gpus import GPU
from .model_shapes import ModelShape

# Bytes per projection weight. fp32 only describes a measured float32 engine (calibration).
WEIGHT_DTYPES = {"bf16": 2, "fp8": 1, "fp32": 4}
STARTUP_BASE_S = 40.0
# One in-node all-reduce's fixed cost (NCCL ring, small messages): launch and a hop per rank.
ALLREDUCE_LATENCY_S = 10e-6
ACTIVATION_BYTES = 2  # bf16 activations all-reduced by the row-parallel projections
STARTUP_LOAD_BYTES_PER_S = 1e9
GIB = 1 << 30


@dataclass(slots=True)
class Hardware:
    """One worker's hardware: per-GPU figures (SI units) and the GPUs a worker spans."""

    name: str
    bandwidth_gbs: float
    tflops: float  # dense, for the weight dtype's GEMMs
    memory_gb: float
    link_gbs: float  # the KV hand-off's link, one direction
    gpus: int = 1
    # In-node link the TP all-reduces take, one direction (NVLink, else PCIe); None: link_gbs.
    tp_link_gbs: float | None = None

    def __post_init__(self) -> None:
        for name in ("bandwidth_gbs", "tflops", "memory_gb", "link_gbs"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.gpus < 1:
            raise ValueError(f"gpus (tensor parallel) must be >= 1, got {self.gpus}")
        if self.tp_link_gbs is None:
            self.tp_link_gbs = self.link_gbs
        if not (self.tp_link_gbs > 0 and math.isfinite(self.tp_link_gbs)):
            raise ValueError(f"tp_link_gbs must be > 0, got {self.tp_link_gbs}")

    @classmethod
    def of(cls, gpu: GPU, weight_dtype: str = "bf16", tp: int = 1, link: str = "network"):
        return cls(
            f"{gpu.name} x{tp}" if tp > 1 else gpu.name,
            gpu.bandwidth_gbs,
            gpu.tflops(weight_dtype),
            gpu.memory_gb,
            gpu.link_gbs(link),
            tp,
            gpu.nvlink_gbs or gpu.network_gbs,
        )

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbs * 1e9 * self.gpus

    @property
    def flops(self) -> float:
        return self.tflops * 1e12 * self.gpus


@dataclass(slots=True)
class Efficiency:
    bandwidth: float = 0.7  # of the weights' read (and the KV a prefill writes)
    flops: float = 0.5
    step_overhead_s: float = 0.5e-3
    # Of the KV a decode step reads (the attention kernel over paged KV); None: `bandwidth`.
    kv_bandwidth: float | None = None
    # How the factors were found, for reports (calibration keeps its ratios here).
    source: dict = field(default_factory=lambda: {"kind": "defaults"})

    def __post_init__(self) -> None:
        if self.kv_bandwidth is None:
            self.kv_bandwidth = self.bandwidth
        for name in ("bandwidth", "flops", "kv_bandwidth"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} efficiency must be > 0, got {value}")
        if not (self.step_overhead_s >= 0 and math.isfinite(self.step_overhead_s)):
            raise ValueError(f"step overhead must be >= 0 s, got {self.step_overhead_s}")


@dataclass(slots=True)
class RooflineSettings:
    weight_dtype: str = "bf16"
    kv_dtype: str = "auto"
    efficiency: Efficiency = field(default_factory=Efficiency)
    gpu_memory_utilization: float = 0.9
    activation_reserve_gb: float = 2.0  # per GPU: activations, CUDA graphs, workspaces
    max_num_seqs: int = 256
    max_batch_tokens: int = 8192
    transfer_latency_s: float = 1e-3  # control messages and READ setup of one hand-off
    startup_s: float | None = None
    # Outside the engine (router, sockets, streaming): not a roofline matter; a measured
    # profile's can be carried over (`tandem plan --calibrate`).
    request_overhead_s: float = 0.0
    token_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight dtype must be one of {tuple(WEIGHT_DTYPES)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        for name in (
            "activation_reserve_gb",
            "transfer_latency_s",
            "request_overhead_s",
            "token_overhead_s",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_num_seqs", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.startup_s is not None and not self.startup_s >= 0:
            raise ValueError(f"startup_s must be >= 0, got {self.startup_s}")


# -- the bytes -------------------------------------------------------------------------------
def step_weight_bytes(model: ModelShape, weight_dtype: str) -> float:
    """What one step reads of the weights when it touches all of them (a prefill step; every
    expert of a MoE model): the projections at the weight dtype, the LM head and a MoE's
    routers in bf16 (quantized engines keep the head in full precision, and the engine never
    rounds the routers, whose rounded logits would move tokens between experts) or fp32."""
    per_weight = WEIGHT_DTYPES[weight_dtype]
    full = max(2, per_weight)
    routers = model.router_stack_params
    return (model.stack_params - routers) * per_weight + routers * full + model.table_params * full


def expert_weight_bytes(model: ModelShape, weight_dtype: str) -> float:
    """Every expert of every sparse layer at the weight dtype (0 for a dense model)."""
    return model.expert_stack_params * WEIGHT_DTYPES[weight_dtype]


def expected_decode_weight_bytes(model: ModelShape, weight_dtype: str, batch: float) -> float:
    """The weight bytes a decode step of `batch` sequences reads when each token's top-k
    experts are uniformly random: all but the experts, and per sparse layer the experts some
    token chose, E x (1 - (1 - k/E)^B) of the E on average."""
    experts = expert_weight_bytes(model, weight_dtype)
    rest = step_weight_bytes(model, weight_dtype) - experts
    if not model.is_moe:
        return rest
    missed = (1 - model.experts_per_token / model.num_experts) ** batch
    return rest + experts * (1 - missed)


def decode_weight_bytes(
    model: ModelShape, weight_dtype: str, max_batch: int
) -> tuple[float, float, float | None]:
    """(bytes read once per decode step, bytes each sequence adds, the batch where the line
    touches the expected bytes; None when they do not depend on the batch): the straight line
    that never under-estimates `expected_decode_weight_bytes` and over-estimates it least on
    average, relative to it, over batches 1..max_batch. The expected bytes are concave in B, so
    every tangent lies above them at every batch; the tangent at t has the mean relative
    over-estimate sum_B (L_t(B) - x(B)) / x(B) / n, whose derivative in t is x''(t) x
    sum_B (B - t) / x(B) / n: it is least at t = sum_B B / x(B) / sum_B 1 / x(B), the batch
    mean weighted by 1 / x(B). A dense model (or k = E) reads the same bytes at every batch."""
    if not model.is_moe or model.experts_per_token == model.num_experts:
        return step_weight_bytes(model, weight_dtype), 0.0, None
    experts = expert_weight_bytes(model, weight_dtype)
    rest = step_weight_bytes(model, weight_dtype) - experts
    weights = [
        1 / expected_decode_weight_bytes(model, weight_dtype, b) for b in range(1, max_batch + 1)
    ]
    t = sum(b * w for b, w in enumerate(weights, 1)) / sum(weights)
    q = 1 - model.experts_per_token / model.num_experts
    # x(B) = rest + experts (1 - q^B): x(t) and its slope -experts q^t ln q at t.
    slope = -experts * q**t * math.log(q)
    fixed = rest + experts * (1 - q**t) - t * slope
    return fixed, slope, t


def weight_memory_bytes(model: ModelShape, weight_dtype: str) -> float:
    """The weights' memory: the step's weights plus an untied embedding table (bf16)."""
    untied = (
        0 if model.tie_word_embeddings else model.table_params * max(2, WEIGHT_DTYPES[weight_dtype])
    )
    return step_weight_bytes(model, weight_dtype) + untied


def default_startup_s(model: ModelShape, weight_dtype: str, gpus: int) -> float:
    """STARTUP_BASE_S plus each GPU's share of the weights read at STARTUP_LOAD_BYTES_PER_S."""
    return STARTUP_BASE_S + weight_memory_bytes(model, weight_dtype) / gpus / (
        STARTUP_LOAD_BYTES_PER_S
    )


# -- the profile -----------------------------------------------------------------------------
def allreduce_s(model: ModelShape, hw: Hardware) -> tuple[float, float]:
    """A TP worker's all-reduces in one step: (fixed seconds, seconds per token); (0, 0) on
    one GPU. See the module doc."""
    n = hw.gpus
    if n == 1:
        return 0.0, 0.0
    count = 2 * model.num_layers
    per_token = 2 * (n - 1) / n * model.hidden_size * ACTIVATION_BYTES / (hw.tp_link_gbs * 1e9)
    return count * ALLREDUCE_LATENCY_S, count * per_token


def prefill_step_s(
    model: ModelShape, hw: Hardware, s: RooflineSettings, tokens: int, kv: int
) -> float:
    e = s.efficiency
    compute = model.prefill_flops(tokens) / (hw.flops * e.flops)
    memory = (step_weight_bytes(model, s.weight_dtype) + tokens * kv) / (
        hw.bytes_per_s * e.bandwidth
    )
    fixed, per_token = allreduce_s(model, hw)
    return max(compute, memory) + fixed + per_token * tokens + e.step_overhead_s


def prefill_token_counts(max_batch_tokens: int) -> list[int]:
    """16, 32, 64, ... up to the step budget, and the budget itself."""
    out, n = [], 16
    while n < max_batch_tokens:
        out.append(n)
        n *= 2
    return [*out, max_batch_tokens]


def kv_capacity_tokens(model: ModelShape, hw: Hardware, s: RooflineSettings, kv: int) -> int:
    usable = hw.memory_gb * 1e9 * hw.gpus * s.gpu_memory_utilization
    free = (
        usable
        - weight_memory_bytes(model, s.weight_dtype)
        - s.activation_reserve_gb * GIB * hw.gpus
    )
    if free < kv * 16:
        weights_gb = weight_memory_bytes(model, s.weight_dtype) / 1e9
        raise ValueError(
            f"{model.name} does not fit {hw.name}: {weights_gb:.1f} GB of weights in "
            f"{usable / 1e9:.1f} GB usable; add GPUs (--tp) or use --weight-dtype fp8"
        )
    return int(free // kv)


def roofline_profile(model: ModelShape, hw: Hardware, s: RooflineSettings) -> CapacityProfile:
    """The profile the roofline predicts for one worker of `model` on `hw`."""
    e = s.efficiency
    kv = model.kv_bytes_per_token(s.kv_dtype)
    bw = hw.bytes_per_s * e.bandwidth
    points = [
        (t, prefill_step_s(model, hw, s, t, kv)) for t in prefill_token_counts(s.max_batch_tokens)
    ]
    ar = allreduce_s(model, hw)  # (fixed, per token) of a TP worker's all-reduces
    # A MoE step reads more experts as the batch grows: a line fitted to the expected bytes.
    fixed_bytes, seq_bytes, _ = decode_weight_bytes(model, s.weight_dtype, s.max_num_seqs)
    startup = s.startup_s
    if startup is None:
        startup = default_startup_s(model, s.weight_dtype, hw.gpus)
    return CapacityProfile(
        model=model.name,
        hardware=hw.name,
        source="roofline",
        prefill_points=points,
        decode_fixed_s=fixed_bytes / bw + e.step_overhead_s + ar[0],
        decode_per_seq_s=model.decode_flops_per_seq() / (hw.flops * e.flops)
        + ar[1]
        + seq_bytes / bw,
        decode_per_ctx_token_s=kv / (hw.bytes_per_s * e.kv_bandwidth),
        kv_bytes_per_token=kv,
        transfer_latency_s=s.transfer_latency_s,
        transfer_bytes_per_s=hw.link_gbs * 1e9 * hw.gpus * e.bandwidth,
        kv_capacity_tokens=kv_capacity_tokens(model, hw, s, kv),
        max_batch_tokens=s.max_batch_tokens,
        max_num_seqs=s.max_num_seqs,
        startup_s=startup,
        gpus_per_worker=hw.gpus,
        request_overhead_s=s.request_overhead_s,
        token_overhead_s=s.token_overhead_s,
        prefill_attention_s=model.attention_flops_per_token2() / (hw.flops * e.flops),
        measurements={"roofline": _inputs(model, hw, s, kv)},
    )


def _inputs(model: ModelShape, hw: Hardware, s: RooflineSettings, kv: int) -> dict:
    out = {
        # JSON's shapes (a tuple reads back as a list), so a saved profile loads back equal.
        "model": {k: _json_value(getattr(model, k)) for k in model.__slots__},
        "params": model.num_params,
        "hardware": {k: getattr(hw, k) for k in hw.__slots__},
        "weight_dtype": s.weight_dtype,
        "kv_dtype": s.kv_dtype,
        "step_weight_bytes": step_weight_bytes(model, s.weight_dtype),
        "weight_memory_bytes": weight_memory_bytes(model, s.weight_dtype),
        "kv_bytes_per_token": kv,
        "efficiency": {
            "bandwidth": s.efficiency.bandwidth,
            "flops": s.efficiency.flops,
            "kv_bandwidth": s.efficiency.kv_bandwidth,
            "step_overhead_s": s.efficiency.step_overhead_s,
            "source": s.efficiency.source,
        },
        "gpu_memory_utilization": s.gpu_memory_utilization,
        "activation_reserve_gb": s.activation_reserve_gb,
    }
    if model.is_moe:
        out["moe"] = _moe_inputs(model, s)
    return out


def _json_value(value):
    return list(value) if isinstance(value, tuple) else value


def _moe_inputs(model: ModelShape, s: RooflineSettings) -> dict:
    """How the decode line stands against the expected expert bytes (module doc)."""
    fixed, per_seq, tangent = decode_weight_bytes(model, s.weight_dtype, s.max_num_seqs)
    batches = range(1, s.max_num_seqs + 1)
    over = [
        (fixed + per_seq * b) / expected_decode_weight_bytes(model, s.weight_dtype, b) - 1
        for b in batches
    ]
    return {
        "active_params": model.active_params,
        "decode_weights": (
            "a line tangent to the expected bytes under uniform routing, rest + experts x "
            "(1 - (1 - k/E)^B), at the 1/bytes-weighted mean batch of 1..max_num_seqs: never "
            "under, least mean relative over-estimate"
        ),
        "decode_fixed_weight_bytes": fixed,
        "decode_per_seq_weight_bytes": per_seq,
        "tangent_batch": tangent,
        "over_estimate_at_batch_1": over[0],
        "over_estimate_at_max_num_seqs": over[-1],
        "over_estimate_mean": sum(over) / len(over),
    }


# -- calibration -----------------------------------------------------------------------------
def calibrate(
    measured: CapacityProfile,
    model: ModelShape,
    hw: Hardware,
    weight_dtype: str = "bf16",
    step_overhead_s: float = 0.0,
) -> Efficiency:
    """The efficiency factors that make the roofline reproduce `measured` on `hw` (the
    hardware it was measured on, with its peak bandwidth and FLOP/s), for a per-step overhead
    `step_overhead_s` (one equation cannot split decode_fixed_s into a bandwidth and an
    overhead: 0 puts all of it on the bandwidth, the cautious reading):

    - bandwidth: the weights' read, W / (BW x (decode_fixed_s - overhead)) (MoE: W the
      decode line's intercept over the measured max_num_seqs);
    - KV bandwidth: the KV read per context token, kv / (BW x decode_per_ctx_token_s);
    - FLOP/s: the largest prefill point, FLOPs / (F x (seconds - overhead)), when it is
      compute-bound at that bandwidth; else the per-sequence decode cost,
      2 x params / (F x decode_per_seq_s) (MoE: the active params, less the line's bytes
      per sequence read at the bandwidth found)."""
    kv = measured.kv_bytes_per_token
    w = step_weight_bytes(model, weight_dtype)
    # What the roofline puts in a decode step (MoE: the fitted line over the measured batches).
    w_fixed, w_seq, _ = decode_weight_bytes(model, weight_dtype, measured.max_num_seqs)
    ar_fixed, ar_token = allreduce_s(model, hw)  # a TP worker's modelled all-reduces
    weights_s = measured.decode_fixed_s - step_overhead_s - ar_fixed
    if weights_s <= 0:
        raise ValueError(
            f"a step overhead of {step_overhead_s * 1e3:.3f} ms leaves nothing of the measured "
            f"decode_fixed_s ({measured.decode_fixed_s * 1e3:.3f} ms) for the weights' read"
        )
    e_bw = w_fixed / (hw.bytes_per_s * weights_s)
    per_ctx = measured.decode_per_ctx_token_s
    e_kv = kv / (hw.bytes_per_s * per_ctx) if per_ctx > 0 else e_bw
    details: dict = {"kind": "calibrated", "hardware": hw.name, "profile": measured.model}
    tokens, seconds = measured.prefill_points[-1]
    memory_s = (w + tokens * kv) / (hw.bytes_per_s * e_bw)
    compute_s = seconds - step_overhead_s - ar_fixed - ar_token * tokens
    if compute_s > memory_s * 1.0001:
        e_f = model.prefill_flops(tokens) / (hw.flops * compute_s)
        details["flops_from"] = f"prefill at {tokens} tokens"
    elif (seq_s := measured.decode_per_seq_s - ar_token - w_seq / (hw.bytes_per_s * e_bw)) > 0:
        e_f = model.decode_flops_per_seq() / (hw.flops * seq_s)
        details["flops_from"] = "decode_per_seq_s"
    else:
        raise ValueError(
            "the measured profile identifies no FLOP/s efficiency: its largest prefill step is "
            "bandwidth-bound and its decode has no per-sequence cost"
        )
    return Efficiency(e_bw, e_f, step_overhead_s, e_kv, details)
