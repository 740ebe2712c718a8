"""A `CapacityProfile` (source "roofline") for hardware not at hand: `roofline_profile(model,
hardware, settings)`, and `calibrate(measured, model, hardware)`, which turns a profile measured
on known hardware into the efficiency factors the roofline then applies elsewhere.

The model (one worker of `tp` GPUs; bytes and FLOPs of the whole worker, bandwidth and FLOP/s
summed over its GPUs: the weights and the KV are split over the N GPUs, each reading its share
in parallel; memory and the KV capacity are the N GPUs' together):

    weights W      = layers' projections at the weight dtype (bf16: 2 B, fp8: 1 B) + the LM
                     head in bf16: what every step reads once (the embedding table's few rows
                     are not counted)
    prefill_s(T)   = max(FLOPs(T) / (F * e_f), (W + T * kv) / (BW * e_bw)) + overhead
                     FLOPs(T): 2 x projections x T, the LM head for the last token, causal
                     attention 2 x layers x heads x head_dim x T^2 (one T-token prompt: an idle
                     worker's TTFT, and an upper bound for a batched step of T tokens)
    decode step    = W / (BW * e_bw) + overhead                       (decode_fixed_s)
                     + batch x 2 x (projections + LM head) / (F * e_f) (decode_per_seq_s)
                     + context tokens x kv / (BW * e_kv)               (decode_per_ctx_token_s)
    KV hand-off    = transfer_latency_s + tokens x kv / (link x e_bw)
    KV capacity    = (memory x gpu_memory_utilization - weight memory - activation reserve) / kv
    all-reduce     = with N > 1 GPUs, each step adds 2 all-reduces per layer (after the
                     attention output and the MLP down projection, row-parallel) of T tokens x
                     hidden x 2 B (bf16 activations), as a ring: ALLREDUCE_LATENCY_S each, plus
                     2 (N - 1) / N x bytes over the in-node link (NVLink, else PCIe), one
                     direction. The latency goes into decode_fixed_s, the bytes per token into
                     decode_per_seq_s and every prefill point. Compute and communication do
                     not overlap (the simple, cautious reading).

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
    """What one step reads of the weights: the projections at the weight dtype, the LM head in
    bf16 (quantized engines keep it in full precision) or fp32."""
    per_weight = WEIGHT_DTYPES[weight_dtype]
    return model.num_layers * model.layer_params * per_weight + model.table_params * max(
        2, per_weight
    )


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
    startup = s.startup_s
    if startup is None:
        startup = default_startup_s(model, s.weight_dtype, hw.gpus)
    return CapacityProfile(
        model=model.name,
        hardware=hw.name,
        source="roofline",
        prefill_points=points,
        decode_fixed_s=step_weight_bytes(model, s.weight_dtype) / bw + e.step_overhead_s + ar[0],
        decode_per_seq_s=model.decode_flops_per_seq() / (hw.flops * e.flops) + ar[1],
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
    return {
        "model": {k: getattr(model, k) for k in model.__slots__},
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

    - bandwidth: the weights' read, W / (BW x (decode_fixed_s - overhead));
    - KV bandwidth: the KV read per context token, kv / (BW x decode_per_ctx_token_s);
    - FLOP/s: the largest prefill point, FLOPs / (F x (seconds - overhead)), when it is
      compute-bound at that bandwidth; else the per-sequence decode cost,
      2 x params / (F x decode_per_seq_s)."""
    kv = measured.kv_bytes_per_token
    w = step_weight_bytes(model, weight_dtype)
    ar_fixed, ar_token = allreduce_s(model, hw)  # a TP worker's modelled all-reduces
    weights_s = measured.decode_fixed_s - step_overhead_s - ar_fixed
    if weights_s <= 0:
        raise ValueError(
            f"a step overhead of {step_overhead_s * 1e3:.3f} ms leaves nothing of the measured "
            f"decode_fixed_s ({measured.decode_fixed_s * 1e3:.3f} ms) for the weights' read"
        )
    e_bw = w / (hw.bytes_per_s * weights_s)
    per_ctx = measured.decode_per_ctx_token_s
    e_kv = kv / (hw.bytes_per_s * per_ctx) if per_ctx > 0 else e_bw
    details: dict = {"kind": "calibrated", "hardware": hw.name, "profile": measured.model}
    tokens, seconds = measured.prefill_points[-1]
    memory_s = (w + tokens * kv) / (hw.bytes_per_s * e_bw)
    compute_s = seconds - step_overhead_s - ar_fixed - ar_token * tokens
    if compute_s > memory_s * 1.0001:
        e_f = model.prefill_flops(tokens) / (hw.flops * compute_s)
        details["flops_from"] = f"prefill at {tokens} tokens"
    elif measured.decode_per_seq_s > ar_token:
        e_f = model.decode_flops_per_seq() / (hw.flops * (measured.decode_per_seq_s - ar_token))
        details["flops_from"] = "decode_per_seq_s"
    else:
        raise ValueError(
            "the measured profile identifies no FLOP/s efficiency: its largest prefill step is "
            "bandwidth-bound and its decode has no per-sequence cost"
        )
    return Efficiency(e_bw, e_f, step_overhead_s, e_kv, details)
