"""The Triton attention kernels against a plain torch reference: the paged decode (GQA groups,
block sizes, contexts across several splits, sliding windows, padding rows of length 0, fp32
and bf16) and the KV write (padding slots -1 are skipped). On a machine without a GPU they run
on CPU tensors under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVCache, KVCacheSpec

pytest.importorskip(
    "triton", reason="triton is not installed (the test extra brings it on Linux x86_64 only)"
)
from engine.kernels import triton_attention as ta  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, kc, vc, tables, lens, scale, window):
    out = []
    for i in range(q.shape[0]):
        n = int(lens[i])
        if n == 0:
            out.append(torch.zeros_like(q[i]))
            continue
        bs = kc.shape[1]
        blocks = tables[i, : -(-n // bs)]
        k = kc[blocks].reshape(-1, *kc.shape[2:])[:n].float()
        v = vc[blocks].reshape(-1, *vc.shape[2:])[:n].float()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        if window:
            s[:, torch.arange(n, device=s.device) < n - window] = float("-inf")
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype))
    return torch.stack(out)


def make_cache(dtype, kv_heads, head_dim, block_size, blocks=64, layers=2):
    cache = KVCache(KVCacheSpec("x", layers, kv_heads, head_dim, block_size, dtype), blocks, DEVICE)
    cache.data.normal_(generator=torch.Generator(DEVICE).manual_seed(0))
    return cache


CASES = [  # dtype, heads, kv_heads, head_dim, block_size, context lengths, window
    (torch.float32, 4, 2, 32, 16, [1, 17, 300, 0], None),
    (torch.float32, 8, 1, 64, 8, [129, 256, 5], None),
    (torch.bfloat16, 8, 2, 48, 8, [5, 260], None),
    (torch.float32, 4, 4, 32, 16, [200, 33, 1], 50),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-h{c[1]}/{c[2]}-d{c[3]}-bs{c[4]}")
def test_paged_decode_matches_reference(case):
    dtype, heads, kv_heads, dim, bs, lens, window = case
    cache = make_cache(dtype, kv_heads, dim, bs)
    kc, vc, _, _ = cache.layer_views(1)
    g = torch.Generator().manual_seed(1)
    tables = torch.stack([torch.randperm(63, generator=g)[:40] + 1 for _ in lens]).to(DEVICE)
    lens_t = torch.tensor(lens, device=DEVICE)
    q = torch.randn(len(lens), heads, dim, generator=g).to(DEVICE, dtype)
    got = ta.paged_decode(q, kc, vc, tables, lens_t, dim**-0.5, window, max(lens))
    want = reference(q, kc, vc, tables, lens_t, dim**-0.5, window)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: p is rounded to bf16 before PV
    assert (got.float() - want.float()).abs().max().item() < tol
    assert got[torch.tensor(lens) == 0].abs().sum() == 0  # padding rows are zeros, not NaN
    # A larger bound on the context (a graph's) gives the same result: extra splits are empty.
    again = ta.paged_decode(q, kc, vc, tables, lens_t, dim**-0.5, window, 4 * max(lens) + 1)
    assert torch.allclose(again.float(), got.float(), atol=tol)


def test_write_kv_stores_slots_and_skips_padding():
    cache = make_cache(torch.float32, 2, 32, 16)
    kc, vc, _, _ = cache.layer_views(0)
    before = cache.data.clone()
    k = torch.randn(3, 2, 32, device=DEVICE)
    v = torch.randn(3, 2, 32, device=DEVICE)
    ta.write_kv(k, v, kc, vc, torch.tensor([5, -1, 70], device=DEVICE))
    assert torch.equal(kc[0, 5], k[0]) and torch.equal(vc[0, 5], v[0])
    assert torch.equal(kc[70 // 16, 70 % 16], k[2]) and torch.equal(vc[4, 6], v[2])
    changed = (cache.data != before).flatten(-2).any(-1).nonzero().tolist()
    # [block, layer, k|v, slot]: only the two real slots of layer 0, K and V
    assert sorted(changed) == [[0, 0, 0, 5], [0, 0, 1, 5], [4, 0, 0, 6], [4, 0, 1, 6]]


def test_paged_decode_refuses_heads_that_do_not_split():
    cache = make_cache(torch.float32, 3, 32, 16)
    kc, vc, _, _ = cache.layer_views(0)
    q = torch.randn(1, 4, 32, device=DEVICE)
    one = torch.ones(1, 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="do not split"):
        ta.paged_decode(q, kc, vc, one, one[0], 0.1, None, 1)


def test_backend_selection_names_what_triton_needs():
    from engine.attention import select_backend

    with pytest.raises(ValueError, match="full-precision KV cache"):
        select_backend("triton", torch.device(DEVICE), 0.1, None, kv_dtype="fp8_e4m3")
    backend = select_backend("triton", torch.device(DEVICE), 0.1, None)
    assert backend.name == "triton" and backend.graph_safe
    auto = select_backend("auto", torch.device("cpu"), 0.1, None)
    assert auto.name == "torch"  # CPU engines keep the reference backend and its C++ kernels
