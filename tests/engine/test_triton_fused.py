"""The GPU's fused elementwise ops (engine.kernels.triton_fused) against the torch ops they
replace, with Hugging Face's rounding points. On a GPU bf16 and FP8 results must be identical;
under Triton's CPU interpreter (no GPU here) its casts truncate instead of rounding to nearest
(and its FP8 cast is wrong near powers of two), so there fp32 is checked exactly and bf16 and
FP8 within one step of their rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the triton package is a test dependency (pyproject)")
from engine.kernels import triton_fused as tf  # noqa: E402
from engine.quantization import fp8  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def _same(got, want, reduction=False):
    if reduction and got.dtype == torch.float32:  # a sum in another order: last-bit
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    elif got.dtype == torch.float32 or CUDA:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    else:  # the interpreter truncates to bf16: one step apart per rounding point (two here)
        assert torch.allclose(got.float(), want.float(), rtol=2**-6, atol=2**-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_hf(dtype):
    x, r = _randn(5, 96, dtype=dtype), _randn(5, 96, dtype=dtype, seed=1)
    w = 1 + 0.1 * _randn(96, dtype=dtype, seed=2)
    out, new_res = tf.add_rms_norm(x, r, w, 1e-5)
    _same(new_res, x + r)
    _same(out, w * F.rms_norm((x + r).float(), (96,), eps=1e-5).to(dtype), reduction=True)
    out, same = tf.add_rms_norm(x, None, w, 1e-5)
    assert same is x
    _same(out, w * F.rms_norm(x.float(), (96,), eps=1e-5).to(dtype), reduction=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    gu = _randn(3, 80, dtype=dtype)
    got, want = tf.silu_mul(gu), F.silu(gu[:, :40]) * gu[:, 40:]
    if dtype == torch.float32:  # exp may differ in its last bit between libraries
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    else:
        _same(got, want)


def test_fp8_token_quantization_matches_the_torch_path():
    x = _randn(3, 2000, dtype=torch.bfloat16) * 10
    x[1] = 0  # an all-zero token: the floor scale, no NaN
    q, s = tf.quantize_fp8_tokens(x)
    q_ref, s_ref = fp8.quantize_fp8_tokens(x)
    assert torch.equal(s, s_ref)
    assert not q.float().isnan().any() and torch.equal(q[1].float(), q_ref[1].float())
    if CUDA:
        assert torch.equal(q.float(), q_ref.float())
    else:  # the interpreter's e4m3 cast is unreliable: the same magnitude is all it shows
        normal = q_ref.float().abs() >= 2**-6  # e4m3's normal range
        ratio = q.float()[normal].abs() / q_ref.float()[normal].abs()
        assert ratio.min() >= 0.49 and ratio.max() <= 1.15  # off by a step, or a power of 2
