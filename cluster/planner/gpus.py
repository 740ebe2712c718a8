"""The GPUs `tandem plan` knows: memory bandwidth, dense tensor FLOP/s, memory, and the links a
KV hand-off can take. Data only, read by cluster/planner/roofline.py.

Every figure is the vendor's datasheet number for one GPU, dense (no 2:4 sparsity), in SI units
(1 TB/s = 1e12 B/s, 1 TFLOP/s = 1e12 FLOP/s, 1 GB = 1e9 B); `nvlink_gbs` is one direction of
the GPU's NVLink (half the quoted bidirectional total; 0 without NVLink) and `network_gbs` the
per-GPU scale-out link of the usual server (one 400 Gb/s NIC per GPU on HGX/DGX systems =
50 GB/s; PCIe cards without NVLink: their PCIe link, one direction). Sources:

- H100 SXM5 / H100 PCIe: NVIDIA H100 Tensor Core GPU datasheet (3.35 / 2.0 TB/s HBM; BF16
  989.4 / 756 TFLOPS and FP8 1,978.9 / 1,513 TFLOPS dense; NVLink 900 / 600 GB/s bidi.).
- H200 SXM: NVIDIA H200 datasheet (141 GB HBM3e, 4.8 TB/s; compute as H100 SXM).
- A100 SXM4 80 GB / 40 GB: NVIDIA A100 datasheet (2,039 / 1,555 GB/s; BF16 312 TFLOPS dense;
  no FP8; NVLink 600 GB/s bidi.).
- L40S: NVIDIA L40S datasheet (48 GB GDDR6, 864 GB/s; BF16 362.05, FP8 733 TFLOPS dense;
  PCIe Gen4 x16 64 GB/s bidi., no NVLink).
- L4: NVIDIA L4 datasheet (24 GB, 300 GB/s; BF16 121, FP8 242.5 TFLOPS dense; PCIe Gen4 x16).
- A10G: AWS G5's A10 variant (24 GB GDDR6, 600 GB/s, as the A10; BF16 tensor ~70 TFLOPS dense
  as AWS/NVIDIA list it for the A10G, against the A10's 125; no FP8).
- B200 (HGX B200, per GPU): NVIDIA DGX/HGX B200 datasheet (180 GB HBM3e, 8 TB/s; BF16 2.25,
  FP8 4.5 PFLOPS dense; NVLink 5 1.8 TB/s bidi.).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class GPU:
    name: str
    bandwidth_gbs: float  # memory bandwidth, GB/s
    bf16_tflops: float  # dense BF16 tensor throughput
    fp8_tflops: float | None  # dense FP8 tensor throughput; None: no FP8 tensor cores
    memory_gb: float
    nvlink_gbs: float  # one direction; 0 without NVLink
    network_gbs: float  # per-GPU scale-out link (or PCIe), one direction

    def __post_init__(self) -> None:
        for name in ("bandwidth_gbs", "bf16_tflops", "memory_gb", "network_gbs"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GPU {self.name}: {name} must be > 0, got {getattr(self, name)}")
        if self.nvlink_gbs < 0:
            raise ValueError(f"GPU {self.name}: nvlink_gbs must be >= 0, got {self.nvlink_gbs}")
        if self.fp8_tflops is not None and not self.fp8_tflops > 0:
            raise ValueError(f"GPU {self.name}: fp8_tflops must be > 0 or None")

    def tflops(self, weight_dtype: str) -> float:
        """Dense tensor TFLOP/s for GEMMs with `weight_dtype` operands (bf16, or fp8 W8A8)."""
        if weight_dtype == "fp8":
            if self.fp8_tflops is None:
                raise ValueError(f"{self.name} has no FP8 tensor cores: use --weight-dtype bf16")
            return self.fp8_tflops
        return self.bf16_tflops

    def link_gbs(self, link: str) -> float:
        """One-direction GB/s of the link a KV hand-off takes ("network" or "nvlink")."""
        if link == "nvlink":
            if not self.nvlink_gbs:
                raise ValueError(f"{self.name} has no NVLink: use --kv-link network")
            return self.nvlink_gbs
        if link == "network":
            return self.network_gbs
        raise ValueError(f"kv link must be 'network' or 'nvlink', got {link!r}")


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("h100-sxm", 3350, 989.4, 1978.9, 80, 450, 50),
        GPU("h100-pcie", 2000, 756, 1513, 80, 300, 32),
        GPU("h200", 4800, 989.4, 1978.9, 141, 450, 50),
        GPU("a100-80g", 2039, 312, None, 80, 300, 25),
        GPU("a100-40g", 1555, 312, None, 40, 300, 25),
        GPU("l40s", 864, 362.05, 733, 48, 0, 32),
        GPU("l4", 300, 121, 242.5, 24, 0, 32),
        GPU("a10g", 600, 70, None, 24, 0, 32),
        GPU("b200", 8000, 2250, 4500, 180, 900, 50),
    )
}
# Other spellings people type.
ALIASES = {
    "h100": "h100-sxm",
    "h100-sxm5": "h100-sxm",
    "h200-sxm": "h200",
    "a100": "a100-80g",
    "a100-80gb": "a100-80g",
    "a100-40gb": "a100-40g",
}


def gpu(name: str) -> GPU:
    """The table's GPU of `name` (case-insensitive, aliases accepted); ValueError naming the
    known ones otherwise."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = ALIASES.get(key, key)
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]
