"""Paged decode attention for CPUs: one query per sequence, read from the cache blocks in place.

The torch reference decode gathers every sequence's K/V through its block table into a padded
copy (and another copy to put heads first and widen to fp32) in every layer of every step: at
batch 16 x 256 tokens those copies were ~75% of a decode step on the project's 2-core box. This
kernel walks the block table instead and reads each K/V row once, where it lies:

    for each (sequence, kv head), for each block of the sequence's context:
        scores of the block's tokens for the kv head's group of query heads (GQA)
        online softmax: rescale the running max / sum / output, add p * V

Everything is accumulated in fp32 (bf16 widened by a shift, FP8 e4m3 through a 256-entry
table times the per-token scale), so the result matches the reference up to summation order.
Work is split over (sequence, kv head) pairs with `at::parallel_for`.

Built by `engine.kernels` with the other CPU kernels; `check()` compares it with `reference`
before the engine uses it. With AVX-512 (D % 16 == 0) or AVX2 + FMA (D % 8 == 0) the inner
loops use intrinsics; the portable scalar path covers every other CPU and head size.
"""

from __future__ import annotations

import torch

SOURCE = r"""
namespace paged_decode {

// Widening loads of one row of D elements into fp32.
inline void widen(const float* src, float* dst, int64_t D, float s) {
    #pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * s;
}
inline void widen(const uint16_t* src, float* dst, int64_t D, float s) {  // bf16
    #pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
        uint32_t bits = static_cast<uint32_t>(src[d]) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        dst[d] = f * s;
    }
}
struct Fp8Table {
    float v[256];
    Fp8Table() {
        for (int i = 0; i < 256; ++i) {
            c10::Float8_e4m3fn x(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits());
            v[i] = static_cast<float>(x);
        }
    }
};
inline void widen(const uint8_t* src, float* dst, int64_t D, float s) {  // fp8 e4m3
    static const Fp8Table table;
    for (int64_t d = 0; d < D; ++d) dst[d] = table.v[src[d]] * s;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// e^x on 8 lanes: exp16's polynomial, 2^n built in the exponent bits (x >= -87.3 keeps n >=
// -126; x above fp32's largest exponent gives +inf, as std::exp). Also used by fused::silu_mul.
inline __m256 exp8(__m256 x) {
    const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(88.72283935546875f), _CMP_GT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    // 2^n as two factors: n reaches 128 near x = 88.7, one past the largest exponent.
    const __m256i h = _mm256_srai_epi32(_mm256_cvtps_epi32(n), 1);
    const __m256i l = _mm256_sub_epi32(_mm256_cvtps_epi32(n), h);
    const __m256i bias = _mm256_set1_epi32(127);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23)));
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(l, bias), 23)));
    return _mm256_blendv_ps(p, _mm256_set1_ps(std::numeric_limits<float>::infinity()), over);
}
#endif

#ifdef __AVX512F__
#include <immintrin.h>
// 16 consecutive elements widened to fp32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const uint8_t* p) {
    float tmp[16];
    widen(p, tmp, 16, 1.f);
    return _mm512_loadu_ps(tmp);
}
// e^x for x <= 0 (scores minus their running max): Cephes' expf polynomial on the reduced
// argument, scaled by 2^n; within ~1 ulp of std::exp.
inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}
constexpr int64_t kLanes = 16;
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// 8 consecutive elements widened to fp32 (AVX2 + FMA: AMD Zen 1-3, most Intel client CPUs).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const uint8_t* p) {
    float tmp[8];
    widen(p, tmp, 8, 1.f);
    return _mm256_loadu_ps(tmp);
}
inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 0;  // the scalar path only
#endif

// One block of one (sequence, kv head): tokens [t0, t1) of `bs`, G query heads of D dims.
// qg [G, D] (pre-scaled), acc [G, D], m/l [G] running max and sum, sc [G, bs] scratch.
template <typename T>
inline void block_scalar(const float* qg, const T* kp, const T* vp, int64_t tok_stride,
                         const float* ksp, const float* vsp, int64_t sc_stride,
                         int64_t t0, int64_t t1, int64_t G, int64_t D, int64_t bs,
                         float* acc, float* m, float* l, float* sc, float* row) {
    for (int64_t t = t0; t < t1; ++t) {
        widen(kp + t * tok_stride, row, D, ksp ? ksp[t * sc_stride] : 1.f);
        for (int64_t g = 0; g < G; ++g) {
            const float* qq = qg + g * D;
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) s += qq[d] * row[d];
            sc[g * bs + t] = s;
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        float mx = m[g];
        for (int64_t t = t0; t < t1; ++t) mx = std::max(mx, sc[g * bs + t]);
        const float alpha = std::exp(m[g] - mx);  // exp(-inf) = 0 on the first block
        l[g] *= alpha;
        for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= alpha;
        for (int64_t t = t0; t < t1; ++t) {
            const float p = std::exp(sc[g * bs + t] - mx);
            sc[g * bs + t] = p;
            l[g] += p;
        }
        m[g] = mx;
    }
    for (int64_t t = t0; t < t1; ++t) {
        widen(vp + t * tok_stride, row, D, vsp ? vsp[t * sc_stride] : 1.f);
        for (int64_t g = 0; g < G; ++g) {
            const float p = sc[g * bs + t];
            for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * row[d];
        }
    }
}

#ifdef __AVX512F__
// The same with AVX-512, for D % 16 == 0: dot products 16 dims at a time, exp 16 tokens at
// a time. Scales (FP8) multiply the score / the probability instead of every element.
template <typename T>
inline void block_vec(const float* qg, const T* kp, const T* vp, int64_t tok_stride,
                         const float* ksp, const float* vsp, int64_t sc_stride,
                         int64_t t0, int64_t t1, int64_t G, int64_t D, int64_t bs,
                         float* acc, float* m, float* l, float* sc) {
    for (int64_t t = t0; t < t1; ++t) {
        const T* kr = kp + t * tok_stride;
        const float ks = ksp ? ksp[t * sc_stride] : 1.f;
        for (int64_t g = 0; g < G; ++g) {
            const float* qq = qg + g * D;
            __m512 a = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qq + d), load16(kr + d), a);
            sc[g * bs + t] = _mm512_reduce_add_ps(a) * ks;
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        float* s = sc + g * bs;
        float mx = m[g];
        for (int64_t t = t0; t < t1; ++t) mx = std::max(mx, s[t]);
        const float alpha = std::exp(m[g] - mx);
        float sum = 0.f;
        for (int64_t t = t0; t < t1; t += 16) {
            const __mmask16 k = (t1 - t) >= 16 ? 0xFFFF : (__mmask16)((1u << (t1 - t)) - 1);
            __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), _mm512_set1_ps(mx)));
            p = _mm512_maskz_mov_ps(k, p);
            sum += _mm512_reduce_add_ps(p);
            _mm512_mask_storeu_ps(s + t, k, p);
        }
        l[g] = l[g] * alpha + sum;
        m[g] = mx;
        if (alpha != 1.f) {
            const __m512 av = _mm512_set1_ps(alpha);
            float* a = acc + g * D;
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), av));
        }
    }
    for (int64_t d = 0; d < D; d += 16) {
        // Accumulators of up to 8 query heads stay in registers across the block's tokens.
        for (int64_t g0 = 0; g0 < G; g0 += 8) {
            const int64_t gn = std::min<int64_t>(8, G - g0);
            __m512 a[8];
            for (int64_t g = 0; g < gn; ++g) a[g] = _mm512_loadu_ps(acc + (g0 + g) * D + d);
            for (int64_t t = t0; t < t1; ++t) {
                __m512 v = load16(vp + t * tok_stride + d);
                if (vsp) v = _mm512_mul_ps(v, _mm512_set1_ps(vsp[t * sc_stride]));
                for (int64_t g = 0; g < gn; ++g)
                    a[g] = _mm512_fmadd_ps(_mm512_set1_ps(sc[(g0 + g) * bs + t]), v, a[g]);
            }
            for (int64_t g = 0; g < gn; ++g) _mm512_storeu_ps(acc + (g0 + g) * D + d, a[g]);
        }
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
// The AVX2 twin of the AVX-512 block, for D % 8 == 0. Without it such CPUs took the scalar
// path, whose dot products are one dependent add per element (no reassociation without
// -ffast-math): on a 2-core Zen 2 that was ~9% of a SmolLM2 batch-1 decode step at a few
// hundred tokens of context. Probabilities go through exp8, exp16's polynomial on 8 lanes.
template <typename T>
inline void block_vec(const float* qg, const T* kp, const T* vp, int64_t tok_stride,
                      const float* ksp, const float* vsp, int64_t sc_stride,
                      int64_t t0, int64_t t1, int64_t G, int64_t D, int64_t bs,
                      float* acc, float* m, float* l, float* sc) {
    for (int64_t t = t0; t < t1; ++t) {
        const T* kr = kp + t * tok_stride;
        const float ks = ksp ? ksp[t * sc_stride] : 1.f;
        for (int64_t g = 0; g < G; ++g) {
            const float* qq = qg + g * D;
            __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
            int64_t d = 0;
            for (; d + 16 <= D; d += 16) {
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qq + d), load8(kr + d), a);
                b = _mm256_fmadd_ps(_mm256_loadu_ps(qq + d + 8), load8(kr + d + 8), b);
            }
            if (d < D) a = _mm256_fmadd_ps(_mm256_loadu_ps(qq + d), load8(kr + d), a);
            sc[g * bs + t] = hsum8(_mm256_add_ps(a, b)) * ks;
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        float* s = sc + g * bs;
        float mx = m[g];
        for (int64_t t = t0; t < t1; ++t) mx = std::max(mx, s[t]);
        const float alpha = std::exp(m[g] - mx);
        const __m256 mv = _mm256_set1_ps(mx);
        __m256 sv = _mm256_setzero_ps();
        int64_t t = t0;
        for (; t + 8 <= t1; t += 8) {
            const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
            sv = _mm256_add_ps(sv, p);
            _mm256_storeu_ps(s + t, p);
        }
        float sum = hsum8(sv);
        if (t < t1) {  // the tail through a zero-padded block of 8
            alignas(32) float tail[8] = {0.f};
            const int64_t n = t1 - t;
            for (int64_t i = 0; i < n; ++i) tail[i] = s[t + i];
            _mm256_store_ps(tail, exp8(_mm256_sub_ps(_mm256_load_ps(tail), mv)));
            for (int64_t i = 0; i < n; ++i) sum += (s[t + i] = tail[i]);
        }
        l[g] = l[g] * alpha + sum;
        m[g] = mx;
        if (alpha != 1.f) {
            const __m256 av = _mm256_set1_ps(alpha);
            float* a = acc + g * D;
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(a + d, _mm256_mul_ps(_mm256_loadu_ps(a + d), av));
        }
    }
    for (int64_t d = 0; d < D; d += 8) {
        for (int64_t g0 = 0; g0 < G; g0 += 8) {  // up to 8 query heads' accumulators in registers
            const int64_t gn = std::min<int64_t>(8, G - g0);
            __m256 a[8];
            for (int64_t g = 0; g < gn; ++g) a[g] = _mm256_loadu_ps(acc + (g0 + g) * D + d);
            for (int64_t t = t0; t < t1; ++t) {
                __m256 v = load8(vp + t * tok_stride + d);
                if (vsp) v = _mm256_mul_ps(v, _mm256_set1_ps(vsp[t * sc_stride]));
                for (int64_t g = 0; g < gn; ++g)
                    a[g] = _mm256_fmadd_ps(_mm256_set1_ps(sc[(g0 + g) * bs + t]), v, a[g]);
            }
            for (int64_t g = 0; g < gn; ++g) _mm256_storeu_ps(acc + (g0 + g) * D + d, a[g]);
        }
    }
}
#endif

template <typename T, typename Q>
void decode(const Q* q, int64_t q_s0, int64_t q_s1,        // q [b, H, D] fp32 or bf16
            const T* kc, const T* vc, int64_t c_s0, int64_t c_s1, int64_t c_s2,  // [N, bs, kvH, D]
            const float* ks, const float* vs, int64_t s_s0, int64_t s_s1, int64_t s_s2,
            const int64_t* tables, int64_t t_s0, const int64_t* lens,
            Q* out, int64_t b, int64_t H, int64_t kvH, int64_t D, int64_t bs,
            float scale, int64_t window) {
    const int64_t G = H / kvH;
    const bool vec = kLanes > 0 && D % kLanes == 0;
    // Work items are (sequence, range of kv heads). A token's K/V row holds every kv head
    // side by side, so one item walks all heads of a block while it is in cache (a head at a
    // time would pull whole rows through the cache for a slice of each); sequences are split
    // by heads only when there are too few of them to keep every thread busy.
    const int64_t threads = at::get_num_threads();
    // grows through kvH's divisors (3 kv heads: 1 -> 3) until there are 2 items a thread
    // (not further: items taking a subgroup of a kv head's query heads each widen its K/V
    // rows again, most of an item's work; at batch 1 on 3 kv heads, 9 such items on 2 threads
    // ran no faster than 1 thread).
    int64_t split = 1;
    for (int64_t s = 2; s <= kvH && b * split < 2 * threads; ++s)
        if (kvH % s == 0) split = s;
    const int64_t hn = kvH / split;
    at::parallel_for(0, b * split, 1, [&](int64_t w0, int64_t w1) {
        std::vector<float> qg(hn * G * D), acc(hn * G * D), m(hn * G), l(hn * G),
            sc(G * bs + 16), row(D);
        for (int64_t w = w0; w < w1; ++w) {
            const int64_t i = w / split, h0 = (w % split) * hn;
            const int64_t ctx = lens[i];
            const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
            for (int64_t x = 0; x < hn * G; ++x) {
                const Q* qr = q + i * q_s0 + (h0 * G + x) * q_s1;
                for (int64_t d = 0; d < D; ++d) qg[x * D + d] = static_cast<float>(qr[d]) * scale;
                m[x] = -std::numeric_limits<float>::infinity();
                l[x] = 0.f;
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            for (int64_t j = first / bs; j * bs < ctx; ++j) {
                const int64_t blk = tables[i * t_s0 + j];
                const int64_t t0 = std::max<int64_t>(first - j * bs, 0);
                const int64_t t1 = std::min<int64_t>(bs, ctx - j * bs);
                for (int64_t hh = 0; hh < hn; ++hh) {
                    const int64_t h = h0 + hh;
                    const T* kp = kc + blk * c_s0 + h * c_s2;
                    const T* vp = vc + blk * c_s0 + h * c_s2;
                    const float* ksp = ks ? ks + blk * s_s0 + h * s_s2 : nullptr;
                    const float* vsp = vs ? vs + blk * s_s0 + h * s_s2 : nullptr;
                    float* qh = qg.data() + hh * G * D;
                    float* ah = acc.data() + hh * G * D;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
                    if (vec) {
                        block_vec(qh, kp, vp, c_s1, ksp, vsp, s_s1, t0, t1, G, D, bs,
                                     ah, m.data() + hh * G, l.data() + hh * G, sc.data());
                        continue;
                    }
#endif
                    block_scalar(qh, kp, vp, c_s1, ksp, vsp, s_s1, t0, t1, G, D, bs,
                                 ah, m.data() + hh * G, l.data() + hh * G, sc.data(),
                                 row.data());
                }
            }
            for (int64_t x = 0; x < hn * G; ++x) {
                Q* o = out + (i * H + h0 * G + x) * D;
                const float inv = 1.f / l[x];
                for (int64_t d = 0; d < D; ++d) o[d] = static_cast<Q>(acc[x * D + d] * inv);
            }
        }
    });
}

// q [b, H, D] float32 or bfloat16 (last dim contiguous; the output has q's dtype);
// k_cache/v_cache [N, bs, kvH, D] layer views of the paged cache (float32, bfloat16 or
// float8_e4m3fn; last dim contiguous); k_scale/v_scale [N, bs, kvH] float32 for FP8;
// tables [b, >= blocks] int64; lens [b] int64 (keys per sequence, the new token's included).
// window > 0 limits each query to its last `window` keys.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           c10::optional<torch::Tensor> k_scale,
                           c10::optional<torch::Tensor> v_scale, torch::Tensor tables,
                           torch::Tensor lens, double scale, int64_t window) {
    TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 &&
                (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
                "q: [b, H, D] float32 or bfloat16, last dim contiguous");
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1, "k_cache");
    TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(),
                "v_cache must match k_cache");
    TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.stride(1) == 1,
                "tables");
    TORCH_CHECK(lens.scalar_type() == at::kLong && lens.is_contiguous(), "lens");
    const int64_t b = q.size(0), H = q.size(1), D = q.size(2);
    const int64_t bs = k_cache.size(1), kvH = k_cache.size(2);
    TORCH_CHECK(k_cache.size(3) == D && H % kvH == 0, "head shapes");
    TORCH_CHECK(tables.size(0) == b && lens.size(0) == b, "batch sizes");
    const int64_t* lp = lens.data_ptr<int64_t>();
    for (int64_t i = 0; i < b; ++i)
        TORCH_CHECK(lp[i] >= 1 && lp[i] <= tables.size(1) * bs, "context length out of range");
    const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
    TORCH_CHECK(fp8 == (k_scale.has_value() && v_scale.has_value()), "scales go with fp8");
    const float* ksp = nullptr;
    const float* vsp = nullptr;
    int64_t s0 = 0, s1 = 0, s2 = 0;
    if (fp8) {
        TORCH_CHECK(k_scale->scalar_type() == at::kFloat && k_scale->dim() == 3, "k_scale");
        TORCH_CHECK(v_scale->strides() == k_scale->strides(), "v_scale must match k_scale");
        ksp = k_scale->data_ptr<float>();
        vsp = v_scale->data_ptr<float>();
        s0 = k_scale->stride(0); s1 = k_scale->stride(1); s2 = k_scale->stride(2);
    }
    torch::Tensor out = torch::empty({b, H, D}, q.options());
    const int64_t c0 = k_cache.stride(0), c1 = k_cache.stride(1), c2 = k_cache.stride(2);
    const float sc = static_cast<float>(scale);
    auto run = [&](auto* kp, auto* vp) {
        if (q.scalar_type() == at::kFloat)
            decode(q.data_ptr<float>(), q.stride(0), q.stride(1), kp, vp, c0, c1, c2, ksp, vsp,
                   s0, s1, s2, tables.data_ptr<int64_t>(), tables.stride(0), lp,
                   out.data_ptr<float>(), b, H, kvH, D, bs, sc, window);
        else
            decode(q.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1), kp, vp, c0, c1, c2,
                   ksp, vsp, s0, s1, s2, tables.data_ptr<int64_t>(), tables.stride(0), lp,
                   out.data_ptr<at::BFloat16>(), b, H, kvH, D, bs, sc, window);
    };
    switch (k_cache.scalar_type()) {
        case at::kFloat:
            run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
            break;
        case at::kBFloat16:
            run(reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()));
            break;
        case at::kFloat8_e4m3fn:
            run(reinterpret_cast<const uint8_t*>(k_cache.data_ptr<c10::Float8_e4m3fn>()),
                reinterpret_cast<const uint8_t*>(v_cache.data_ptr<c10::Float8_e4m3fn>()));
            break;
        default:
            TORCH_CHECK(false, "unsupported cache dtype ", k_cache.scalar_type());
    }
    return out;
}

// Store the step's new K/V rows: k/v [t, kvH, D] (last dim contiguous) at (blocks[i],
// offsets[i]) of the layer views k_cache/v_cache [N, bs, kvH, D], byte for byte (the caller
// passes rows already in the cache dtype; FP8 caches quantize in torch). One call instead of
// two aten index_put per layer per step.
void cache_write(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor blocks,
                 torch::Tensor offsets, torch::Tensor k, torch::Tensor v) {
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1 &&
                v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(),
                "k_cache/v_cache: matching [N, bs, kvH, D] views");
    TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
                "k/v: [t, kvH, D], last dim contiguous");
    TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() &&
                v.scalar_type() == k_cache.scalar_type(), "k/v must have the cache dtype");
    TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), "head shapes");
    TORCH_CHECK(blocks.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong &&
                blocks.is_contiguous() && offsets.is_contiguous() &&
                blocks.numel() == k.size(0) && offsets.numel() == k.size(0), "slots");
    const int64_t t = k.size(0), kvH = k.size(1), N = k_cache.size(0), bs = k_cache.size(1);
    const int64_t es = k.element_size(), row = k.size(2) * es;
    const int64_t* bp = blocks.data_ptr<int64_t>();
    const int64_t* op = offsets.data_ptr<int64_t>();
    for (int64_t i = 0; i < t; ++i)
        TORCH_CHECK(bp[i] >= 0 && bp[i] < N && op[i] >= 0 && op[i] < bs, "slot out of range");
    char* kc = static_cast<char*>(k_cache.data_ptr());
    char* vc = static_cast<char*>(v_cache.data_ptr());
    const char* kp = static_cast<const char*>(k.data_ptr());
    const char* vp = static_cast<const char*>(v.data_ptr());
    const int64_t c0 = k_cache.stride(0) * es, c1 = k_cache.stride(1) * es,
                  c2 = k_cache.stride(2) * es;
    for (int64_t i = 0; i < t; ++i) {
        const int64_t dst = bp[i] * c0 + op[i] * c1;
        for (int64_t h = 0; h < kvH; ++h) {
            std::memcpy(kc + dst + h * c2, kp + (i * k.stride(0) + h * k.stride(1)) * es, row);
            std::memcpy(vc + dst + h * c2, vp + (i * v.stride(0) + h * v.stride(1)) * es, row);
        }
    }
}

}  // namespace paged_decode
"""

BINDINGS = r"""
    m.def("paged_decode", &paged_decode::paged_decode, "paged decode attention, block-major cache");
    m.def("cache_write", &paged_decode::cache_write, "store new K/V rows at their slots");
"""


def reference(q, k_cache, v_cache, k_scale, v_scale, tables, lens, scale, window):
    """The same computation in plain torch, one sequence at a time (for checks and tests)."""
    b, H, D = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(b, H, D, dtype=torch.float32)
    for i in range(b):
        n = int(lens[i])
        nb = -(-n // bs)
        blocks = tables[i, :nb]
        k = k_cache[blocks].float()
        v = v_cache[blocks].float()
        if k_scale is not None:
            k = k * k_scale[blocks].unsqueeze(-1)
            v = v * v_scale[blocks].unsqueeze(-1)
        k = k.reshape(-1, kvh, D)[:n]
        v = v.reshape(-1, kvh, D)[:n]
        if window > 0:
            k, v = k[max(0, n - window) :], v[max(0, n - window) :]
        k = k.repeat_interleave(H // kvh, dim=1).transpose(0, 1)  # [H, keys, D]
        v = v.repeat_interleave(H // kvh, dim=1).transpose(0, 1)
        s = torch.einsum("hd,hkd->hk", q[i].float(), k) * scale
        out[i] = torch.einsum("hk,hkd->hd", s.softmax(-1), v)
    return out


def check_cache_write(ops) -> bool:
    """cache_write stores exactly what KVCache.write_at stores (bf16 and fp32)."""
    from engine.kv_cache import KVCache, KVCacheSpec

    g = torch.Generator().manual_seed(1)
    for dt in (torch.float32, torch.bfloat16):
        spec = KVCacheSpec(
            model="check", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=dt
        )
        a, b = KVCache(spec, 5), KVCache(spec, 5)
        qkv = torch.randn(6, 6, 8, generator=g, dtype=torch.float32).to(dt)
        k, v = qkv[:, 2:4], qkv[:, 4:]  # strided views, as the model passes them
        slots = torch.tensor([3, 9, 10, 17, 0, 6])
        blocks, offsets = slots // 4, slots % 4
        a.write_at(1, blocks, offsets, k, v)
        kc, vc, _, _ = b.layer_views(1)
        ops.cache_write(kc, vc, blocks, offsets, k, v)
        if not torch.equal(a.data, b.data):
            return False
    return True


def check(ops) -> bool:
    """The op agrees with `reference` on a small GQA case with ragged lengths, fp32 and bf16."""
    g = torch.Generator().manual_seed(0)
    n_blocks, bs, kvh, H, D = 9, 4, 2, 6, 24
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 8, 6]], dtype=torch.int64)
    lens = torch.tensor([5, 16], dtype=torch.int64)
    q = torch.randn(2, H, D, generator=g, dtype=torch.float32)
    for dt in (torch.float32, torch.bfloat16):
        cache = torch.randn(n_blocks, 2, bs, kvh, D, generator=g, dtype=torch.float32).to(dt)
        kc, vc = cache[:, 0], cache[:, 1]
        for window in (0, 7):
            got = ops.paged_decode(q, kc, vc, None, None, tables, lens, 0.3, window)
            ref = reference(q, kc, vc, None, None, tables, lens, 0.3, window)
            if not torch.allclose(got, ref, rtol=1e-4, atol=1e-5):
                return False
    return check_cache_write(ops)
