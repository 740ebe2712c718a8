"""The compiled CPU kernels against their torch references, over the shapes the engine meets
(and the awkward ones it might): GQA/MQA/MHA, head sizes on and off the AVX-512 path, ragged
and sliding-window contexts, fp32/bf16/FP8 caches, odd GEMM shapes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine import kernels
from engine.kernels import paged_decode
from engine.models.linear import TILED_MAX_ROWS, Linear

OPS = kernels.ops()
NO_BUILD = kernels.unavailable_reason()  # None: the kernels must build here
needs_ops = pytest.mark.skipif(
    NO_BUILD is not None, reason=f"CPU kernels cannot be built here: {NO_BUILD}"
)
needs_bf16 = pytest.mark.skipif(
    NO_BUILD is not None or not kernels.cpu_has_linear_kernels(),
    reason="the linear kernels need AVX-512 or AVX2+FMA and a C++ toolchain",
)


def test_kernels_build_wherever_they_can():
    """A silent fallback must not hide a broken build: where a compiler and ninja exist,
    every op builds and passes its self-check (the linear ones and the decode loop where the
    CPU has AVX-512 or AVX2+FMA)."""
    if NO_BUILD is not None:
        pytest.skip(f"CPU kernels cannot be built here: {NO_BUILD}")
    assert OPS is not None, "the kernel build failed; see the warning in the log"
    missing = [name for name, op in vars(OPS).items() if op is None]
    if not kernels.cpu_has_linear_kernels():
        missing = [
            m for m in missing if m not in ("gemv", "tiled_linear", "gemv_q8", "decode_stack")
        ]
    assert missing == [], f"ops failed to build or their self-check: {missing}"


def _cache(n_blocks, bs, kvh, d, dtype, g):
    """A block-major cache like KVCache's ([blocks, layers=3, 2, bs, kvh, d]) and layer 1's
    k/v views (and FP8 scales), so the kernel sees the real strides."""
    data = torch.randn(n_blocks, 3, 2, bs, kvh, d, generator=g, dtype=torch.float32)
    if dtype == torch.float8_e4m3fn:
        scales = data.abs().amax(-1) / 448.0 + 1e-6
        q8 = (data / scales.unsqueeze(-1)).to(dtype)
        return q8[:, 1, 0], q8[:, 1, 1], scales[:, 1, 0], scales[:, 1, 1]
    data = data.to(dtype)
    return data[:, 1, 0], data[:, 1, 1], None, None


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,bs",
    [
        (8, 4, 64, 16),
        (4, 4, 32, 16),
        (6, 1, 128, 8),
        (4, 2, 40, 16),
        (2, 2, 16, 32),
        (9, 3, 64, 16),
    ],
)
@pytest.mark.parametrize("window", [0, 21])
def test_paged_decode_matches_reference(dtype, heads, kv_heads, head_dim, bs, window):
    g = torch.Generator().manual_seed(heads * 100 + head_dim + bs)
    n_blocks = 40
    lens = torch.tensor([1, bs, bs + 1, 3 * bs - 1, 7 * bs], dtype=torch.int64)
    b = lens.numel()
    width = 8
    # Distinct blocks per sequence in shuffled order, padded with 0 like the engine's tables.
    perm = torch.randperm(n_blocks, generator=g)
    tables = torch.zeros(b, width, dtype=torch.int64)
    used = 0
    for i, n in enumerate(lens.tolist()):
        nb = -(-n // bs)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    kc, vc, ks, vs = _cache(n_blocks, bs, kv_heads, head_dim, dtype, g)
    q = torch.randn(b, heads, head_dim, generator=g, dtype=torch.float32)
    scale = head_dim**-0.5
    got = OPS.paged_decode(q, kc, vc, ks, vs, tables, lens, scale, window)
    ref = paged_decode.reference(q, kc, vc, ks, vs, tables, lens, scale, window)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)


@needs_ops
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (6, 1), (8, 8)])
def test_paged_decode_batch_one_same_at_any_thread_count(heads, kv_heads):
    """At batch 1 the work splits over the kv heads as threads allow (3 kv heads: one item
    at 1 thread, three at 2): each query head's result must not depend on the split."""
    g = torch.Generator().manual_seed(heads)
    kc, vc, _, _ = _cache(8, 16, kv_heads, 64, torch.bfloat16, g)
    q = torch.randn(1, heads, 64, generator=g, dtype=torch.float32)
    tables = torch.tensor([[3, 0, 6, 1]], dtype=torch.int64)
    lens = torch.tensor([53], dtype=torch.int64)
    ref = paged_decode.reference(q, kc, vc, None, None, tables, lens, 0.125, 0)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            outs.append(OPS.paged_decode(q, kc, vc, None, None, tables, lens, 0.125, 0))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(outs[0], ref, rtol=2e-5, atol=2e-5)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@needs_ops
def test_paged_decode_strided_queries_and_bad_input():
    g = torch.Generator().manual_seed(1)
    kc, vc, _, _ = _cache(6, 16, 2, 64, torch.float32, g)
    qkv = torch.randn(2, 8, 64, generator=g, dtype=torch.float32)
    q = qkv[:, :4]  # a view into a fused projection, as the model passes it
    tables = torch.tensor([[2, 5], [0, 3]], dtype=torch.int64)
    lens = torch.tensor([20, 32], dtype=torch.int64)
    got = OPS.paged_decode(q, kc, vc, None, None, tables, lens, 0.125, 0)
    ref = paged_decode.reference(q, kc, vc, None, None, tables, lens, 0.125, 0)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
    with pytest.raises(RuntimeError, match="context length"):
        OPS.paged_decode(q, kc, vc, None, None, tables, torch.tensor([20, 33]), 0.125, 0)
    with pytest.raises(RuntimeError, match="q"):
        OPS.paged_decode(q.to(torch.float16), kc, vc, None, None, tables, lens, 0.125, 0)
    # bf16 queries: same math in fp32 inside, one rounding of the output to bf16.
    got16 = OPS.paged_decode(q.to(torch.bfloat16), kc, vc, None, None, tables, lens, 0.125, 0)
    ref16 = paged_decode.reference(q.to(torch.bfloat16), kc, vc, None, None, tables, lens, 0.125, 0)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), ref16, rtol=2**-7, atol=2**-7)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cache_write_matches_write_at(dtype):
    from engine.kv_cache import KVCache, KVCacheSpec

    g = torch.Generator().manual_seed(2)
    spec = KVCacheSpec(
        model="t", num_layers=3, num_kv_heads=4, head_dim=16, block_size=8, dtype=dtype
    )
    a, b = KVCache(spec, 6), KVCache(spec, 6)
    qkv = torch.randn(11, 12, 16, generator=g, dtype=torch.float32).to(dtype)
    k, v = qkv[:, 4:8], qkv[:, 8:]
    slots = torch.randperm(48, generator=g)[:11]
    a.write_at(2, slots // 8, slots % 8, k, v)
    kc, vc, _, _ = b.layer_views(2)
    OPS.cache_write(kc, vc, slots // 8, slots % 8, k, v)
    assert torch.equal(a.data, b.data)
    with pytest.raises(RuntimeError, match="slot out of range"):
        OPS.cache_write(kc, vc, torch.tensor([6]), torch.tensor([0]), k[:1], v[:1])
    with pytest.raises(RuntimeError, match="cache dtype"):
        OPS.cache_write(kc, vc, slots[:1] // 8, slots[:1] % 8, k[:1].double(), v[:1].double())


@needs_bf16
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 15, 16, 17, 64, 97])
@pytest.mark.parametrize(
    "n,k,bias", [(1, 7, False), (13, 80, True), (70, 515, False), (256, 512, True)]
)
def test_bf16_linear_matches_fp32_reference(m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g, dtype=torch.float32).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g, dtype=torch.float32).to(torch.bfloat16)
    b = torch.randn(n, generator=g, dtype=torch.float32).to(torch.bfloat16) if bias else None
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    for op in (OPS.tiled_linear, OPS.gemv):
        if op is OPS.gemv and m > 3:
            continue
        got = op(x, w, None, b)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # fp32 accumulation then one rounding: within one bf16 ulp of the fp32 result
        # (summation order differs from the reference's, so allow a hair more than 2^-8).
        torch.testing.assert_close(got.float(), ref, rtol=2**-7, atol=1e-3 * k**0.5)


@needs_bf16
def test_linear_routes_every_row_count_to_the_same_result():
    """engine.models.linear.Linear picks GEMV, tiled kernel or widened fp32 GEMM by row count;
    every route must agree with fp32 math rounded once."""
    g = torch.Generator().manual_seed(3)
    lin = Linear(96, 40, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=g, dtype=torch.float32))
        lin.bias.copy_(torch.randn(40, generator=g, dtype=torch.float32))
    lin.cpu_ops, lin.widen_fallback = OPS, True
    for m in (1, 3, 4, TILED_MAX_ROWS, TILED_MAX_ROWS + 1, 300):
        x = torch.randn(m, 96, generator=g, dtype=torch.float32).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
        got = lin(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref, rtol=2**-7, atol=1e-2)


@needs_bf16
def test_native_bf16_cpus_take_only_the_gemv_rows():
    """With native bf16 GEMMs (`gemv_only`), 1-3 rows go through the GEMV kernel (a decode
    step's weight read) and every other row count through torch's own bf16 GEMM."""
    import dataclasses

    calls = {"gemv": 0, "tiled_linear": 0}

    def counted(name):
        def op(*args):
            calls[name] += 1
            return getattr(OPS, name)(*args)

        return op

    g = torch.Generator().manual_seed(5)
    lin = Linear(96, 40, bias=True).to(torch.bfloat16)
    lin.cpu_ops = dataclasses.replace(OPS, **{n: counted(n) for n in calls})
    lin.gemv_only = True
    for m, via in ((1, "gemv"), (3, "gemv"), (4, None), (TILED_MAX_ROWS, None), (300, None)):
        before = dict(calls)
        x = torch.randn(m, 96, generator=g, dtype=torch.float32).to(torch.bfloat16)
        got = lin(x)
        ref = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
        torch.testing.assert_close(got.float(), ref, rtol=2**-7, atol=1e-2)
        moved = {n for n in calls if calls[n] != before[n]}
        assert moved == ({via} if via else set()), (m, moved)


def test_kernels_can_be_turned_off():
    """TANDEM_CPU_KERNELS=0: nothing is built and the engine still generates (torch paths)."""
    code = (
        "import torch\n"
        "from engine import kernels\n"
        "assert kernels.ops() is None\n"
        "from engine.attention import select_backend\n"
        "b = select_backend('torch', torch.device('cpu'), 0.1, None)\n"
        "assert b._kernel is None\n"
        "print('off')\n"
    )
    env = {"TANDEM_CPU_KERNELS": "0", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "off"


needs_fused = needs_ops


@needs_fused
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 512), (33, 96), (2, 100)])
def test_fused_add_rms_norm_matches_hf_math(dtype, rows, hidden):
    from engine.kernels import fused

    g = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=g, dtype=torch.float32).to(dtype)
    res = torch.randn(rows, hidden, generator=g, dtype=torch.float32).to(dtype)
    w = torch.randn(hidden, generator=g, dtype=torch.float32).to(dtype)
    for r in (res, None):
        out, new_res = OPS.add_rms_norm(x, r, w, 1e-5)
        ref_out, ref_res = fused.reference_add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(new_res, ref_res)  # the residual add rounds exactly like HF's
        # fp32: a few ulps (summation order); bf16: at most one ulp of the final rounding.
        tol = 1e-6 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)


@needs_fused
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_and_silu_mul_match_torch(dtype):
    from engine.kernels import fused

    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(5, 12, 64, generator=g, dtype=torch.float32).to(dtype)
    cos = torch.randn(5, 64, generator=g, dtype=torch.float32)
    sin = torch.randn(5, 64, generator=g, dtype=torch.float32)
    ref = fused.reference_rope(qkv, cos, sin, 8)
    got = qkv.clone()
    OPS.rope_(got, cos, sin, 8)
    # Same roundings as HF's apply_rotary_pos_emb: bit-exact; untouched heads stay as they were.
    assert torch.equal(got, ref)
    gu = torch.randn(9, 2 * 96, generator=g, dtype=torch.float32).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(
        OPS.silu_mul(gu).float(), fused.reference_silu_mul(gu).float(), rtol=tol, atol=tol
    )
    # Vector blocks of 8 and a tail (I = 37), and the exponential's edges: e^-g overflows
    # to inf for g < -88.72 (silu -> -0, as torch's), underflows for large g, NaN stays NaN.
    edges = [-1e4, -100.0, -88.8, -88.7, -87.5, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 1e4]
    gate = torch.tensor(edges * 3 + [float("nan")], dtype=torch.float32)
    gu = torch.cat([gate, torch.linspace(-3, 3, gate.numel())])[None].to(dtype)
    torch.testing.assert_close(
        OPS.silu_mul(gu).float(), fused.reference_silu_mul(gu).float(), rtol=tol, atol=tol,
        equal_nan=True,
    )  # fmt: skip
    with pytest.raises(RuntimeError):
        OPS.silu_mul(gu.to(torch.float16))
