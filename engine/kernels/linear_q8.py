"""int8 x int8 decode products (W8A8) on x86 CPUs with AVX2: llama.cpp Q8_0's arithmetic.

The widening int8 kernels (`engine.kernels.linear`) turn every weight into an fp32 before its
FMA: three instructions per 8 weights, which bound an int8 GEMV to ~6.5-7 GB/s a core on a
2 GHz AMD EPYC (Zen 2) where the memory streams at 12-15 GB/s. Here the activation rows are
quantized too, per block of 32 (scale = max|x| / 127, values rounded to nearest even), and
each block's 32 products are summed in integers with `maddubs` (unsigned x signed bytes: the
weight's sign moves onto the activation, `sign`) and `madd`: ~7 instructions per 32 weights.
Each block's integer sum is exact; it is scaled by the block's activation scale (times the
weight group's scale for group-quantized weights) into fp32 accumulators; the row's weight
scale and the bias are applied to the sum, then one rounding to the activation dtype.

- `gemv_q8(x, w, scale, bias)`: x [1-3, K] fp32|bf16, w [N, K] int8 (values in [-128, 127]),
  scale [N] fp32 or group scales [N, K / G] (G a multiple of 32), K a multiple of 32.

What it changes: the activations lose precision (8 bits per block of 32) where the widening
kernels keep them; `engine.quantization` exposes it as its own method ("int8-w8a8"), used for
decode rows only (prefill rows are compute-bound and keep the widening tile kernel).
"""

from __future__ import annotations

import torch

BLOCK = 32

SOURCE = r"""
#if defined(__AVX2__) && defined(__FMA__)
#define TANDEM_Q8_LINEAR 1
#include <immintrin.h>

namespace q8_linear {

constexpr int64_t kBlock = 32;
// Bytes ahead of the rows being read that a tile asks the cache for: the hardware prefetcher
// alone read a 28 MB head at ~6 GB/s on Zen 2 (less with rows side by side); with this it
// reads at ~9, the rate of weights already in cache (0.72-0.73x the time per call:
// benchmarks/cpu_ops_ab.py, benchmarks/README.md).
constexpr int64_t kPrefetch = 4096;

inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One row of K fp32 values -> K int8 (q) and K / 32 scales (s): per block, d = max|x| / 127,
// q = round-to-nearest-even(x * (127 / max|x|)); an all-zero block gets d = 0 and q = 0.
inline void quantize_row(const float* x, int64_t K, int8_t* q, float* s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < K / kBlock; ++b) {
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
            v[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        const float m = hmax8(amax);
        s[b] = m / 127.f;
        const __m256 inv = _mm256_set1_ps(m > 0.f ? 127.f / m : 0.f);
        __m256i r[4];
        for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        // packs work within 128-bit lanes: the permute puts the 8 dwords back in order.
        const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]),
                                             _mm256_packs_epi32(r[2], r[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock),
                            _mm256_permutevar8x32_epi32(w, order));
    }
}

// Weight rows [n, n + NR) x activation rows [0, MB): per 32-weight block, |w| (unsigned)
// times x with w's sign, pairs summed to int16 (at most 2 * 128 * 127, no saturation), then
// to 8 int32 lanes; scaled into fp32 by the block's activation scale (and the weight
// group's). The NR rows run side by side, each with its own accumulators and the same order
// of operations as alone (the results do not depend on NR), sharing the activation loads.
// Measured on Zen 2 (scratch builds, 1 thread, a 28 MB head from memory, with the
// prefetch): 4 rows side by side 8.6-9.1 GB/s, one at a time 7.3-8.7; cached weights: alike.
template <int MB, int NR, bool GS, typename O>
static void tile(const int8_t* wp, const int8_t* xq, const float* xs, const float* sp,
                 const float* gp, int64_t G, const float* bp, O* op, int64_t n, int64_t K,
                 int64_t N) {
    const int64_t nb = K / kBlock, per = GS ? G / kBlock : 1, ng = GS ? K / G : 0;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 a[NR][MB];
    for (int r = 0; r < NR; ++r)
        for (int m = 0; m < MB; ++m) a[r][m] = _mm256_setzero_ps();
    int64_t gi = 0, left = per;  // the weight group of block b, without a division
    // The tile's NR rows are NR * K contiguous bytes, read at NR * 32 bytes a block: ask for
    // the bytes kPrefetch further on at the same pace (past the end, a prefetch is a no-op).
    const char* ahead = reinterpret_cast<const char*>(wp + n * K) + kPrefetch;
    for (int64_t b = 0; b < nb; ++b) {
        for (int j = 0; j < NR * kBlock; j += 64)
            _mm_prefetch(ahead + b * NR * kBlock + j, _MM_HINT_T0);
        __m256i x[MB];
        for (int m = 0; m < MB; ++m)
            x[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + b * kBlock));
        for (int r = 0; r < NR; ++r) {
            const __m256i w =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (n + r) * K + b * kBlock));
            const __m256i aw = _mm256_sign_epi8(w, w);
            const float gs = GS ? gp[(n + r) * ng + gi] : 1.f;
            for (int m = 0; m < MB; ++m) {
                const __m256i p =
                    _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x[m], w)), ones);
                const float f = GS ? xs[m * nb + b] * gs : xs[m * nb + b];
                a[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(f), a[r][m]);
            }
        }
        if (GS && --left == 0) ++gi, left = per;
    }
    for (int r = 0; r < NR; ++r)
        for (int m = 0; m < MB; ++m) {
            float acc = hsum8(a[r][m]);
            if (!GS) acc *= sp[n + r];
            if (bp) acc += bp[n + r];
            op[m * N + n + r] = static_cast<O>(acc);  // bf16: round to nearest even
        }
}

// Rows [n0, n1) in tiles of 4 rows (2 for 2-3 activation rows: 16 vector registers).
template <int MB, bool GS, typename O>
static void rows(const int8_t* wp, const int8_t* xq, const float* xs, const float* sp,
                 const float* gp, int64_t G, const float* bp, O* op, int64_t n0, int64_t n1,
                 int64_t K, int64_t N) {
    constexpr int NR = MB == 1 ? 4 : 2;
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) tile<MB, NR, GS>(wp, xq, xs, sp, gp, G, bp, op, n, K, N);
    for (; n < n1; ++n) tile<MB, 1, GS>(wp, xq, xs, sp, gp, G, bp, op, n, K, N);
}

template <bool GS, typename O>
void dispatch(const int8_t* wp, const int8_t* xq, const float* xs, const float* sp,
              const float* gp, int64_t G, const float* bp, O* op, int64_t M, int64_t K,
              int64_t N) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        switch (M) {
            case 3: rows<3, GS>(wp, xq, xs, sp, gp, G, bp, op, n0, n1, K, N); break;
            case 2: rows<2, GS>(wp, xq, xs, sp, gp, G, bp, op, n0, n1, K, N); break;
            default: rows<1, GS>(wp, xq, xs, sp, gp, G, bp, op, n0, n1, K, N); break;
        }
    });
}

torch::Tensor gemv_q8(torch::Tensor x, torch::Tensor w, torch::Tensor scale,
                      c10::optional<torch::Tensor> bias) {
    TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 3, "gemv_q8 takes 1-3 rows");
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kChar &&
                w.size(1) == x.size(1), "w: int8 [N, K] contiguous, K as x's");
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    TORCH_CHECK(K % kBlock == 0, "K must be a multiple of 32");
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.size(0) == N,
                "scale: fp32 [N] or [N, K / G], contiguous");
    const bool grouped = scale.dim() == 2;
    const int64_t G = grouped ? K / std::max<int64_t>(scale.size(1), 1) : 0;
    TORCH_CHECK(!grouped || (scale.size(1) > 0 && K % scale.size(1) == 0 && G % kBlock == 0),
                "group scales: G must divide K and be a multiple of 32");
    std::vector<float> xb, bb;
    const float* xp = narrow_linear::as_float(x, M, K, xb);
    const float* bp = nullptr;
    if (bias.has_value()) {
        TORCH_CHECK(bias->numel() == N, "bias must have one entry per output row");
        bp = narrow_linear::as_float(*bias, 1, N, bb);
    }
    std::vector<int8_t> xq(M * K);
    std::vector<float> xs(M * (K / kBlock));
    for (int64_t m = 0; m < M; ++m)
        quantize_row(xp + m * K, K, xq.data() + m * K, xs.data() + m * (K / kBlock));
    torch::Tensor out = torch::empty({M, N}, x.options());
    const float* sp = scale.data_ptr<float>();
    auto go = [&](auto* op) {
        if (grouped)
            dispatch<true>(w.data_ptr<int8_t>(), xq.data(), xs.data(), nullptr, sp, G, bp, op,
                           M, K, N);
        else
            dispatch<false>(w.data_ptr<int8_t>(), xq.data(), xs.data(), sp, nullptr, 0, bp, op,
                            M, K, N);
    };
    if (x.scalar_type() == at::kFloat)
        go(out.data_ptr<float>());
    else
        go(out.data_ptr<at::BFloat16>());
    return out;
}

}  // namespace q8_linear
#endif
"""

BINDINGS = r"""
#ifdef TANDEM_Q8_LINEAR
    m.def("gemv_q8", &q8_linear::gemv_q8, "int8 x int8 GEMV (activations per 32-block), 1-3 rows");
#endif
"""


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel does to x [M, K]: int8 values (as fp32) and per-32-block scales."""
    xf = x.float().view(x.shape[0], -1, BLOCK)
    amax = xf.abs().amax(-1, keepdim=True)
    # A tensor / tensor division (one rounding, as the kernel's): torch computes `127.0 / t`
    # as 127 * reciprocal(t), two roundings, which moves values near .5 to the other integer.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv).clamp_(-128, 127)
    return q.view(x.shape), (amax / 127.0).squeeze(-1)


def reference(x, w, scale, bias):
    """fp32 math on the quantized activations: per block, sum(w * q) * x scale (* the weight
    group's scale); the row scale and the bias on the sum; one rounding to x's dtype."""
    q, xs = quantize_activations(x)
    m, k = x.shape
    prod = (q.view(m, 1, -1, BLOCK) * w.float().view(1, w.shape[0], -1, BLOCK)).sum(-1)
    prod = prod * xs[:, None, :]  # [M, N, K / 32]
    if scale.dim() == 2:
        prod = prod * scale.float().repeat_interleave(k // scale.shape[1] // BLOCK, 1)[None]
        y = prod.sum(-1)
    else:
        y = prod.sum(-1) * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def check(ops) -> bool:
    """gemv_q8 agrees with `reference` (per-row and group scales, fp32 and bf16 activations,
    1-3 rows, a zero block): guards a miscompiled kernel before the engine trusts it."""
    g = torch.Generator().manual_seed(0)
    for m, n, k, group in ((1, 40, 96, 0), (3, 9, 64, 32), (2, 70, 192, 64), (1, 5, 32, 0)):
        for xdt in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=g, dtype=torch.float32)
            x[0, :BLOCK] = 0  # an all-zero block: scale 0, no division by zero
            x = x.to(xdt)
            w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
            shape = (n, k // group) if group else (n,)
            scale = torch.rand(shape, generator=g, dtype=torch.float32) / 64
            b = torch.randn(n, generator=g, dtype=torch.float32).to(xdt)
            got = ops.gemv_q8(x, w, scale, b)
            ref = reference(x, w, scale, b)
            if got.dtype != xdt or got.shape != ref.shape:
                return False
            tol = 1e-4 if xdt == torch.float32 else 2**-7
            if not torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol):
                return False
    return True
