"""Fused elementwise ops for the CPU decoder layer: fewer, bigger calls per step.

A decode step of a small model is dominated by per-op overhead once the GEMMs stream at the
memory bound: each layer made ~20 small aten calls (casts, the RMSNorm's pieces, RoPE's
slices/negation/concatenation, SiLU and the gate product), each costing microseconds of
dispatch. These three ops replace them with one call each and keep Hugging Face's rounding
points exactly (every intermediate that HF rounds to the activation dtype is rounded here
too; fp32 contraction into FMAs is disabled for this file) so greedy parity is preserved:

- `add_rms_norm(x, residual, weight, eps) -> (out, new_residual)`: new_residual = x +
  residual (rounded to the dtype, as HF's residual add), out = weight * dtype(fp32(r) *
  rsqrt(mean(fp32(r)^2) + eps)). With `residual` None it only normalizes (residual = x).
- `rope_(qkv, cos, sin, rot_heads)`: in place on the first `rot_heads` heads of [tokens,
  heads, head_dim]: x * cos + rotate_half(x) * sin with cos/sin ([tokens, head_dim], fp32
  tables) first rounded to the dtype like HF's `cos.to(x.dtype)`.
- `silu_mul(gate_up) -> out`: silu(gate) * up over the two halves of the last dim.

Types: float32 and bfloat16 (anything else raises; the model keeps its torch path then). With
AVX2 + FMA each op runs on 8 lanes (the same roundings; SiLU's exponential is
paged_decode::exp8, so fused comes after paged_decode in the extension's source): at batch 1
their scalar loops were serial time in every layer of a decode step that no second thread
shared (on SmolLM2's shapes on a 2-core Zen 2, `benchmarks/cpu_ops_ab.py`: silu_mul 16-18 us a
call before, 9 after; rope_ 5-6 us before, 2.5-3 after).
"""

from __future__ import annotations

import torch

SOURCE = r"""
namespace fused {

template <typename T> inline float rnd(float v) { return static_cast<float>(static_cast<T>(v)); }
template <> inline float rnd<float>(float v) { return v; }

#if defined(__AVX2__) && defined(__FMA__)
// 8 lanes of fp32 or bf16 (widened by a shift) and back; bf16 stores and `rnd8` round to
// nearest even as c10::BFloat16 does (a NaN becomes 0x7FC0), so lanes equal the scalar loop's.
inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 ld8(const at::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256i bf16_bits(__m256 v) {  // the bf16 of each lane, in the upper 16 bits
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
}
template <typename T> inline __m256 rnd8(__m256 v) { return _mm256_castsi256_ps(bf16_bits(v)); }
template <> inline __m256 rnd8<float>(__m256 v) { return v; }
inline void st8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void st8(at::BFloat16* p, __m256 v) {
    const __m256i b = _mm256_srli_epi32(bf16_bits(v), 16);  // 8 x 16 bits, in two lanes
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b),
                                            _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
// silu(g) * u on whole blocks of 8 (paged_decode::exp8, the scalar loop's formula and
// rounding points); returns how many elements it did.
template <typename T>
inline int64_t silu_mul_vec(const T* g, const T* u, T* o, int64_t I) {
    const __m256 one = _mm256_set1_ps(1.f), neg = _mm256_set1_ps(-0.f);
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
        const __m256 gv = ld8(g + i);
        const __m256 e = paged_decode::exp8(_mm256_xor_ps(gv, neg));
        const __m256 act = rnd8<T>(_mm256_div_ps(gv, _mm256_add_ps(one, e)));
        st8(o + i, _mm256_mul_ps(act, ld8(u + i)));
    }
    return i;
}

// One row of add_rms_norm_impl on whole blocks of 8 (the same roundings); the sum of squares
// in 4 double lanes instead of one (each square is exact in double, so the order moves the
// float mean by an ulp only in rare near-ties). Returns how many elements it did.
template <typename T>
inline int64_t add_rms_row_vec(const T* xr, const T* rr, T* nr, float* s, int64_t H,
                               double& ss) {
    __m256d acc = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= H; i += 8) {
        __m256 v = ld8(xr + i);
        if (rr) {
            v = rnd8<T>(_mm256_add_ps(v, ld8(rr + i)));
            st8(nr + i, v);
        }
        _mm256_storeu_ps(s + i, v);
        const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
        const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        acc = _mm256_fmadd_pd(hi, hi, _mm256_fmadd_pd(lo, lo, acc));
    }
    alignas(32) double part[4];
    _mm256_store_pd(part, acc);
    ss = (part[0] + part[1]) + (part[2] + part[3]);
    return i;
}
template <typename T>
inline int64_t rms_scale_row_vec(const float* s, const T* w, T* o, float inv, int64_t H) {
    const __m256 iv = _mm256_set1_ps(inv);
    int64_t i = 0;
    for (; i + 8 <= H; i += 8)
        st8(o + i, _mm256_mul_ps(ld8(w + i), rnd8<T>(_mm256_mul_ps(ld8(s + i), iv))));
    return i;
}
#endif

template <typename T>
void add_rms_norm_impl(const T* x, const T* res, const T* w, T* out, T* new_res, int64_t rows,
                       int64_t H, int64_t x_s, int64_t r_s, float eps) {
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
        std::vector<float> s(H);
        for (int64_t r = r0; r < r1; ++r) {
            const T* xr = x + r * x_s;
            double ss = 0.0;  // a double accumulator: closer to the exact mean than any order
            int64_t i0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
            i0 = add_rms_row_vec(xr, res ? res + r * r_s : nullptr,
                                 res ? new_res + r * H : nullptr, s.data(), H, ss);
#endif
            for (int64_t i = i0; i < H; ++i) {
                float v = static_cast<float>(xr[i]);
                if (res) {
                    v = rnd<T>(v + static_cast<float>(res[r * r_s + i]));
                    new_res[r * H + i] = static_cast<T>(v);
                }
                s[i] = v;
                ss += static_cast<double>(v) * v;
            }
            const float var = static_cast<float>(ss / H);
            const float inv = 1.f / std::sqrt(var + eps);
            i0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
            i0 = rms_scale_row_vec(s.data(), w, out + r * H, inv, H);
#endif
            for (int64_t i = i0; i < H; ++i)
                out[r * H + i] = static_cast<T>(static_cast<float>(w[i]) * rnd<T>(s[i] * inv));
        }
    });
}

std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                        torch::Tensor weight, double eps) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x: [rows, hidden], rows contiguous");
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                weight.scalar_type() == x.scalar_type(), "weight");
    const int64_t rows = x.size(0), H = x.size(1);
    torch::Tensor out = torch::empty({rows, H}, x.options());
    torch::Tensor new_res;
    if (residual.has_value()) {
        TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 &&
                    residual->scalar_type() == x.scalar_type(), "residual");
        new_res = torch::empty({rows, H}, x.options());
    }
    AT_DISPATCH_SWITCH(x.scalar_type(), "add_rms_norm",
        AT_DISPATCH_CASE(at::kFloat, [&] {
            add_rms_norm_impl<float>(
                x.data_ptr<float>(), residual ? residual->data_ptr<float>() : nullptr,
                weight.data_ptr<float>(), out.data_ptr<float>(),
                residual ? new_res.data_ptr<float>() : nullptr, rows, H, x.stride(0),
                residual ? residual->stride(0) : 0, static_cast<float>(eps));
        })
        AT_DISPATCH_CASE(at::kBFloat16, [&] {
            using B = at::BFloat16;
            add_rms_norm_impl<B>(
                x.data_ptr<B>(), residual ? residual->data_ptr<B>() : nullptr,
                weight.data_ptr<B>(), out.data_ptr<B>(),
                residual ? new_res.data_ptr<B>() : nullptr, rows, H, x.stride(0),
                residual ? residual->stride(0) : 0, static_cast<float>(eps));
        }));
    if (!residual.has_value()) return {out, x};
    return {out, new_res};
}

#if defined(__AVX2__) && defined(__FMA__)
// One head of rope_impl on whole blocks of 8 pairs, the same products, sums and roundings.
template <typename T>
inline int64_t rope_head_vec(T* p, const float* c, const float* s, int64_t half) {
    const __m256 neg = _mm256_set1_ps(-0.f);
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m256 x1 = ld8(p + i), x2 = ld8(p + i + half);
        const __m256 a = rnd8<T>(_mm256_add_ps(
            rnd8<T>(_mm256_mul_ps(x1, ld8(c + i))),
            rnd8<T>(_mm256_mul_ps(_mm256_xor_ps(x2, neg), ld8(s + i)))));
        const __m256 b = rnd8<T>(_mm256_add_ps(
            rnd8<T>(_mm256_mul_ps(x2, ld8(c + i + half))),
            rnd8<T>(_mm256_mul_ps(x1, ld8(s + i + half)))));
        st8(p + i, a);
        st8(p + i + half, b);
    }
    return i;
}
#endif

template <typename T>
void rope_impl(T* x, const float* cos, const float* sin, int64_t tokens, int64_t heads,
               int64_t D, int64_t x_s0, int64_t x_s1, int64_t c_s) {
    const int64_t half = D / 2;
    at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
        std::vector<float> c(D), s(D);
        for (int64_t t = t0; t < t1; ++t) {
            for (int64_t i = 0; i < D; ++i) {
                c[i] = rnd<T>(cos[t * c_s + i]);
                s[i] = rnd<T>(sin[t * c_s + i]);
            }
            for (int64_t h = 0; h < heads; ++h) {
                T* p = x + t * x_s0 + h * x_s1;
                int64_t i0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
                i0 = rope_head_vec(p, c.data(), s.data(), half);
#endif
                for (int64_t i = i0; i < half; ++i) {
                    const float x1 = static_cast<float>(p[i]);
                    const float x2 = static_cast<float>(p[i + half]);
                    // HF: q * cos + rotate_half(q) * sin, rotate_half(q) = cat(-x2, x1);
                    // each product and the sum rounded to the dtype.
                    const float a = rnd<T>(rnd<T>(x1 * c[i]) + rnd<T>(-x2 * s[i]));
                    const float b = rnd<T>(rnd<T>(x2 * c[i + half]) + rnd<T>(x1 * s[i + half]));
                    p[i] = static_cast<T>(a);
                    p[i + half] = static_cast<T>(b);
                }
            }
        }
    });
}

void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t rot_heads) {
    TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x: [t, heads, D]");
    TORCH_CHECK(rot_heads >= 0 && rot_heads <= x.size(1), "rot_heads");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.strides() == sin.strides() &&
                cos.size(0) == x.size(0) && cos.size(1) == x.size(2) && cos.stride(1) == 1,
                "cos/sin: [t, D] fp32");
    AT_DISPATCH_SWITCH(x.scalar_type(), "rope_",
        AT_DISPATCH_CASE(at::kFloat, [&] {
            rope_impl<float>(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                             x.size(0), rot_heads, x.size(2), x.stride(0), x.stride(1),
                             cos.stride(0));
        })
        AT_DISPATCH_CASE(at::kBFloat16, [&] {
            using B = at::BFloat16;
            rope_impl<B>(x.data_ptr<B>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                         x.size(0), rot_heads, x.size(2), x.stride(0), x.stride(1),
                         cos.stride(0));
        }));
}

template <typename T>
void silu_mul_impl(const T* gu, T* out, int64_t rows, int64_t I, int64_t g_s) {
    at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const T* g = gu + r * g_s;
            const T* u = g + I;
            T* o = out + r * I;
            int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
            i = silu_mul_vec(g, u, o, I);
#endif
            for (; i < I; ++i) {
                const float gv = static_cast<float>(g[i]);
                const float act = rnd<T>(gv / (1.f + std::exp(-gv)));
                o[i] = static_cast<T>(act * static_cast<float>(u[i]));
            }
        }
    });
}

torch::Tensor silu_mul(torch::Tensor gu) {
    TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && gu.size(1) % 2 == 0, "gate_up: [t, 2I]");
    const int64_t rows = gu.size(0), I = gu.size(1) / 2;
    torch::Tensor out = torch::empty({rows, I}, gu.options());
    AT_DISPATCH_SWITCH(gu.scalar_type(), "silu_mul",
        AT_DISPATCH_CASE(at::kFloat, [&] {
            silu_mul_impl<float>(gu.data_ptr<float>(), out.data_ptr<float>(), rows, I,
                                 gu.stride(0));
        })
        AT_DISPATCH_CASE(at::kBFloat16, [&] {
            using B = at::BFloat16;
            silu_mul_impl<B>(gu.data_ptr<B>(), out.data_ptr<B>(), rows, I, gu.stride(0));
        }));
    return out;
}

}  // namespace fused
"""

BINDINGS = r"""
    m.def("add_rms_norm", &fused::add_rms_norm, "residual add + RMSNorm (HF rounding)");
    m.def("rope_", &fused::rope_, "in-place rotary embedding on the leading heads");
    m.def("silu_mul", &fused::silu_mul, "silu(gate) * up");
"""


def reference_add_rms_norm(x, residual, weight, eps):
    """Hugging Face's ops: residual add in the dtype, then LlamaRMSNorm."""
    r = x if residual is None else x + residual
    v = r.float()
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return weight * v.to(r.dtype), r


def reference_rope(x, cos, sin, rot_heads):
    from engine.models.rope import rotate_half

    out = x.clone()
    c = cos.to(x.dtype).unsqueeze(1)
    s = sin.to(x.dtype).unsqueeze(1)
    y = x[:, :rot_heads]
    out[:, :rot_heads] = y * c + rotate_half(y) * s
    return out


def reference_silu_mul(gu):
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def check(ops) -> bool:
    """Each op within rounding of its reference, fp32 and bf16, on ragged shapes."""
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        tol = {"rtol": 1e-5, "atol": 1e-5} if dt == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
        x = torch.randn(5, 48, generator=g, dtype=torch.float32).to(dt)
        res = torch.randn(5, 48, generator=g, dtype=torch.float32).to(dt)
        w = torch.randn(48, generator=g, dtype=torch.float32).to(dt)
        out, new_res = ops.add_rms_norm(x, res, w, 1e-6)
        ref_out, ref_res = reference_add_rms_norm(x, res, w, 1e-6)
        if not (
            torch.allclose(out.float(), ref_out.float(), **tol) and torch.equal(new_res, ref_res)
        ):
            return False
        qkv = torch.randn(3, 5, 8, generator=g, dtype=torch.float32).to(dt)
        cos = torch.randn(3, 8, generator=g, dtype=torch.float32)
        sin = torch.randn(3, 8, generator=g, dtype=torch.float32)
        ref = reference_rope(qkv, cos, sin, 3)
        ops.rope_(qkv, cos, sin, 3)
        if not torch.allclose(qkv.float(), ref.float(), **tol):
            return False
        gu = torch.randn(4, 2 * 40, generator=g, dtype=torch.float32).to(dt)
        if not torch.allclose(ops.silu_mul(gu).float(), reference_silu_mul(gu).float(), **tol):
            return False
    return True
