"""Weight-only int8 quantization: the scheme's error bound, every execution route against the
dequantized reference, and the engine end to end (close to the unquantized model, fewer
weight bytes, validation of the setting)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams, kernels
from engine.kernels import linear as linear_kernels
from engine.models.linear import TILED_MAX_ROWS, Linear, quantize_linears
from engine.quantization import dequantize_int8, quantize_int8, validate

OPS = kernels.ops()
needs_kernels = pytest.mark.skipif(
    kernels.unavailable_reason() is not None or not kernels.cpu_has_linear_kernels(),
    reason="the int8 kernels need AVX-512 or AVX2+FMA and a C++ toolchain",
)


def test_quantize_int8_error_is_at_most_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 130, generator=g, dtype=torch.float32)
    w[3] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (37,)
    assert int(q.abs().max()) <= 127
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())
    assert torch.equal(q[3], torch.zeros(130, dtype=torch.int8))


def test_dequantize_int8_is_q_times_scale():
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (9, 33), generator=g, dtype=torch.int8)
    scale = torch.rand(9, generator=g, dtype=torch.float32)
    w = dequantize_int8(q, scale)
    assert w.dtype == torch.float32
    assert torch.equal(w, q.float() * scale[:, None])


def test_quantize_linears_touches_only_the_module_given():
    inner = torch.nn.Sequential(Linear(8, 8), torch.nn.ReLU(), Linear(8, 4))
    head = Linear(4, 2)
    assert quantize_linears(inner, None) == 0 and quantize_linears(inner, "none") == 0
    assert not any(m.quantized for m in (inner[0], inner[2]))
    assert quantize_linears(inner, "int8") == 2
    assert inner[0].quantized and inner[2].quantized and not head.quantized
    with pytest.raises(ValueError, match="quantization"):
        quantize_linears(head, "int4")


def test_validate_names_the_field():
    assert validate(None) == "auto" and validate("int8") == "int8"
    with pytest.raises(ValueError, match="quantization"):
        validate("int4")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 4, 17, 64])
def test_int8_kernels_match_dequantized_reference(dtype, m):
    g = torch.Generator().manual_seed(m)
    q = torch.randint(-127, 128, (70, 515), generator=g, dtype=torch.int8)
    scale = torch.rand(70, generator=g, dtype=torch.float32) / 50
    bias = torch.randn(70, generator=g, dtype=torch.float32).to(dtype)
    x = torch.randn(m, 515, generator=g, dtype=torch.float32).to(dtype)
    ref = linear_kernels.reference(x, q, scale, bias)
    ops = [OPS.tiled_linear] + ([OPS.gemv] if m <= 3 else [])
    for op in ops:
        got = op(x, q, scale, bias)
        assert got.dtype == dtype
        # fp32: summation order differs from the reference's (cancellation can leave a few
        # e-5 absolute on values of ~10); bf16: one rounding of the same sum.
        tol = 1e-4 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_routes_agree(dtype):
    """Kernel rows, dequantized-GEMM rows and the torch fallback give the same products."""
    g = torch.Generator().manual_seed(1)
    lin = Linear(96, 40, bias=True).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=g, dtype=torch.float32))
        lin.bias.copy_(torch.randn(40, generator=g, dtype=torch.float32))
    lin.quantize_int8()
    assert lin.weight is None and lin.qweight.dtype == torch.int8
    lin.int8_ops = OPS if OPS is not None and OPS.tiled_linear is not None else None
    for m in (1, 4, TILED_MAX_ROWS, TILED_MAX_ROWS + 1):
        x = torch.randn(m, 96, generator=g, dtype=torch.float32).to(dtype)
        ref = linear_kernels.reference(x, lin.qweight, lin.wscale, lin.bias)
        got = lin(x)
        assert got.dtype == dtype
        tol = 1e-4 if dtype == torch.float32 else 2**-6
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("method", ["int8", "int8-w8a8"])
def test_engine_int8_stays_close_to_the_full_model(make_tiny_model, method):
    """The quantized engine's first-token logits track the full model's and greedy decoding
    mostly agrees; its decoder weights take a quarter of the fp32 bytes. int8-w8a8 (decode
    activations int8 too) where its kernel exists: every int8 projection takes it."""
    q8 = OPS is not None and OPS.gemv_q8 is not None
    if method == "int8-w8a8" and not q8:
        pytest.skip("the int8 x int8 kernel needs AVX2 and a C++ toolchain")
    path = make_tiny_model("llama")
    full = LLM(path, dtype="float32", enable_prefix_caching=False)
    quant = LLM(path, dtype="float32", enable_prefix_caching=False, quantization=method)
    if method == "int8-w8a8":  # the head too (group scales of 32)
        lins = [m for m in quant.engine.model.modules() if getattr(m, "scheme", None) == "int8"]
        assert lins and all(m.int8_q8 for m in lins)
    layers_full = sum(
        p.numel() * p.element_size() for p in full.engine.model.model.layers.parameters()
    )
    layers_q = sum(
        t.numel() * t.element_size()
        for t in [
            *quant.engine.model.model.layers.parameters(),
            *quant.engine.model.model.layers.buffers(),
        ]
    )
    assert layers_q < 0.3 * layers_full
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 17, 40, 90)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    free0 = [llm.engine.block_manager.num_free_blocks for llm in (full, quant)]
    a = full.generate(prompts, sp)
    b = quant.generate(prompts, sp)
    first = sum(x.token_ids[0] == y.token_ids[0] for x, y in zip(a, b, strict=True))
    same = sum(
        t == u
        for x, y in zip(a, b, strict=True)
        for t, u in zip(x.token_ids, y.token_ids, strict=True)
    )
    assert first >= 3, (a, b)
    assert same >= 0.6 * 4 * 12, (a, b)
    assert [llm.engine.block_manager.num_free_blocks for llm in (full, quant)] == free0


def test_engine_rejects_unknown_quantization(make_tiny_model):
    with pytest.raises(ValueError, match="quantization"):
        LLM(make_tiny_model("llama"), dtype="float32", quantization="fp4")
