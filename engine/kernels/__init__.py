"""CPU kernels in C++, compiled on first use: what the CPU reference path cannot do fast in torch.

- `linear`: GEMV/GEMM for bf16 weights (CPUs without bf16 instructions) and int8 weights with
  per-channel scales (weight-only quantization); AVX-512, or AVX2 + FMA on 8-lane vectors.
- `linear_q8`: int8 weights x int8 activations (per 32-block scales, llama.cpp Q8_0's
  arithmetic) for decode rows; AVX2.
- `paged_decode`: decode attention reading the paged KV cache in place (any x86/ARM CPU;
  AVX-512 intrinsics where available).
- `fused`: residual add + RMSNorm, in-place RoPE, SiLU-and-multiply (fp32/bf16), keeping Hugging
  Face's rounding points so greedy parity holds.
- `decode_stack`: a whole decode step (every layer) in one C++ call for 1-3 rows, made of the
  ops above (wherever `linear` builds).

`ops()` compiles all of them as one extension (one compile of torch's headers, ~30-60 s the
first time on a 2-core box, then cached on disk by torch's cpp_extension under
TORCH_EXTENSIONS_DIR) and checks each op against a torch reference; an op that fails its check
or does not exist on this CPU is None, and callers then keep their torch path. `ops()` returns
None when the build is impossible (no compiler, no ninja) or `TANDEM_CPU_KERNELS=0`.
GPU engines never call it; they take `gpu_ops()` (Triton: engine.kernels.triton_fused, and
the paged decode of engine.kernels.triton_attention through the triton attention backend).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

from engine.kernels import decode_stack, fused, linear, linear_q8, paged_decode

log = logging.getLogger(__name__)
_NAME = "tandem_cpu_kernels"

_HEADER = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
"""


@dataclass(frozen=True)
class CpuOps:
    # (x [M, K] fp32|bf16, w [N, K] bf16|int8, scale [N] | None, bias [N] | None) -> [M, N]
    # in x's dtype; gemv takes M <= 3. See engine.kernels.linear.
    gemv: Any = None
    tiled_linear: Any = None
    # int8 weights x int8 activations quantized per 32-block (engine.kernels.linear_q8), 1-3
    # rows: the "int8-w8a8" quantization's decode products; needs AVX2.
    gemv_q8: Any = None
    paged_decode: Any = None  # see engine.kernels.paged_decode
    cache_write: Any = None  # ditto (checked together with paged_decode)
    add_rms_norm: Any = None  # see engine.kernels.fused (these three pass or fail together)
    rope_: Any = None
    silu_mul: Any = None
    # The C++ layer loop for 1-3 decode rows (engine.kernels.decode_stack): a class, built
    # from the kernels above, so offered only when all of them passed their checks.
    decode_stack: Any = None


def gpu_ops(device=None):
    """The GPU's fused ops (engine.kernels.triton_fused.TritonOps), or None without Triton:
    the model keeps its torch path then. Imported on first use: Triton is a GPU extra. With
    `device`, the RoPE kernel is checked there first, as the CPU kernels are (once per
    device): where it is not bit-equal to torch's RoPE, RoPE stays in torch (greedy parity
    with transformers depends on it, and a compiler may contract differently on another GPU)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return None
    from engine.kernels.triton_fused import TritonOps, TritonOpsTorchRope

    if device is None or _rope_checks(str(device)):
        return TritonOps
    return TritonOpsTorchRope


# device -> whether the engine runs the Triton RoPE there: each device's check, run once (the
# GPU run records these: a check that failed where the engine ran it once went unnoticed).
ROPE_VERDICTS: dict[str, bool] = {}


def _rope_checks(device: str) -> bool:
    if device not in ROPE_VERDICTS:
        ROPE_VERDICTS[device] = _check_rope(device)
    return ROPE_VERDICTS[device]


def _check_rope(device: str) -> bool:
    from engine.kernels.triton_fused import rope_matches_torch

    try:
        agree = rope_matches_torch(device)
    except Exception as exc:  # a kernel that cannot run here is as bad as a wrong one
        log.warning("the Triton RoPE raised %r on %s; RoPE stays in torch", exc, device)
        return False
    if not all(agree.values()):
        log.warning("the Triton RoPE differs from torch's on %s (%s); RoPE stays in torch",
                    device, agree)  # fmt: skip
    return all(agree.values())


def enabled() -> bool:
    return os.environ.get("TANDEM_CPU_KERNELS", "1") != "0"


def unavailable_reason() -> str | None:
    """Why `ops()` cannot build on this machine, or None when it should (so a failed build
    there is a bug, not an environment limit)."""
    import shutil

    if not enabled():
        return "TANDEM_CPU_KERNELS=0"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler on PATH"
    try:
        from torch.utils.cpp_extension import verify_ninja_availability

        verify_ninja_availability()
    except Exception:
        return "ninja is not installed"
    return None


def _cpu_flags() -> set[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has_avx512() -> bool:
    """The AVX-512 subset the wide linear kernels are written for (AVX512F/BW/VL)."""
    return {"avx512f", "avx512bw", "avx512vl"} <= _cpu_flags()


def cpu_has_linear_kernels() -> bool:
    """The linear kernels (and the decode loop built on them) exist on this CPU: AVX-512, or
    AVX2 with FMA (their 8-lane version)."""
    return cpu_has_avx512() or {"avx2", "fma"} <= _cpu_flags()


def source() -> str:
    return "\n".join(
        [
            _HEADER,
            linear.SOURCE,
            linear_q8.SOURCE,  # uses linear's argument helpers
            paged_decode.SOURCE,
            fused.SOURCE,  # uses paged_decode::exp8
            decode_stack.SOURCE,  # calls the ones above: after them
            "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {",
            linear.BINDINGS,
            linear_q8.BINDINGS,
            paged_decode.BINDINGS,
            fused.BINDINGS,
            decode_stack.BINDINGS,
            "}",
        ]
    )


@functools.lru_cache(maxsize=1)
def ops() -> CpuOps | None:
    """The checked ops, or None where nothing could be built (see the module docstring)."""
    if not enabled():
        return None
    mod = _build()
    return None if mod is None else _checked(mod)


def _build():
    """The compiled extension module, or None (logged) where it cannot be built here."""
    try:
        from torch.utils.cpp_extension import load_inline

        # Long work shows progress: a first build takes ~35-60 s on a small box, and workers
        # log at WARNING by default, so say so at that level (only when nothing is cached).
        level = logging.WARNING if not _cached() else logging.DEBUG
        log.log(
            level,
            "building tandem's CPU kernels (first use on this machine, up to a "
            "minute; cached afterwards)",
        )
        mod = load_inline(
            name=_NAME,
            cpp_sources=[source()],
            # -march=native: compiled on the machine that runs it (torch caches per source
            # and flags); omp simd lets the portable loops vectorise their fp32 reductions.
            # -ffp-contract=off: no implicit FMAs, so the fused ops round exactly where
            # torch's separate ops do (the hot loops use explicit FMA intrinsics anyway).
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, odd toolchain: keep the torch paths
        log.warning("tandem CPU kernels unavailable (%s); using torch everywhere", exc)
        return None
    return mod


def _checked(mod) -> CpuOps:
    """The module's ops, each kept only if it (and what it is built from) passes its check."""
    found = CpuOps(
        gemv=getattr(mod, "gemv", None),
        tiled_linear=getattr(mod, "tiled_linear", None),
        gemv_q8=getattr(mod, "gemv_q8", None),
        paged_decode=getattr(mod, "paged_decode", None),
        cache_write=getattr(mod, "cache_write", None),
        add_rms_norm=getattr(mod, "add_rms_norm", None),
        rope_=getattr(mod, "rope_", None),
        silu_mul=getattr(mod, "silu_mul", None),
    )
    gemm_ok = found.tiled_linear is not None and _passes(linear.check, found)
    q8_ok = gemm_ok and found.gemv_q8 is not None and _passes(linear_q8.check, found)
    attn_ok = found.paged_decode is not None and _passes(paged_decode.check, found)
    fused_ok = found.add_rms_norm is not None and _passes(fused.check, found)
    for name, ok, present in (
        ("narrow-weight linear", gemm_ok, found.tiled_linear),
        ("int8 x int8 linear", q8_ok, found.gemv_q8),
        ("paged decode", attn_ok, found.paged_decode),
        ("fused elementwise", fused_ok, found.add_rms_norm),
    ):
        if present is not None and not ok:
            log.warning("tandem CPU kernel %r disagrees with its reference; not using it", name)
    all_ok = gemm_ok and attn_ok and fused_ok
    return CpuOps(
        gemv=found.gemv if gemm_ok else None,
        tiled_linear=found.tiled_linear if gemm_ok else None,
        gemv_q8=found.gemv_q8 if q8_ok else None,
        paged_decode=found.paged_decode if attn_ok else None,
        cache_write=found.cache_write if attn_ok else None,
        add_rms_norm=found.add_rms_norm if fused_ok else None,
        rope_=found.rope_ if fused_ok else None,
        silu_mul=found.silu_mul if fused_ok else None,
        decode_stack=getattr(mod, "DecodeStack", None) if all_ok else None,
    )


def _cached() -> bool:
    """Best effort: does torch's extension cache hold a build of these kernels already?"""
    try:
        from pathlib import Path

        from torch.utils.cpp_extension import _get_build_directory

        return any(Path(_get_build_directory(_NAME, False)).glob(f"{_NAME}*.so"))
    except Exception:  # a private helper; if it moves, just log quietly
        return True


def _passes(check, found: CpuOps) -> bool:
    try:
        return bool(check(found))
    except Exception as exc:  # a kernel that raises on a valid case is as bad as a wrong one
        log.warning("tandem CPU kernel check raised %r", exc)
        return False


def get(name: str):
    """One op by name, or None (kernels off, not built, or failed their check)."""
    o = ops()
    return None if o is None else getattr(o, name)
