"""A bandwidth-bound bf16 GEMV for x86 CPUs with AVX-512 but no bf16 instructions.

Decode multiplies a handful of activation rows by every weight matrix: the step is bound by
reading the weights. On CPUs without AVX512-BF16/AMX, torch's bf16 GEMM (oneDNN's emulation)
reaches only about half the memory bandwidth at one row (measured: ~13.5 GB/s against ~27 GB/s
for fp32 on the project's 2-core box), so a bf16 decode step was no faster than an fp32 one
that reads twice the bytes. This kernel widens each bf16 weight to fp32 in registers (a 16-bit
shift), multiplies with fp32 FMAs, accumulates in fp32, and rounds the result to bf16 once:
the same arithmetic as a bf16 GEMM with fp32 accumulation, at streaming speed.

Lifecycle: `load()` compiles the C++ source once per process with torch's cpp_extension (g++,
ninja) into torch's extension cache and returns the op, or None when the CPU lacks AVX-512F,
the build fails, or no compiler is present; callers then keep torch's own GEMM.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>
#include <vector>

static inline __m512 widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Rows [n0, n1) of out for activation rows [m0, m0 + MB): each weight chunk is loaded and
// widened once and used for all MB rows.
template <int MB>
static void rows(const uint16_t* wp, const float* xp, const float* bp, at::BFloat16* op,
                 int64_t n0, int64_t n1, int64_t m0, int64_t K, int64_t N) {
    const int64_t K32 = K - K % 32;
    for (int64_t n = n0; n < n1; ++n) {
        const uint16_t* row = wp + n * K;
        __m512 a0[MB], a1[MB];
        for (int m = 0; m < MB; ++m) { a0[m] = _mm512_setzero_ps(); a1[m] = _mm512_setzero_ps(); }
        for (int64_t k = 0; k < K32; k += 32) {
            __m512i raw = _mm512_loadu_si512(reinterpret_cast<const void*>(row + k));
            __m512 lo = widen(_mm512_castsi512_si256(raw));
            __m512 hi = widen(_mm512_extracti64x4_epi64(raw, 1));
            for (int m = 0; m < MB; ++m) {
                const float* xr = xp + (m0 + m) * K + k;
                a0[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), a0[m]);
                a1[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), a1[m]);
            }
        }
        for (int m = 0; m < MB; ++m) {
            const float* xr = xp + (m0 + m) * K;
            float acc = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
            for (int64_t k = K32; k < K; ++k) {
                uint32_t bits = static_cast<uint32_t>(row[k]) << 16;
                float wv;
                std::memcpy(&wv, &bits, 4);
                acc += wv * xr[k];
            }
            if (bp) acc += bp[n];
            op[(m0 + m) * N + n] = at::BFloat16(acc);  // round to nearest even
        }
    }
}

// out[m, n] = bf16(sum_k x[m, k] * w[n, k] + bias[n]); x [M, K], w [N, K] bf16, contiguous.
torch::Tensor gemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shape mismatch");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16");
    TORCH_CHECK(w.is_contiguous(), "weight must be contiguous");
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    // Widen x (and the bias) here rather than with aten ops: a decode step makes a few hundred
    // calls, and each aten op costs microseconds of dispatch.
    std::vector<float> xv(M * K), bv(bias.has_value() ? N : 0);
    TORCH_CHECK(x.stride(1) == 1, "x rows must be contiguous");
    for (int64_t m = 0; m < M; ++m) {
        const at::BFloat16* xr = x.data_ptr<at::BFloat16>() + m * x.stride(0);
        for (int64_t k = 0; k < K; ++k) xv[m * K + k] = static_cast<float>(xr[k]);
    }
    if (bias.has_value()) {
        TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous(), "bias");
        const at::BFloat16* b = bias->data_ptr<at::BFloat16>();
        for (int64_t n = 0; n < N; ++n) bv[n] = static_cast<float>(b[n]);
    }
    torch::Tensor out = torch::empty({M, N}, x.options());
    const float* xp = xv.data();
    const float* bp = bias.has_value() ? bv.data() : nullptr;
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    at::BFloat16* op = out.data_ptr<at::BFloat16>();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) rows<4>(wp, xp, bp, op, n0, n1, m, K, N);
        switch (M - m) {
            case 3: rows<3>(wp, xp, bp, op, n0, n1, m, K, N); break;
            case 2: rows<2>(wp, xp, bp, op, n0, n1, m, K, N); break;
            case 1: rows<1>(wp, xp, bp, op, n0, n1, m, K, N); break;
            default: break;
        }
    });
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("gemv", &gemv, "bf16 GEMV (fp32 accumulate)"); }
"""


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.lru_cache(maxsize=1)
def load():
    """The compiled `gemv(x, w, bias)` op, or None where it cannot be used."""
    if not {"avx512f", "avx512bw"} <= _cpu_flags():
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        mod = load_inline(
            name="tandem_bf16_gemv",
            cpp_sources=[_SOURCE],
            extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mfma", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, odd toolchain: keep torch's GEMM
        log.warning("bf16 GEMV kernel unavailable (%s); using torch's bf16 GEMM", exc)
        return None
    return mod.gemv


def check(op) -> bool:
    """The op agrees with an fp32 reference on a small case (guards a miscompiled kernel)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 80, generator=g).to(torch.bfloat16)
    w = torch.randn(40, 80, generator=g).to(torch.bfloat16)
    b = torch.randn(40, generator=g).to(torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    got = op(x, w, b).float()
    return bool(torch.allclose(got, ref, rtol=1e-2, atol=1e-2))
