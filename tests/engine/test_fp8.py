"""FP8 (e4m3) projections: the rounding bound of the weight quantizer, the activation
quantizer against a hand-written reference, the W8A8 and weight-only products against their
dequantized-operand references, `Linear`'s routing, the `resolve` table, and the engine end to
end (fewer weight bytes, logits close to the full model's). FP8 checkpoints as users have them
are tests/engine/test_fp8_checkpoints.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.llm_engine import EngineConfig, LLMEngine
from engine.models.linear import Linear, quantize_linears
from engine.quantization import fp8, resolve
from engine.scoring import teacher_forced_logits

E4M3 = torch.float8_e4m3fn
MIN_NORMAL = 2.0**-6  # e4m3's smallest normal value
SUBNORMAL_STEP = 2.0**-9  # the spacing of e4m3's subnormals


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _expand(scale: torch.Tensor, block_k: int, k: int) -> torch.Tensor:
    """Hand-written broadcast of a per-(row, K block) scale [R, G] to [R, K]."""
    out = torch.empty(scale.shape[0], k)
    for g in range(scale.shape[1]):
        out[:, g * block_k : (g + 1) * block_k] = scale[:, g : g + 1]
    return out


def test_quantize_fp8_weight_error_is_at_most_half_a_step():
    g = _gen(0)
    w = torch.randn(37, 130, generator=g) * torch.rand(37, 1, generator=g) * 10
    w[3] = 0.0  # an all-zero row must give zeros, not NaN
    w[5, 7] = 1e-30  # far below the row's smallest step: rounds to zero
    q, scale = fp8.quantize_fp8_weight(w)
    assert q.dtype == E4M3 and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (37,)
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
    deq = q.float() * scale[:, None]
    assert not bool(deq.isnan().any())
    assert torch.equal(deq[3], torch.zeros(130))
    # The largest value of each row maps to FP8_MAX: nothing saturates.
    assert torch.allclose(deq.abs().amax(1), w.abs().amax(1), rtol=1e-6)
    units = w.abs() / scale[:, None]  # the value in units of the row's scale
    err = (deq - w).abs()
    normal = units >= MIN_NORMAL
    # 3 mantissa bits: half a step is at most 2**-4 of a normal value...
    assert bool((err[normal] <= 2.0**-4 * w.abs()[normal] * (1 + 1e-6)).all())
    # ...and at most half the subnormal spacing below the normal range.
    sub_err = err[~normal] / scale[:, None].expand_as(w)[~normal]
    assert bool((sub_err <= SUBNORMAL_STEP / 2 * (1 + 1e-6)).all())


def _reference_tokens(x: torch.Tensor, block_k: int):
    m, k = x.shape
    block_k = block_k or k
    groups = -(-k // block_k)
    q = torch.empty(m, k, dtype=E4M3)
    scale = torch.empty(m, groups)
    for i in range(m):
        for gi in range(groups):
            cols = slice(gi * block_k, (gi + 1) * block_k)
            s = max(float(x[i, cols].float().abs().max()) / 448.0, 1e-12)
            scale[i, gi] = s
            q[i, cols] = (x[i, cols].float() / torch.tensor(s)).clamp(-448, 448).to(E4M3)
    return q, scale


@pytest.mark.parametrize("block_k", [0, 64, 128], ids=["token", "block64", "block128-ragged"])
def test_quantize_fp8_tokens_matches_reference(block_k):
    g = _gen(1)
    x = torch.randn(6, 200, generator=g) * torch.rand(6, 1, generator=g) * 30
    x[2] = 0.0
    x[4, :64] = 0.0  # one all-zero block in a non-zero token
    q, scale = fp8.quantize_fp8_tokens(x, block_k)
    ref_q, ref_scale = _reference_tokens(x, block_k)
    assert q.dtype == E4M3 and scale.dtype == torch.float32
    assert scale.shape == ref_scale.shape == (6, -(-200 // (block_k or 200)))
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(q[2].float(), torch.zeros(200))


def _random_fp8_weight(n: int, k: int, groups: int, seed: int):
    g = _gen(seed)
    q = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(E4M3)
    scale = torch.rand(n, groups, generator=g) / 100 + 1e-4
    return q, scale.squeeze(1) if groups == 1 else scale


def _w8a8_reference(x, q, scale, bias, block_k, input_scale):
    """xq * xs @ (q * s).T + bias, every operand dequantized in fp32."""
    k = x.shape[1]
    if input_scale is not None:
        xq = (x.float() / input_scale).clamp(-448, 448).to(E4M3)
        xd = xq.float() * input_scale
    else:
        xq, xs = _reference_tokens(x, block_k)
        xd = xq.float() * (_expand(xs, block_k, k) if block_k else xs)
    wd = q.float() * (_expand(scale, block_k, k) if block_k else scale[:, None])
    y = xd @ wd.T
    return y if bias is None else y + bias.float()


CASES = {
    "channel": dict(block_k=0, static=False),
    "block-ragged": dict(block_k=128, static=False),
    "block64": dict(block_k=64, static=False),
    "static": dict(block_k=0, static=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_fp8_linear_matches_dequantized_reference(case, dtype, bias):
    block_k, static = CASES[case]["block_k"], CASES[case]["static"]
    n, k = 70, 200  # K is not a multiple of 128
    q, scale = _random_fp8_weight(n, k, -(-k // block_k) if block_k else 1, seed=2)
    g = _gen(3)
    x = (torch.randn(9, k, generator=g) * 3).to(dtype)
    b = (torch.randn(n, generator=g)).to(dtype) if bias else None
    input_scale = x.float().abs().max() / 448 * 1.25 if static else None
    y = fp8.fp8_linear(x, q, scale, b, block_k, input_scale)
    assert y.dtype == dtype and y.shape == (9, n)
    ref = _w8a8_reference(x, q, scale, b, block_k, input_scale)
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    else:  # the same sum rounded once to bf16
        torch.testing.assert_close(y, ref.to(dtype), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_k", [0, 128])
def test_fp8_weight_only_linear_is_linear_on_dequantized_weights(dtype, block_k):
    n, k = 40, 150
    q, scale = _random_fp8_weight(n, k, -(-k // block_k) if block_k else 1, seed=4)
    g = _gen(5)
    x = torch.randn(7, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    w = q.float() * (_expand(scale, block_k, k) if block_k else scale[:, None])
    assert torch.equal(fp8.dequantize_fp8(q, scale, block_k), w)
    y = fp8.fp8_weight_only_linear(x, q, scale, b, block_k)
    assert y.dtype == dtype
    ref = F.linear(x.float(), w, b.float()).to(dtype)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activations", [True, False], ids=["w8a8", "weight-only"])
def test_linear_quantize_fp8_routes_to_the_fp8_functions(activations):
    g = _gen(6)
    lin = Linear(200, 70, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(70, 200, generator=g) / 10)
    w, bias = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.quantize_fp8(activations=activations)
    assert lin.quantized and lin.scheme == "fp8" and lin.weight is None
    assert lin.fp8_activations is activations and lin.block_k == 0 and lin.input_scale is None
    q, scale = fp8.quantize_fp8_weight(w)
    assert lin.qweight.dtype == E4M3 and torch.equal(
        lin.qweight.view(torch.uint8), q.view(torch.uint8)
    )
    assert torch.equal(lin.wscale, scale)
    x = torch.randn(2, 3, 200, generator=g)  # leading dims are flattened and restored
    got = lin(x)
    assert got.shape == (2, 3, 70)
    flat = x.reshape(6, 200)
    if activations:
        want = fp8.fp8_linear(flat, q, scale, bias)
    else:
        want = fp8.fp8_weight_only_linear(flat, q, scale, bias)
    assert torch.equal(got.reshape(6, 70), want)


@pytest.mark.parametrize("method", ["fp8", "fp8-weight-only"])
def test_quantize_linears_fp8_leaves_the_head_alone(method):
    inner = torch.nn.Sequential(Linear(8, 8), torch.nn.ReLU(), Linear(8, 4))
    head = Linear(4, 2)
    assert quantize_linears(inner, method) == 2
    assert all(m.scheme == "fp8" for m in (inner[0], inner[2])) and not head.quantized
    assert inner[0].fp8_activations is (method == "fp8")
    assert quantize_linears(inner, method) == 0  # already quantized: left alone
    with pytest.raises(ValueError, match="resolved first"):
        quantize_linears(head, "weight-only")
    assert not head.quantized


FULL_CPU = {"auto": "none", "none": "none", "int8": "int8", "fp8": "fp8"}
FULL_CPU |= {"fp8-weight-only": "fp8-weight-only", "weight-only": "int8", None: "none"}
FP8_CPU = {"auto": "fp8", "fp8": "fp8", "fp8-weight-only": "fp8-weight-only"}
FP8_CPU |= {"weight-only": "fp8-weight-only", None: "fp8"}


@pytest.mark.parametrize(("method", "want"), FULL_CPU.items())
def test_resolve_full_checkpoint_on_cpu(method, want):
    assert resolve(method, False, "cpu") == want


@pytest.mark.parametrize(("method", "want"), FP8_CPU.items())
def test_resolve_fp8_checkpoint_on_cpu(method, want):
    assert resolve(method, True, "cpu") == want


@pytest.mark.parametrize("method", ["none", "int8"])
def test_resolve_rejects_full_precision_layouts_of_an_fp8_checkpoint(method):
    with pytest.raises(ValueError, match=f"'{method}'.*checkpoint is FP8.*fp8-weight-only"):
        resolve(method, True, "cpu")


def test_resolve_rejects_unknown_methods():
    with pytest.raises(ValueError, match="quantization must be one of"):
        resolve("fp4", False, "cpu")


CUDA = [
    ((9, 0), False, "weight-only", "fp8-weight-only"),
    ((9, 0), False, "auto", "none"),
    ((9, 0), False, "fp8", "fp8"),
    ((8, 9), True, "auto", "fp8"),
    ((8, 0), False, "weight-only", "int8"),
    ((8, 0), True, "auto", "fp8-weight-only"),
    ((8, 0), True, "weight-only", "fp8-weight-only"),
]


@pytest.mark.parametrize(("cap", "fp8_ckpt", "method", "want"), CUDA)
def test_resolve_on_cuda_follows_the_compute_capability(monkeypatch, cap, fp8_ckpt, method, want):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: cap)
    assert resolve(method, fp8_ckpt, "cuda") == want


@pytest.mark.parametrize("fp8_ckpt", [False, True], ids=["full", "fp8-checkpoint"])
def test_resolve_w8a8_needs_fp8_gemms(monkeypatch, fp8_ckpt):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (8, 0))
    with pytest.raises(ValueError, match="needs FP8 GEMMs.*fp8-weight-only"):
        resolve("fp8", fp8_ckpt, "cuda")


def _engine(path, quantization=None) -> LLMEngine:
    cfg = EngineConfig(
        model=str(path), dtype="float32", quantization=quantization, num_kv_blocks=16
    )
    return LLMEngine(cfg)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0))


@pytest.mark.parametrize("method", ["fp8", "fp8-weight-only"])
def test_engine_fp8_halves_weight_bytes_and_tracks_the_full_model(make_tiny_model, method):
    path = make_tiny_model("llama")
    tokens = torch.randint(3, 1000, (48,), generator=_gen(7)).tolist()
    ref = teacher_forced_logits(_engine(path), tokens)
    engine = _engine(path, method)
    assert engine.quantization == method
    layers = [m for m in engine.model.model.layers.modules() if isinstance(m, Linear)]
    assert layers and all(m.scheme == "fp8" for m in layers)
    assert all(m.fp8_activations is (method == "fp8") for m in layers)
    assert not engine.model.lm_head.quantized
    fp8_bytes = sum(
        m.qweight.numel() * m.qweight.element_size() + m.wscale.numel() * m.wscale.element_size()
        for m in layers
    )
    bf16_bytes = sum(m.qweight.numel() * 2 for m in layers)
    assert all(m.qweight.dtype == E4M3 for m in layers)
    assert fp8_bytes <= 0.55 * bf16_bytes
    got = teacher_forced_logits(engine, tokens)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert _cosine(got, ref) > 0.99
