"""int8-w8a8: int8 weights with the decode rows' activations quantized per block of 32
(engine.kernels.linear_q8, llama.cpp Q8_0's arithmetic): the kernel against its reference, the
routing (decode rows take it, prefill rows do not). The engine end to end (close to the full
model) is tests/engine/test_quantization.py's int8 test, run for both methods."""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.kernels import linear_q8
from engine.models.linear import Linear, q8_fits
from engine.quantization import resolve

OPS = kernels.ops()
needs_q8 = pytest.mark.skipif(
    OPS is None or OPS.gemv_q8 is None,
    reason="the int8 x int8 kernel needs AVX2 and a C++ toolchain",
)


def test_quantize_activations_is_per_block_round_to_nearest_even():
    x = torch.zeros(1, 64)
    x[0, :32] = torch.linspace(-2.0, 2.0, 32)
    q, s = linear_q8.quantize_activations(x)
    assert s[0].tolist() == pytest.approx([2.0 / 127, 0.0])  # an all-zero block: scale 0
    assert q[0, 0] == -127 and q[0, 31] == 127 and torch.all(q[0, 32:] == 0)
    d = s[0, 0].item()
    assert torch.allclose(q[0, :32] * d, x[0, :32], atol=d / 2 + 1e-7)


@needs_q8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("group", [0, 32, 64])
def test_gemv_q8_matches_its_reference(dtype, m, group):
    g = torch.Generator().manual_seed(m * 10 + group)
    n, k = 70, 576
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    shape = (n, k // group) if group else (n,)
    scale = torch.rand(shape, generator=g, dtype=torch.float32) / 50
    bias = torch.randn(n, generator=g, dtype=torch.float32).to(dtype)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, k, generator=g) * 8).to(dtype)
    got = OPS.gemv_q8(x, w, scale, bias)
    ref = linear_q8.reference(x, w, scale, bias)
    tol = 1e-4 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@needs_q8
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("group", [0, 32])
def test_gemv_q8_row_results_do_not_depend_on_the_tile(m, group):
    """The kernel reads 4 weight rows side by side (2 for 2-3 activation rows) and the rows
    left over one at a time: each row's result is bit-identical whichever way it was read."""
    g = torch.Generator().manual_seed(7 + m + group)
    n, k = 11, 192  # 11 rows: tiles and a remainder, at every split of the threads
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand((n, k // group) if group else (n,), generator=g) / 50
    bias = torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g) * 4
    whole = OPS.gemv_q8(x, w, scale, bias)
    for r in range(n):
        alone = OPS.gemv_q8(
            x, w[r : r + 1].contiguous(), scale[r : r + 1].contiguous(), bias[r : r + 1]
        )
        assert torch.equal(whole[:, r : r + 1], alone), f"row {r}"


@needs_q8
def test_gemv_q8_refuses_what_it_cannot_take():
    x = torch.randn(1, 48)
    w = torch.zeros(4, 48, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        OPS.gemv_q8(x, w, torch.ones(4), None)
    with pytest.raises(RuntimeError, match="1-3 rows"):
        OPS.gemv_q8(torch.randn(4, 64), torch.zeros(4, 64, dtype=torch.int8), torch.ones(4), None)
    with pytest.raises(RuntimeError, match="multiple of 32"):  # groups of 16
        OPS.gemv_q8(
            torch.randn(1, 64), torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 4), None
        )
    assert not q8_fits(torch.zeros(4, 48, dtype=torch.int8), torch.ones(4))
    assert not q8_fits(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 4))


@needs_q8
def test_decode_rows_take_the_q8_kernel_and_prefill_rows_do_not():
    g = torch.Generator().manual_seed(3)
    lin = Linear(96, 40, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=g))
        lin.bias.copy_(torch.randn(40, generator=g))
    lin.quantize_int8()
    lin.int8_ops, lin.int8_q8 = OPS, True
    x = torch.randn(5, 96, generator=g)
    for rows in (x[:1], x[:3]):
        q8 = linear_q8.reference(rows, lin.qweight, lin.wscale, lin.bias)
        exact = OPS.gemv(rows, lin.qweight, lin.wscale, lin.bias)
        got = lin(rows)
        torch.testing.assert_close(got, q8, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(got, exact, rtol=1e-6, atol=1e-6)  # activations quantized
    torch.testing.assert_close(lin(x), OPS.tiled_linear(x, lin.qweight, lin.wscale, lin.bias))


def test_int8_w8a8_resolves_and_refuses_fp8_checkpoints():
    assert resolve("int8-w8a8", False, "cpu") == "int8-w8a8"
    with pytest.raises(ValueError, match="full-precision"):
        resolve("int8-w8a8", True, "cpu")
