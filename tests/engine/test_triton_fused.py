"""The GPU's fused elementwise ops (engine.kernels.triton_fused) against the torch ops they
replace, with Hugging Face's rounding points. On a GPU bf16 and FP8 results must be identical;
under Triton's CPU interpreter (no GPU here) its casts truncate instead of rounding to nearest
(and its FP8 cast is wrong near powers of two), so there fp32 is checked exactly and bf16 and
FP8 within one step of their rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip(
    "triton", reason="triton is not installed (the test extra brings it on Linux x86_64 only)"
)
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


def _rope_case(tokens, heads, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(tokens, heads, dim, generator=g)).to(DEVICE, dtype)
    positions = torch.randint(0, 8192, (tokens,), generator=g)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return x, emb.cos().to(DEVICE), emb.sin().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 4, 2, 128), (3, 5, 1, 64), (5, 3, 3, 80)])
def test_rope_equals_hf_bit_for_bit(dtype, shape):
    """transformers' own apply_rotary_pos_emb (cos/sin cast to the dtype first, as its rotary
    class does), on q and k heads side by side in one projection output (a strided view, as
    the model passes it); the v heads after them are not touched. Exact in bf16 too: the
    kernel rounds on the bits, not with the interpreter's truncating cast."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    tokens, q_heads, kv_heads, dim = shape
    qkv, cos, sin = _rope_case(tokens, q_heads + 2 * kv_heads, dim, dtype, seed=q_heads)
    rotated = q_heads + kv_heads
    c, s = cos.to(dtype)[None], sin.to(dtype)[None]  # [1, tokens, dim]: HF's batch axis
    q, k = (qkv[:, :q_heads].transpose(0, 1)[None], qkv[:, q_heads:rotated].transpose(0, 1)[None])
    want_q, want_k = apply_rotary_pos_emb(q, k, c, s)
    got = qkv.clone()
    assert tf.rope_(got, cos, sin, rotated) is got
    assert torch.equal(got[:, :q_heads], want_q[0].transpose(0, 1))
    assert torch.equal(got[:, q_heads:rotated], want_k[0].transpose(0, 1))
    assert torch.equal(got[:, rotated:], qkv[:, rotated:])


def test_rope_refuses_a_layout_it_cannot_read():
    x, cos, sin = _rope_case(4, 2, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match="contiguous"):
        tf.rope_(x.transpose(1, 2), cos, sin, 2)


def test_gpu_ops_keep_the_rope_kernel_only_where_it_equals_torch(monkeypatch):
    """gpu_ops(device) checks the RoPE kernel on the device first (once per device): bit-equal,
    it is used; otherwise (here: one rounding fewer, as a contracted FMA gives) RoPE stays in
    torch and the other fused ops stay on."""
    from engine import kernels

    kernels.ROPE_VERDICTS.clear()
    assert tf.rope_matches_torch(DEVICE) == {"float32": True, "bfloat16": True}
    assert kernels.gpu_ops(DEVICE).rope_ is tf.rope_

    def contracted(x, cos, sin, rot_heads):  # x * cos + rot(x) * sin, the products unrounded
        half = x.shape[-1] // 2
        y, c, s = x[:, :rot_heads].float(), cos[:, None].to(x.dtype).float(), sin[:, None]
        s = s.to(x.dtype).float()
        rot = torch.cat((-y[..., half:], y[..., :half]), dim=-1)
        x[:, :rot_heads] = (y * c + rot * s).to(x.dtype)
        return x

    monkeypatch.setattr(tf, "rope_", contracted)
    kernels.ROPE_VERDICTS.clear()
    try:
        ops = kernels.gpu_ops(DEVICE)
        assert ops.rope_ is None and ops.add_rms_norm is tf.TritonOps.add_rms_norm
        assert kernels.gpu_ops() is tf.TritonOps  # no device: nothing checked
    finally:
        kernels.ROPE_VERDICTS.clear()  # the wrong kernel's verdict must not outlive it


def test_the_rope_check_runs_under_another_default_device():
    """The engine loads a model under `with torch.device(...)`, and checks the RoPE kernel
    there: the check's inputs are built on the CPU whatever the default device, and the
    engine's verdict is recorded (GPU run 7: the check raised under the model's default device,
    and the engine silently ran torch's RoPE)."""
    from engine import kernels

    kernels.ROPE_VERDICTS.clear()
    try:
        with torch.device("meta"):
            assert tf.rope_matches_torch(DEVICE) == {"float32": True, "bfloat16": True}
            assert kernels.gpu_ops(DEVICE).rope_ is tf.rope_
        assert kernels.ROPE_VERDICTS[DEVICE] is True
    finally:
        kernels.ROPE_VERDICTS.clear()


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_with_fp8_quantization_equals_the_two_kernels(dtype, with_residual):
    """add_rms_norm_fp8 is quantize_fp8_tokens(add_rms_norm(...)) in one kernel: the same
    FP8 bits, scales and residual (the same values rounded at the same points)."""
    x, r = _randn(4, 96, dtype=dtype) * 3, _randn(4, 96, dtype=dtype, seed=1)
    x[2] = 0  # with no residual: an all-zero row, the floor scale
    w = 1 + 0.1 * _randn(96, dtype=dtype, seed=2)
    res = r if with_residual else None
    q, scale, new_res = tf.add_rms_norm_fp8(x, res, w, 1e-5)
    out, want_res = tf.add_rms_norm(x, res, w, 1e-5)
    q_want, s_want = tf.quantize_fp8_tokens(out)
    assert torch.equal(scale, s_want) and torch.equal(q.view(torch.uint8), q_want.view(torch.uint8))
    assert torch.equal(new_res, want_res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("single_pass", [True, False])
def test_silu_mul_with_fp8_quantization_equals_the_two_kernels(dtype, single_pass, monkeypatch):
    """Both kernels: the row in registers, and the chunked two passes for longer rows."""
    if not single_pass:
        monkeypatch.setattr(tf, "SINGLE_PASS_MAX", 0)
    gu = _randn(3, 2 * 2500, dtype=dtype) * 4  # 2500: two 1024-wide chunks and a tail
    q, scale = tf.silu_mul_fp8(gu)
    q_want, s_want = tf.quantize_fp8_tokens(tf.silu_mul(gu))
    assert torch.equal(scale, s_want) and torch.equal(q.view(torch.uint8), q_want.view(torch.uint8))


def test_a_w8a8_linear_takes_tokens_quantized_by_the_op_before_it():
    """`FP8Tokens` into an FP8 W8A8 Linear gives what the bf16 row would have given."""
    from engine.models.linear import Linear

    lin = Linear(96, 48, bias=True).to(DEVICE)  # CUDA's FP8 GEMM wants dims in 16s
    lin.quantize_fp8(activations=True)
    assert lin.takes_fp8_tokens
    x = _randn(5, 96) * 2
    q, scale = fp8.quantize_fp8_tokens(x)
    assert torch.equal(lin(fp8.FP8Tokens(q, scale, x.dtype)), lin(x))
    # Weight-only layers (and block-wise or static-scale ones) quantize their own inputs.
    wo = Linear(96, 40).to(DEVICE)
    wo.quantize_fp8(activations=False)
    assert not wo.takes_fp8_tokens


def test_w8a8_model_with_fused_quantization_generates_what_the_unfused_ops_do(make_tiny_model):
    """A W8A8 model on the Triton ops: the norms and SiLU hand FP8 tokens to every projection
    after them (counted), and the greedy output equals the same ops without that fusion."""
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.protocol import SamplingParams

    calls = {"norm": 0, "silu": 0}

    class Counting(tf.TritonOps):
        @staticmethod
        def add_rms_norm_fp8(*args):
            calls["norm"] += 1
            return tf.add_rms_norm_fp8(*args)

        @staticmethod
        def silu_mul_fp8(gate_up):
            calls["silu"] += 1
            return tf.silu_mul_fp8(gate_up)

    class Unfused(tf.TritonOps):
        add_rms_norm_fp8 = silu_mul_fp8 = None

    model = make_tiny_model("llama")
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = []
    for ops in (Counting, Unfused):
        cfg = EngineConfig(
            model=str(model),
            dtype="float32",
            quantization="fp8",
            num_kv_blocks=16,
            enforce_eager=True,
        )  # counted per call: no graphs
        eng = LLMEngine(cfg)
        eng.model.use_fused_ops(ops)
        eng.add_request("r", [5, 9, 33, 2, 71, 14, 8], sp)
        tokens = []
        while eng.has_unfinished():
            tokens += [t for o in eng.step() for t in o.token_ids]
        outs.append(tokens)
    layers = len(eng.model.model.layers)
    assert calls["norm"] == 2 * layers * 6 and calls["silu"] == layers * 6  # every step
    assert outs[0] == outs[1]
