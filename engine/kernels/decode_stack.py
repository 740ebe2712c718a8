"""A decode step through every decoder layer in one C++ call, for 1-3 decode rows on CPU.

At batch 1 a step of a small model is the weights' bytes plus per-op overhead: the Python
layer loop (module calls, the attention backend, ~200 small calls a token for a 30-layer
model) cost ~2 ms of a ~14 ms SmolLM2 step on the project's 2-core AMD EPYC. `DecodeStack`
holds the layers' tensors and runs, per layer, exactly the calls the Python path makes for
such a step — `add_rms_norm`, `gemv` (qkv), `rope_`, `cache_write`, `paged_decode`, `gemv`
(o), `add_rms_norm`, `gemv` (gate_up), `silu_mul`, `gemv` (down) — then the final norm, with
the same kernels on the same inputs, so its output is bit-identical to the Python path's.
`engine.models.decode_stack` decides when a model and a step qualify.

The last constructor argument says whether int8 projections take `gemv_q8` ("int8-w8a8",
engine.kernels.linear_q8) as the Python path's do. Per layer, the constructor takes 12
entries (None where absent): input norm weight, qkv weight,
qkv scale (int8), qkv bias, o weight, o scale, o bias, post-attention norm weight, gate_up
weight, gate_up scale, down weight, down scale; then the final norm's weight.
"""

from __future__ import annotations

PER_LAYER = 12

SOURCE = r"""
#ifdef TANDEM_NARROW_LINEAR  // calls narrow_linear::gemv (engine.kernels.linear)
namespace decode_stack {

using OptT = c10::optional<torch::Tensor>;

class Stack {
  public:
    Stack(std::vector<OptT> tensors, int64_t layers, int64_t heads, int64_t kv_heads,
          int64_t head_dim, double eps, bool q8)
        : t_(std::move(tensors)), L_(layers), H_(heads), kvH_(kv_heads), D_(head_dim),
          eps_(eps), q8_(q8) {
        TORCH_CHECK((int64_t)t_.size() == layers * 12 + 1, "12 tensors a layer + final norm");
        for (int64_t l = 0; l < layers; ++l)
            for (int i : {0, 1, 4, 7, 8, 10})
                TORCH_CHECK(t_[l * 12 + i].has_value(), "layer ", l, " misses tensor ", i);
        TORCH_CHECK(t_.back().has_value(), "final norm weight");
    }

    // x [M, hidden] (the embeddings), cos/sin [M, D] fp32 rows, kv the whole cache
    // [N, L, 2, bs, kvH, D], blocks/offsets [M] int64 (the new tokens' slots), tables
    // [M, >= blocks] int64, lens [M] int64 (keys per sequence, the new token's included).
    // scale/window: the attention's (window 0: none). Returns the final norm's output.
    torch::Tensor run(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv,
                      torch::Tensor blocks, torch::Tensor offsets, torch::Tensor tables,
                      torch::Tensor lens, double scale, int64_t window) const {
        TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 3, "1-3 decode rows");
        TORCH_CHECK(kv.dim() == 6 && kv.size(1) == L_ && kv.size(2) == 2, "kv cache layout");
        const int64_t M = x.size(0);
        OptT residual;
        for (int64_t l = 0; l < L_; ++l) {
            const OptT* w = &t_[l * 12];
            auto hr = fused::add_rms_norm(x, residual, *w[0], eps_);
            residual = hr[1];
            auto qkv = mm(hr[0], *w[1], w[2], w[3]).view({M, H_ + 2 * kvH_, D_});
            fused::rope_(qkv, cos, sin, H_ + kvH_);
            auto layer = kv.select(1, l);
            auto kc = layer.select(1, 0), vc = layer.select(1, 1);
            paged_decode::cache_write(kc, vc, blocks, offsets, qkv.narrow(1, H_, kvH_),
                                      qkv.narrow(1, H_ + kvH_, kvH_));
            auto o = paged_decode::paged_decode(qkv.narrow(1, 0, H_), kc, vc, c10::nullopt,
                                                c10::nullopt, tables, lens, scale, window);
            x = mm(o.view({M, H_ * D_}), *w[4], w[5], w[6]);
            hr = fused::add_rms_norm(x, residual, *w[7], eps_);
            residual = hr[1];
            auto act = fused::silu_mul(mm(hr[0], *w[8], w[9], c10::nullopt));
            x = mm(act, *w[10], w[11], c10::nullopt);
        }
        return fused::add_rms_norm(x, residual, *t_.back(), eps_)[0];
    }

  private:
    // One projection, as engine.models.linear.Linear routes it: int8 weights of an
    // "int8-w8a8" model through gemv_q8 where its blocks fit (q8_fits), else gemv.
    torch::Tensor mm(const torch::Tensor& x, const torch::Tensor& w, const OptT& s,
                     const OptT& b) const {
#ifdef TANDEM_Q8_LINEAR
        const int64_t K = w.size(1);
        if (q8_ && s.has_value() && K % 32 == 0 && (s->dim() == 1 || (K / s->size(1)) % 32 == 0))
            return q8_linear::gemv_q8(x, w, *s, b);
#endif
        return narrow_linear::gemv(x, w, s, b);
    }

    std::vector<OptT> t_;
    int64_t L_, H_, kvH_, D_;
    double eps_;
    bool q8_;
};

}  // namespace decode_stack
#endif
"""

BINDINGS = r"""
#ifdef TANDEM_NARROW_LINEAR  // calls narrow_linear::gemv (engine.kernels.linear)
    pybind11::class_<decode_stack::Stack>(m, "DecodeStack")
        .def(pybind11::init<std::vector<c10::optional<torch::Tensor>>, int64_t, int64_t,
                            int64_t, int64_t, double, bool>())
        .def("run", &decode_stack::Stack::run, "one decode step through every layer");
#endif
"""
