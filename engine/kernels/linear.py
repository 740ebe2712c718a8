"""Matrix products for weights stored narrower than fp32, on x86 CPUs with AVX-512 or AVX2+FMA.

Two weight formats, one set of kernels (templated on the format):
- bf16, for CPUs without AVX512-BF16/AMX: torch's bf16 GEMM there is oneDNN's emulation,
  several times slower than fp32 at prefill sizes and at about half the memory bandwidth at
  decode sizes (measured on the project's 2-core box: ~13.5 GB/s against ~27 GB/s for fp32);
- int8 with one fp32 scale per output channel (weight-only quantization, `engine.quantization`):
  half the bytes of bf16 per decode step, which is what bounds a decode step.

Each weight is widened to fp32 in registers (bf16: a 16-bit shift; int8: sign-extend and
convert), multiplied with fp32 FMAs and accumulated in fp32; the row's scale (int8) and the
bias are applied to the sum and the result is rounded once to the activation dtype (fp32 or
bf16). For bf16 that is the arithmetic of a bf16 GEMM with fp32 accumulation (bf16 products are
exact in fp32), up to summation order.

- `gemv(x, w, scale, bias)`: 1-3 activation rows; the weight streams once in address order
  (bandwidth-bound: ~1.0x torch's fp32 `sum()` read rate for bf16, ~0.75x for int8, 64 MB).
  With bf16 weights and bf16 activations on a CPU with AVX512-BF16 it multiplies with the
  `vdpbf16ps` dot product instead of widening (`rows_dp`: a quarter of the instructions).
- `tiled_linear(x, w, scale, bias)`: any number of rows in 4 x 4 tiles (4 weight rows x 4
  activation rows, 16 fp32 accumulators, one widening per weight vector for 4 rows, the 16
  horizontal sums in 15 adds). ~70-100 GFLOP/s per core against ~55-60 for fp32 oneDNN at 16
  rows; at hundreds of rows oneDNN's fp32 GEMM on widened copies is faster (see
  `engine.models.linear.Linear`).

Two builds of the same kernels, picked by what the compiler targets (`-march=native`): 16-lane
AVX-512 (masked tails, a 4x4 tile) and, on CPUs without it (AMD Zen 1-3, Intel client and
pre-Skylake-SP parts), 8-lane AVX2 + FMA (tails through a zeroed copy, a 4x2 tile: AVX2 has 16
vector registers). The argument handling and the tile driver are shared.

Built by `engine.kernels` (one extension for all CPU kernels); not compiled where the compiler
targets neither (the sources are guarded by `TANDEM_NARROW_LINEAR`).
"""

from __future__ import annotations

import torch

SOURCE = r"""
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define TANDEM_NARROW_LINEAR 1
#include <immintrin.h>

namespace narrow_linear {

// The epilogue every kernel shares: scale (int8), bias, one rounding to the output dtype.
template <typename O>
inline void store(O* op, float acc, const float* sp, const float* bp, int64_t n) {
    if (sp) acc *= sp[n];
    if (bp) acc += bp[n];
    *op = static_cast<O>(acc);  // bf16: round to nearest even
}

// How far ahead each weight row of a tile is prefetched: four rows stream side by side, and
// the hardware prefetcher alone left them at ~65% of a plain read's bandwidth (Intel Xeon).
constexpr int kPrefetchBytes = 512;
// How far ahead `rows` (AVX2) asks for its weight row's bytes: the hardware prefetcher alone
// left a matrix streamed from memory short of the bandwidth on Zen 2; with this, SmolLM2's head
// GEMV takes 0.79x (bf16) and 0.83-0.88x (int8) the time (benchmarks/cpu_ops_ab.py).
constexpr int kRowPrefetchBytes = 2048;

// A row's group scales, taken chunk by chunk (`per` chunks of a vector's width to a group)
// with a counter: `k / G` in the inner loop was an integer division per chunk, slower than the
// chunk's loads and FMAs together (Zen 2: the int8 head at a fraction of the bf16 rate).
struct GroupWalk {
    int64_t at = 0, left, per;
    explicit GroupWalk(int64_t per_) : left(per_), per(per_) {}
    int64_t next() {  // the group of the next chunk
        const int64_t g = at;
        if (--left == 0) ++at, left = per;
        return g;
    }
};

#ifdef __AVX512F__

// 16 consecutive weights widened to fp32 (masked: the first popcount(k) of them, zeros after).
inline __m512 widen16(const uint16_t* p) {  // bf16
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 widen16(const uint16_t* p, __mmask16 k) {
    __m256i h = _mm256_maskz_loadu_epi16(k, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 widen16(const int8_t* p) {  // int8
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
inline __m512 widen16(const int8_t* p, __mmask16 k) {
    __m128i b = _mm_maskz_loadu_epi8(k, p);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

// Weight rows [n0, n1) x activation rows [0, MB), one weight row at a time in memory order:
// each 32-weight chunk is widened once and used for every activation row, into two
// accumulators per activation row (even and odd 16-wide chunks; two chains hide the FMA
// latency). Four rows side by side (the first layout) read at ~0.4 of `sum()`'s bandwidth on
// an AMD EPYC: rows of 576-1536 weights are too short for four interleaved streams to get the
// hardware prefetcher going. In address order the GEMV reads at ~1.0x of `sum()` (bf16) and
// ~0.75x (int8) there (`benchmarks/cpu_decode.py`).
// GS: int8 weights with one scale per G consecutive weights of a row (gp [N, K / G]; G a
// multiple of 16): each widened 16-weight vector is multiplied by its group's scale before the
// FMA (the row scale `sp` is then null).
template <int MB, bool GS = false, typename W, typename O>
static void rows(const W* wp, const float* xp, const float* sp, const float* bp, O* op,
                 int64_t n0, int64_t n1, int64_t K, int64_t N, const float* gp = nullptr,
                 int64_t G = 0) {
    const int64_t K32 = K - K % 32, K16 = K - K % 16;
    const __mmask16 tail = (__mmask16)((1u << (K - K16)) - 1);
    for (int64_t n = n0; n < n1; ++n) {
        const W* r = wp + n * K;
        const float* g = GS ? gp + n * (K / G) : nullptr;
        GroupWalk walk(GS ? G / 16 : 1);
        auto scaled = [&](__m512 v) {  // chunks in order, 16 weights each
            if constexpr (GS) return _mm512_mul_ps(v, _mm512_set1_ps(g[walk.next()]));
            else return v;
        };
        __m512 a[MB][2];
        for (int m = 0; m < MB; ++m) a[m][0] = a[m][1] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K32; k += 32) {
            const __m512 w0 = scaled(widen16(r + k));
            const __m512 w1 = scaled(widen16(r + k + 16));
            for (int m = 0; m < MB; ++m) {
                a[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp + m * K + k), a[m][0]);
                a[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + m * K + k + 16), a[m][1]);
            }
        }
        if (K32 < K16) {
            const __m512 w0 = scaled(widen16(r + K32));
            for (int m = 0; m < MB; ++m)
                a[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp + m * K + K32), a[m][0]);
        }
        if (K16 < K) {
            const __m512 w1 = scaled(widen16(r + K16, tail));
            for (int m = 0; m < MB; ++m)
                a[m][1] = _mm512_fmadd_ps(w1, _mm512_maskz_loadu_ps(tail, xp + m * K + K16),
                                          a[m][1]);
        }
        for (int m = 0; m < MB; ++m)
            store(op + m * N + n, _mm512_reduce_add_ps(_mm512_add_ps(a[m][0], a[m][1])), sp, bp,
                  n);
    }
}

#ifdef __AVX512BF16__
// bf16 weights x bf16 activations with AVX512-BF16's dot-product instruction: each
// `vdpbf16ps` multiplies 32 weight/activation pairs (products exact in fp32) and adds them
// into 16 fp32 lanes, so one 64-byte line of weights costs one load and one instruction. The
// widening path above spends ~8 instructions a line and, on a 2-core AMD EPYC (Zen 4, whose
// 512-bit ops take two passes), reads at ~0.65 of `sum()`'s bandwidth in a model's sweep of
// GEMVs: compute-bound, not memory-bound. Same arithmetic class as the widening path and as
// torch's native bf16 GEMM on this CPU (fp32 accumulation; denormal inputs read as zero).
template <int MB, typename O>
static void rows_dp(const uint16_t* wp, const uint16_t* xp, const float* sp, const float* bp,
                    O* op, int64_t n0, int64_t n1, int64_t K, int64_t N) {
    const int64_t K64 = K - K % 64, K32 = K - K % 32;
    const __mmask32 tail = (__mmask32)((1ull << (K - K32)) - 1);
    for (int64_t n = n0; n < n1; ++n) {
        const uint16_t* r = wp + n * K;
        __m512 a[MB][2];
        for (int m = 0; m < MB; ++m) a[m][0] = a[m][1] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K64; k += 64) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(r + k);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(r + k + 32);
            for (int m = 0; m < MB; ++m) {
                const uint16_t* x = xp + m * K + k;
                a[m][0] = _mm512_dpbf16_ps(a[m][0], w0, (__m512bh)_mm512_loadu_si512(x));
                a[m][1] = _mm512_dpbf16_ps(a[m][1], w1, (__m512bh)_mm512_loadu_si512(x + 32));
            }
        }
        if (K64 < K32) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(r + K64);
            for (int m = 0; m < MB; ++m)
                a[m][0] = _mm512_dpbf16_ps(
                    a[m][0], w0, (__m512bh)_mm512_loadu_si512(xp + m * K + K64));
        }
        if (K32 < K) {
            const __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi16(tail, r + K32);
            for (int m = 0; m < MB; ++m)
                a[m][1] = _mm512_dpbf16_ps(
                    a[m][1], w1, (__m512bh)_mm512_maskz_loadu_epi16(tail, xp + m * K + K32));
        }
        for (int m = 0; m < MB; ++m)
            store(op + m * N + n, _mm512_reduce_add_ps(_mm512_add_ps(a[m][0], a[m][1])), sp, bp,
                  n);
    }
}
#endif

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

// Activation rows per tile (the common `tiled` driver below steps by it).
constexpr int kTileM = 4;

// A 4x4 tile: 4 weight rows x 4 activation rows (fp32); r[n * 4 + m] = dot(w[n], x[m]).
// Rows past the edge are pointed at a valid row by the caller and their results dropped.
template <typename W, bool GS = false>
inline void tile(const W* const* w, const float* const* x, int64_t K, float* r,
                 const float* const* g = nullptr, int64_t G = 0) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    const int64_t K16 = K - K % 16;
    GroupWalk walk(GS ? G / 16 : 1);
    for (int64_t k = 0; k < K16; k += 16) {
        __m512 wv[4];
        const int64_t gi = GS ? walk.next() : 0;
        for (int n = 0; n < 4; ++n) {
            _mm_prefetch(reinterpret_cast<const char*>(w[n] + k) + kPrefetchBytes, _MM_HINT_T0);
            wv[n] = widen16(w[n] + k);
            if constexpr (GS) wv[n] = _mm512_mul_ps(wv[n], _mm512_set1_ps(g[n][gi]));
        }
        for (int m = 0; m < 4; ++m) {
            __m512 xv = _mm512_loadu_ps(x[m] + k);
            for (int n = 0; n < 4; ++n) acc[n * 4 + m] = _mm512_fmadd_ps(wv[n], xv, acc[n * 4 + m]);
        }
    }
    if (K16 < K) {
        const __mmask16 mk = (__mmask16)((1u << (K - K16)) - 1);
        __m512 wv[4];
        for (int n = 0; n < 4; ++n) {
            wv[n] = widen16(w[n] + K16, mk);
            if constexpr (GS) wv[n] = _mm512_mul_ps(wv[n], _mm512_set1_ps(g[n][K16 / G]));
        }
        for (int m = 0; m < 4; ++m) {
            __m512 xv = _mm512_maskz_loadu_ps(mk, x[m] + K16);
            for (int n = 0; n < 4; ++n) acc[n * 4 + m] = _mm512_fmadd_ps(wv[n], xv, acc[n * 4 + m]);
        }
    }
    _mm512_storeu_ps(r, hsum16(acc));
}

#else
// AVX2 + FMA (no AVX-512: AMD Zen 1-3, Intel before Skylake-SP and most client CPUs): the
// same kernels on 8-lane vectors. Tails shorter than a vector go through a zeroed copy (AVX2
// has no byte- or 16-bit-masked loads). 16 vector registers: the tile is 4 weight rows x 2
// activation rows (8 accumulators, 4 widened weight vectors, one activation vector).
inline __m256 widen8(const uint16_t* p) {  // bf16
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 widen8(const int8_t* p) {  // int8
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
template <typename W>
inline __m256 widen8_tail(const W* p, int64_t n) {
    W t[8] = {};
    std::memcpy(t, p, n * sizeof(W));
    return widen8(t);
}
inline __m256 load8_tail(const float* p, int64_t n) {
    float t[8] = {};
    std::memcpy(t, p, n * sizeof(float));
    return _mm256_loadu_ps(t);
}
inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Weight rows [n0, n1) x activation rows [0, MB), one weight row at a time in memory order,
// 16 weights a step into two accumulator chains per activation row (as the AVX-512 `rows`).
template <int MB, bool GS = false, typename W, typename O>
static void rows(const W* wp, const float* xp, const float* sp, const float* bp, O* op,
                 int64_t n0, int64_t n1, int64_t K, int64_t N, const float* gp = nullptr,
                 int64_t G = 0) {
    const int64_t K16 = K - K % 16, K8 = K - K % 8;
    for (int64_t n = n0; n < n1; ++n) {
        const W* r = wp + n * K;
        const float* g = GS ? gp + n * (K / G) : nullptr;
        GroupWalk walk(GS ? G / 8 : 1);
        auto scaled = [&](__m256 v) {  // chunks in order, 8 weights each
            if constexpr (GS) return _mm256_mul_ps(v, _mm256_set1_ps(g[walk.next()]));
            else return v;
        };
        __m256 a[MB][2];
        for (int m = 0; m < MB; ++m) a[m][0] = a[m][1] = _mm256_setzero_ps();
        const char* ahead = reinterpret_cast<const char*>(r) + kRowPrefetchBytes;
        for (int64_t k = 0; k < K16; k += 16) {
            _mm_prefetch(ahead + k * sizeof(W), _MM_HINT_T0);
            const __m256 w0 = scaled(widen8(r + k));
            const __m256 w1 = scaled(widen8(r + k + 8));
            for (int m = 0; m < MB; ++m) {
                a[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp + m * K + k), a[m][0]);
                a[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + m * K + k + 8), a[m][1]);
            }
        }
        if (K16 < K8) {
            const __m256 w0 = scaled(widen8(r + K16));
            for (int m = 0; m < MB; ++m)
                a[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp + m * K + K16), a[m][0]);
        }
        if (K8 < K) {
            const __m256 w1 = scaled(widen8_tail(r + K8, K - K8));
            for (int m = 0; m < MB; ++m)
                a[m][1] = _mm256_fmadd_ps(w1, load8_tail(xp + m * K + K8, K - K8), a[m][1]);
        }
        for (int m = 0; m < MB; ++m)
            store(op + m * N + n, hsum8(_mm256_add_ps(a[m][0], a[m][1])), sp, bp, n);
    }
}

constexpr int kTileM = 2;

// A 4x2 tile: 4 weight rows x 2 activation rows (fp32); r[n * 2 + m] = dot(w[n], x[m]).
template <typename W, bool GS = false>
inline void tile(const W* const* w, const float* const* x, int64_t K, float* r,
                 const float* const* g = nullptr, int64_t G = 0) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    const int64_t K8 = K - K % 8;
    GroupWalk walk(GS ? G / 8 : 1);
    auto step = [&](const __m256* wv, __m256 x0, __m256 x1) {
        for (int n = 0; n < 4; ++n) {
            acc[n * 2] = _mm256_fmadd_ps(wv[n], x0, acc[n * 2]);
            acc[n * 2 + 1] = _mm256_fmadd_ps(wv[n], x1, acc[n * 2 + 1]);
        }
    };
    for (int64_t k = 0; k < K8; k += 8) {
        __m256 wv[4];
        const int64_t gi = GS ? walk.next() : 0;
        for (int n = 0; n < 4; ++n) {
            _mm_prefetch(reinterpret_cast<const char*>(w[n] + k) + kPrefetchBytes, _MM_HINT_T0);
            wv[n] = widen8(w[n] + k);
            if constexpr (GS) wv[n] = _mm256_mul_ps(wv[n], _mm256_set1_ps(g[n][gi]));
        }
        step(wv, _mm256_loadu_ps(x[0] + k), _mm256_loadu_ps(x[1] + k));
    }
    if (K8 < K) {
        __m256 wv[4];
        for (int n = 0; n < 4; ++n) {
            wv[n] = widen8_tail(w[n] + K8, K - K8);
            if constexpr (GS) wv[n] = _mm256_mul_ps(wv[n], _mm256_set1_ps(g[n][K8 / G]));
        }
        step(wv, load8_tail(x[0] + K8, K - K8), load8_tail(x[1] + K8, K - K8));
    }
    for (int i = 0; i < 8; ++i) r[i] = hsum8(acc[i]);
}
#endif  // __AVX512F__

template <bool GS, typename W, typename O>
void tiled(const W* wp, const float* xp, const float* sp, const float* bp, O* op, int64_t M,
           int64_t K, int64_t N, const float* gp, int64_t G) {
    const int64_t NT = (N + 3) / 4;
    // Activation rows in blocks that stay in L2 while a thread's weight tiles pass over them.
    const int64_t MBLK = std::max<int64_t>(4, ((96 * 1024) / (K * 4)) / 4 * 4);  // of kTileM
    at::parallel_for(0, NT, 8, [&](int64_t t0, int64_t t1) {
        float r[4 * kTileM];
        for (int64_t mb = 0; mb < M; mb += MBLK) {
            const int64_t me = std::min(M, mb + MBLK);
            for (int64_t t = t0; t < t1; ++t) {
                const int64_t n0 = t * 4;
                const W* wr[4];
                const float* gr[4];
                for (int n = 0; n < 4; ++n) {
                    wr[n] = wp + std::min(n0 + n, N - 1) * K;
                    gr[n] = GS ? gp + std::min(n0 + n, N - 1) * (K / G) : nullptr;
                }
                for (int64_t m0 = mb; m0 < me; m0 += kTileM) {
                    const float* xr[kTileM];
                    for (int m = 0; m < kTileM; ++m) xr[m] = xp + std::min(m0 + m, M - 1) * K;
                    tile<W, GS>(wr, xr, K, r, gr, G);
                    for (int n = 0; n < 4 && n0 + n < N; ++n)
                        for (int m = 0; m < kTileM && m0 + m < M; ++m)
                            store(op + (m0 + m) * N + n0 + n, r[n * kTileM + m], sp, bp,
                                  n0 + n);
                }
            }
        }
    });
}

// Shared argument handling: x [M, K] fp32|bf16 (rows contiguous), w [N, K] bf16|int8
// contiguous, scale [N] fp32 (int8 only), bias [N] any float dtype. Returns [M, N] in x's dtype.
// A float view of a [rows, cols] (or 1-D) float32/bfloat16 tensor: its own data when it is
// contiguous fp32, else a widened copy in `buf`. Plain loops rather than aten's `to()`: a decode
// step makes a few hundred of these calls, and each aten op costs microseconds of dispatch.
inline const float* as_float(const torch::Tensor& t, int64_t rows, int64_t cols,
                             std::vector<float>& buf) {
    TORCH_CHECK(t.numel() == rows * cols, "unexpected size");
    if (t.scalar_type() == at::kFloat && t.is_contiguous()) return t.data_ptr<float>();
    const int64_t s0 = t.dim() == 2 ? t.stride(0) : 0, s1 = t.stride(t.dim() - 1);
    buf.resize(rows * cols);
    if (t.scalar_type() == at::kFloat) {
        const float* p = t.data_ptr<float>();
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < cols; ++c) buf[r * cols + c] = p[r * s0 + c * s1];
    } else if (t.scalar_type() == at::kBFloat16) {
        const at::BFloat16* p = t.data_ptr<at::BFloat16>();
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < cols; ++c)
                buf[r * cols + c] = static_cast<float>(p[r * s0 + c * s1]);
    } else {
        TORCH_CHECK(false, "expected float32 or bfloat16, got ", t.scalar_type());
    }
    return buf.data();
}

template <typename F>
torch::Tensor run(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> scale,
                  c10::optional<torch::Tensor> bias, F&& body) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shape mismatch");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
                "x must be float32 or bfloat16");
    TORCH_CHECK(w.is_contiguous(), "weight must be contiguous");
    const bool int8 = w.scalar_type() == at::kChar;
    TORCH_CHECK(int8 || w.scalar_type() == at::kBFloat16, "weight must be bfloat16 or int8");
    TORCH_CHECK(int8 == scale.has_value(), "a scale goes with (and only with) int8 weights");
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    std::vector<float> xb, sb, bb;
    const float* xp = as_float(x, M, K, xb);
    const float* sp = nullptr;
    const float* bp = nullptr;
    const float* gp = nullptr;  // group scales [N, K / G] (int8 only)
    int64_t G = 0;
    if (scale.has_value() && scale->dim() == 2) {
        TORCH_CHECK(scale->size(0) == N && scale->size(1) > 0 && K % scale->size(1) == 0 &&
                    (K / scale->size(1)) % 16 == 0 && scale->scalar_type() == at::kFloat &&
                    scale->is_contiguous(),
                    "group scales: fp32 [N, K / G], contiguous, G a multiple of 16");
        gp = scale->data_ptr<float>();
        G = K / scale->size(1);
    } else if (scale.has_value()) {
        TORCH_CHECK(scale->numel() == N, "scale must have one entry per output row");
        sp = as_float(*scale, 1, N, sb);
    }
    if (bias.has_value()) {
        TORCH_CHECK(bias->numel() == N, "bias must have one entry per output row");
        bp = as_float(*bias, 1, N, bb);
    }
    torch::Tensor out = torch::empty({M, N}, x.options());
    auto with_out = [&](auto* wp) {
        if (x.scalar_type() == at::kFloat)
            body(wp, xp, sp, bp, out.data_ptr<float>(), M, K, N, gp, G);
        else
            body(wp, xp, sp, bp, out.data_ptr<at::BFloat16>(), M, K, N, gp, G);
    };
    if (int8)
        with_out(w.data_ptr<int8_t>());
    else
        with_out(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()));
    return out;
}

#ifdef __AVX512BF16__
// bf16 x bf16 with the dot-product instruction (`rows_dp`): x stays bf16 (no widened copy).
torch::Tensor gemv_dp(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
    TORCH_CHECK(x.size(1) == w.size(1) && w.dim() == 2 && w.is_contiguous(), "shape mismatch");
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    if (!x.is_contiguous()) x = x.contiguous();
    std::vector<float> bb;
    const float* bp = nullptr;
    if (bias.has_value()) {
        TORCH_CHECK(bias->numel() == N, "bias must have one entry per output row");
        bp = as_float(*bias, 1, N, bb);
    }
    torch::Tensor out = torch::empty({M, N}, x.options());
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    auto* op = out.data_ptr<at::BFloat16>();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        switch (M) {
            case 3: rows_dp<3>(wp, xp, nullptr, bp, op, n0, n1, K, N); break;
            case 2: rows_dp<2>(wp, xp, nullptr, bp, op, n0, n1, K, N); break;
            default: rows_dp<1>(wp, xp, nullptr, bp, op, n0, n1, K, N); break;
        }
    });
    return out;
}
#endif

torch::Tensor gemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> scale,
                   c10::optional<torch::Tensor> bias) {
    TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 3,
                "gemv takes 1-3 rows; use tiled_linear");
#ifdef __AVX512BF16__
    if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16)
        return gemv_dp(x, w, bias);
#endif
    return run(x, w, scale, bias, [](auto* wp, const float* xp, const float* sp,
                                     const float* bp, auto* op, int64_t M, int64_t K,
                                     int64_t N, const float* gp, int64_t G) {
        at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
            if (gp) {
                switch (M) {
                    case 3: rows<3, true>(wp, xp, sp, bp, op, n0, n1, K, N, gp, G); break;
                    case 2: rows<2, true>(wp, xp, sp, bp, op, n0, n1, K, N, gp, G); break;
                    default: rows<1, true>(wp, xp, sp, bp, op, n0, n1, K, N, gp, G); break;
                }
                return;
            }
            switch (M) {
                case 3: rows<3>(wp, xp, sp, bp, op, n0, n1, K, N); break;
                case 2: rows<2>(wp, xp, sp, bp, op, n0, n1, K, N); break;
                default: rows<1>(wp, xp, sp, bp, op, n0, n1, K, N); break;
            }
        });
    });
}

torch::Tensor tiled_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> scale,
                           c10::optional<torch::Tensor> bias) {
    return run(x, w, scale, bias, [](auto* wp, const float* xp, const float* sp,
                                     const float* bp, auto* op, int64_t M, int64_t K,
                                     int64_t N, const float* gp, int64_t G) {
        if (gp)
            tiled<true>(wp, xp, sp, bp, op, M, K, N, gp, G);
        else
            tiled<false>(wp, xp, sp, bp, op, M, K, N, gp, G);
    });
}

}  // namespace narrow_linear
#endif
"""

BINDINGS = r"""
#ifdef TANDEM_NARROW_LINEAR
    m.def("gemv", &narrow_linear::gemv, "bf16/int8-weight GEMV, 1-3 rows (fp32 accumulate)");
    m.def("tiled_linear", &narrow_linear::tiled_linear,
          "bf16/int8-weight GEMM in 4x4 tiles (fp32 accumulate)");
#endif
"""


def reference(x, w, scale, bias):
    """fp32 math, scale and bias applied to the sum (group scales [N, K / G]: to the weights),
    one rounding to x's dtype."""
    if scale is not None and scale.dim() == 2:
        wg = w.float().view(w.shape[0], scale.shape[1], -1) * scale.float()[:, :, None]
        w, scale = wg.view(w.shape), None
    y = torch.nn.functional.linear(x.float(), w.float())
    if scale is not None:
        y = y * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def check(ops) -> bool:
    """Both ops agree with `reference` on ragged shapes, bf16 and int8 weights, fp32 and bf16
    activations: guards a miscompiled kernel before the engine trusts it."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 40, 80), (3, 9, 33), (1, 5, 7), (6, 13, 80), (17, 70, 150)):
        for wdt in (torch.bfloat16, torch.int8):
            for xdt in (torch.bfloat16, torch.float32):
                x = torch.randn(m, k, generator=g, dtype=torch.float32).to(xdt)
                if wdt == torch.int8:
                    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
                    scale = torch.rand(n, generator=g, dtype=torch.float32) / 64
                else:
                    w = torch.randn(n, k, generator=g, dtype=torch.float32).to(wdt)
                    scale = None
                b = torch.randn(n, generator=g, dtype=torch.float32).to(xdt)
                ref = reference(x, w, scale, b).float()
                ops_ = [ops.tiled_linear] + ([ops.gemv] if m <= 3 else [])
                for op in ops_:
                    got = op(x, w, scale, b)
                    if got.dtype != xdt or got.shape != ref.shape:
                        return False
                    if not torch.allclose(got.float(), ref, rtol=1e-2, atol=1e-2):
                        return False
    return _check_group_scales(ops, g)


def _check_group_scales(ops, g) -> bool:
    """int8 weights with one scale per group of G weights (G = 16, 32, 48): both ops."""
    for m, n, k, group in ((1, 40, 96, 32), (3, 9, 80, 16), (6, 13, 96, 48), (17, 70, 160, 32)):
        for xdt in (torch.bfloat16, torch.float32):
            x = torch.randn(m, k, generator=g, dtype=torch.float32).to(xdt)
            w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            scale = torch.rand(n, k // group, generator=g, dtype=torch.float32) / 64
            ref = reference(x, w, scale, None).float()
            for op in [ops.tiled_linear] + ([ops.gemv] if m <= 3 else []):
                got = op(x, w, scale, None)
                if got.shape != ref.shape or not torch.allclose(got.float(), ref, 1e-2, 1e-2):
                    return False
    return True
