"""bf16-weight matrix products for x86 CPUs with AVX-512 but no bf16 instructions.

On CPUs without AVX512-BF16/AMX, torch's bf16 GEMM is oneDNN's emulation: several times slower
than fp32 at prefill sizes, and only about half the memory bandwidth at decode sizes (measured
on the project's 2-core box: ~13.5 GB/s against ~27 GB/s for fp32 at one row). Both kernels
here widen each bf16 weight to fp32 in registers (a 16-bit shift), multiply with fp32 FMAs,
accumulate in fp32 and round the result to bf16 once: the arithmetic of a bf16 GEMM with fp32
accumulation (bf16 products are exact in fp32), up to summation order.

- `bf16_gemv(x, w, bias)`: 1-3 activation rows; streams each weight row once (bandwidth-bound).
- `bf16_linear(x, w, bias)`: any number of rows in 4 x 4 tiles (4 weight rows x 4 activation
  rows, 16 fp32 accumulators, one widening per weight vector for 4 rows, 16 horizontal sums in
  15 adds). ~80-100 GFLOP/s per core against ~55-60 for fp32 oneDNN at 16 rows; at hundreds
  of rows oneDNN's fp32 GEMM on widened copies is faster (see `engine.models.llama.Linear`).

Built by `engine.kernels` (one extension for all CPU kernels); not compiled where the compiler
targets no AVX-512 (the sources are guarded by `__AVX512F__`).
"""

from __future__ import annotations

import torch

SOURCE = r"""
#ifdef __AVX512F__
#include <immintrin.h>

namespace bf16_linear {

inline __m512 widen16(const uint16_t* p, __mmask16 k) {
    __m256i h = _mm256_maskz_loadu_epi16(k, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 widen16(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// How far ahead each weight row is prefetched. Four rows stream side by side, and the
// hardware prefetcher alone left the GEMV at ~65% of a plain read's bandwidth; 512 bytes
// ahead brought it to ~120% of torch's sum() (measured with 1 and 2 threads, 64 MB weight).
constexpr int kPrefetchBytes = 512;

// Weight rows [4 t0, 4 t1) x activation rows [0, MB): four weight rows at a time, each
// chunk widened once and used for every activation row.
template <int MB>
static void rows(const uint16_t* wp, const float* xp, const float* bp, at::BFloat16* op,
                 int64_t t0, int64_t t1, int64_t K, int64_t N) {
    const int64_t K16 = K - K % 16;
    const __mmask16 tail = (__mmask16)((1u << (K - K16)) - 1);
    for (int64_t t = t0; t < t1; ++t) {
        const uint16_t* r[4];
        for (int j = 0; j < 4; ++j) r[j] = wp + std::min(t * 4 + j, N - 1) * K;
        __m512 a[4][MB];
        for (int j = 0; j < 4; ++j)
            for (int m = 0; m < MB; ++m) a[j][m] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K16; k += 16) {
            __m512 xv[MB];
            for (int m = 0; m < MB; ++m) xv[m] = _mm512_loadu_ps(xp + m * K + k);
            for (int j = 0; j < 4; ++j) {
                _mm_prefetch(reinterpret_cast<const char*>(r[j] + k) + kPrefetchBytes,
                             _MM_HINT_T0);
                const __m512 wv = widen16(r[j] + k);
                for (int m = 0; m < MB; ++m) a[j][m] = _mm512_fmadd_ps(wv, xv[m], a[j][m]);
            }
        }
        if (K16 < K) {
            __m512 xv[MB];
            for (int m = 0; m < MB; ++m) xv[m] = _mm512_maskz_loadu_ps(tail, xp + m * K + K16);
            for (int j = 0; j < 4; ++j) {
                const __m512 wv = widen16(r[j] + K16, tail);
                for (int m = 0; m < MB; ++m) a[j][m] = _mm512_fmadd_ps(wv, xv[m], a[j][m]);
            }
        }
        for (int j = 0; j < 4 && t * 4 + j < N; ++j) {
            const int64_t n = t * 4 + j;
            for (int m = 0; m < MB; ++m) {
                float acc = _mm512_reduce_add_ps(a[j][m]);
                if (bp) acc += bp[n];
                op[m * N + n] = at::BFloat16(acc);  // round to nearest even
            }
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
    TORCH_CHECK(M >= 1 && M <= 3, "gemv takes 1-3 rows; use linear");
    at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t t0, int64_t t1) {
        switch (M) {
            case 3: rows<3>(wp, xp, bp, op, t0, t1, K, N); break;
            case 2: rows<2>(wp, xp, bp, op, t0, t1, K, N); break;
            default: rows<1>(wp, xp, bp, op, t0, t1, K, N); break;
        }
    });
    return out;
}


// Lane i of the result = the sum of the lanes of v[i] (16 horizontal sums in 15 adds).
inline __m512 hsum16(const __m512* v) {
    __m512 w[8];
    for (int i = 0; i < 8; ++i)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    __m512 x[4];
    for (int j = 0; j < 4; ++j) {
        __m512d a = _mm512_castps_pd(w[2 * j]), b = _mm512_castps_pd(w[2 * j + 1]);
        x[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                               _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88),
                               _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88),
                         _mm512_shuffle_f32x4(z01, z23, 0xDD));
}

// out[m0+m, n0+n] for a 4x4 tile: 4 weight rows (bf16) x 4 activation rows (fp32). Rows past
// the edge are pointed at a valid row and their results dropped.
inline void tile(const uint16_t* const* w, const float* const* x, int64_t K, float* r) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    const int64_t K16 = K - K % 16;
    for (int64_t k = 0; k < K16; k += 16) {
        __m512 wv[4];
        for (int n = 0; n < 4; ++n) {
            _mm_prefetch(reinterpret_cast<const char*>(w[n] + k) + kPrefetchBytes, _MM_HINT_T0);
            wv[n] = widen16(w[n] + k);
        }
        for (int m = 0; m < 4; ++m) {
            __m512 xv = _mm512_loadu_ps(x[m] + k);
            for (int n = 0; n < 4; ++n) acc[n * 4 + m] = _mm512_fmadd_ps(wv[n], xv, acc[n * 4 + m]);
        }
    }
    if (K16 < K) {
        const __mmask16 mk = (__mmask16)((1u << (K - K16)) - 1);
        __m512 wv[4];
        for (int n = 0; n < 4; ++n) wv[n] = widen16(w[n] + K16, mk);
        for (int m = 0; m < 4; ++m) {
            __m512 xv = _mm512_maskz_loadu_ps(mk, x[m] + K16);
            for (int n = 0; n < 4; ++n) acc[n * 4 + m] = _mm512_fmadd_ps(wv[n], xv, acc[n * 4 + m]);
        }
    }
    _mm512_storeu_ps(r, hsum16(acc));
}

torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shape mismatch");
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous(), "weight: contiguous bf16");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x dtype");
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    torch::Tensor xf = x.to(at::kFloat).contiguous();  // no copy when already fp32
    std::vector<float> bv;
    if (bias.has_value()) {
        torch::Tensor b = bias->to(at::kFloat).contiguous();
        bv.assign(b.data_ptr<float>(), b.data_ptr<float>() + N);
    }
    torch::Tensor out = torch::empty({M, N}, x.options().dtype(at::kBFloat16));
    const float* xp = xf.data_ptr<float>();
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    at::BFloat16* op = out.data_ptr<at::BFloat16>();
    const int64_t NT = (N + 3) / 4;
    // Activation rows in blocks that stay in L2 while a thread's weight tiles pass over them.
    const int64_t MBLK = std::max<int64_t>(4, ((96 * 1024) / (K * 4)) / 4 * 4);
    at::parallel_for(0, NT, 8, [&](int64_t t0, int64_t t1) {
        float r[16];
        for (int64_t mb = 0; mb < M; mb += MBLK) {
            const int64_t me = std::min(M, mb + MBLK);
            for (int64_t t = t0; t < t1; ++t) {
                const int64_t n0 = t * 4;
                const uint16_t* wr[4];
                for (int n = 0; n < 4; ++n) wr[n] = wp + std::min(n0 + n, N - 1) * K;
                for (int64_t m0 = mb; m0 < me; m0 += 4) {
                    const float* xr[4];
                    for (int m = 0; m < 4; ++m) xr[m] = xp + std::min(m0 + m, M - 1) * K;
                    tile(wr, xr, K, r);
                    for (int n = 0; n < 4 && n0 + n < N; ++n)
                        for (int m = 0; m < 4 && m0 + m < M; ++m) {
                            float v = r[n * 4 + m];
                            if (!bv.empty()) v += bv[n0 + n];
                            op[(m0 + m) * N + n0 + n] = at::BFloat16(v);
                        }
                }
            }
        }
    });
    return out;
}


}  // namespace bf16_linear
#endif
"""

BINDINGS = r"""
#ifdef __AVX512F__
    m.def("bf16_gemv", &bf16_linear::gemv, "bf16 GEMV, 1-3 rows (fp32 accumulate)");
    m.def("bf16_linear", &bf16_linear::linear, "bf16-weight GEMM, 4x4 tiles (fp32 accumulate)");
#endif
"""


def check(ops) -> bool:
    """Both ops agree with an fp32 reference (rounded to bf16) on ragged shapes: guards a
    miscompiled kernel before the engine trusts it."""
    g = torch.Generator().manual_seed(0)
    for m, n, k, op in ((1, 40, 80, ops.bf16_gemv), (3, 9, 33, ops.bf16_gemv),
                        (1, 5, 7, ops.bf16_linear), (6, 13, 80, ops.bf16_linear),
                        (17, 70, 150, ops.bf16_linear)):
        x = torch.randn(m, k, generator=g, dtype=torch.float32).to(torch.bfloat16)
        w = torch.randn(n, k, generator=g, dtype=torch.float32).to(torch.bfloat16)
        b = torch.randn(n, generator=g, dtype=torch.float32).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
        got = op(x, w, b)
        if got.dtype != torch.bfloat16 or got.shape != ref.shape:
            return False
        if not torch.allclose(got.float(), ref, rtol=1e-2, atol=1e-2):
            return False
    return True
