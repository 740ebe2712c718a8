"""GPU attention kernels in Triton: the KV-cache write and the paged decode attention.

Both read and write the paged cache in place (`KVCache.layer_views`: [blocks, block_size,
kv_heads, head_dim], any block stride), so a decode step never gathers a sequence's context.
Neither kernel syncs with the host or depends on host values that change between steps, so a
decode step built from them can be captured once as a CUDA graph and replayed
(`engine.cuda_graphs`). Padding rows of a captured batch use slot -1 (the write skips them) and
context length 0 (their output is zeros).

Decode is split-K ("flash-decoding"): program (sequence, kv head, split) attends its query
heads (the GQA group, padded to 16 rows for `tl.dot`) to one `SPLIT_LEN`-token slice of the
context with an online softmax and writes a partial output and log-sum-exp; a second kernel
merges the splits. At batch 1 this keeps `kv_heads * splits` programs busy instead of
`kv_heads`. The number of splits comes from a host-side bound on the longest context (the
step's longest in eager mode, `max_model_len` in a graph); splits past a sequence's end exit
at once.

Under `TRITON_INTERPRET=1` the kernels run on CPU tensors (slowly), which is how their
correctness is tested on machines without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter (3.6) multiplies bf16 operands of tl.dot wrongly: there the operands
# are widened to fp32 first (p still rounded to the cache dtype, as on the GPU).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SPLIT_LEN = 128  # context tokens per decode program
# Keys per inner iteration. H200 run 7's sweep (benchmarks/gpu/decode_kernel.py, 32 layers of
# Llama-3-8B's cache as CUDA graphs): one iteration per split (128 of 128) was fastest at batch 1
# (258 us vs 389 us for 32 keys at 1024 tokens) and within 2% of the best at batch 32. A
# 256-wide head keeps 64: two [128, 256] tiles per iteration would crowd shared memory.
BLOCK_N = 128
BLOCK_N_WIDE_HEAD = 64


def default_block_n(head_dim: int) -> int:
    return BLOCK_N if head_dim <= 128 else BLOCK_N_WIDE_HEAD


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    s_kt, s_kh, s_vt, s_vh,
    s_cb, s_cs, s_ch,
    block_size,
    HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    d = tl.arange(0, D_P)
    ok = (d < HEAD_DIM) & (slot >= 0)
    safe = tl.maximum(slot, 0)
    dst = (safe // block_size) * s_cb + (safe % block_size) * s_cs + h * s_ch + d
    k = tl.load(k_ptr + t * s_kt + h * s_kh + d, mask=ok)
    v = tl.load(v_ptr + t * s_vt + h * s_vh + d, mask=ok)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=ok)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=ok)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store k/v ([tokens, kv_heads, head_dim]) at `slots` ([tokens] int64, -1 = skip) of one
    layer's cache views kc/vc ([blocks, block_size, kv_heads, head_dim])."""
    tokens, heads, dim = k.shape
    if tokens == 0:
        return
    _check_last_dim(k, v, kc, vc)
    if kc.stride() != vc.stride():
        raise ValueError("K and V cache views must share a layout")
    _write_kv_kernel[(tokens, heads)](
        k, v, kc, vc, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        kc.shape[1],
        HEAD_DIM=dim, D_P=triton.next_power_of_2(dim),
    )  # fmt: skip


@triton.jit
def _attend_block(q, k, v, pmask, m_i, l_i, acc, scale, cache_dt, IEEE: tl.constexpr,
                  UPCAST: tl.constexpr):  # fmt: skip
    """One block of keys into the running (max, sum, output) of an online softmax."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(pmask[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked block
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:  # p rounded to the cache dtype as on the tensor-core path
        pv = tl.dot(p.to(cache_dt).to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, table_ptr, lens_ptr, mid_o_ptr, mid_lse_ptr,
    s_qb, s_qh, s_cb, s_cs, s_ch, s_tb,
    scale, window, block_size, num_heads, n_splits,
    GROUP: tl.constexpr, G_P: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
    BLOCK: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # first key in the window
    start = sp * SPLIT
    end = tl.minimum(start + SPLIT, ctx)
    g = tl.arange(0, G_P)
    d = tl.arange(0, D_P)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * s_qb + heads[:, None] * s_qh + d[None, :],
        mask=gmask[:, None] & dmask[None, :], other=0.0,
    )  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([G_P], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P], tl.float32)
    acc = tl.zeros([G_P, D_P], tl.float32)
    if start < end:  # splits past the context (a graph's grid is sized for the longest) stop here
        for i in range(0, SPLIT // BLOCK):  # a constant trip count: the interpreter needs one
            pos = start + i * BLOCK + tl.arange(0, BLOCK)
            pmask = (pos < end) & (pos >= lo)
            blk = tl.load(table_ptr + b * s_tb + pos // block_size, mask=pmask, other=0)
            off = blk.to(tl.int64) * s_cb + (pos % block_size) * s_cs + kvh * s_ch
            kv_mask = pmask[:, None] & dmask[None, :]
            k = tl.load(kc_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            m_i, l_i, acc = _attend_block(
                q, k, v, pmask, m_i, l_i, acc, scale, vc_ptr.dtype.element_ty, IEEE, UPCAST
            )
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    row = (b * num_heads + heads) * n_splits + sp
    tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + d[None, :], out,
             mask=gmask[:, None] & dmask[None, :])  # fmt: skip
    tl.store(mid_lse_ptr + row, lse, mask=gmask)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, s_ob, s_oh, num_heads, n_splits,
    HEAD_DIM: tl.constexpr, D_P: tl.constexpr, S_P: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_P)
    d = tl.arange(0, D_P)
    row = (b * num_heads + h) * n_splits + s
    smask = s < n_splits
    lse = tl.load(mid_lse_ptr + row, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # 0 for splits that saw no keys
    o = tl.load(mid_o_ptr + row[:, None] * HEAD_DIM + d[None, :],
                mask=smask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
    total = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + b * s_ob + h * s_oh + d, res.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)  # fmt: skip


def num_splits(max_context: int, split_len: int = SPLIT_LEN) -> int:
    return max(1, triton.cdiv(max_context, split_len))


def paged_decode(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    max_context: int,
    split_len: int = SPLIT_LEN,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over its paged context.

    q: [b, heads, head_dim]; kc/vc: one layer's cache views; block_tables: [b, >= blocks of
    the longest context]; context_lens: [b] keys per sequence (0 for padding rows: output 0);
    `max_context`: a host-side bound on context_lens (sets the grid). `split_len` / `block_n`:
    context tokens per program / keys per inner iteration (powers of two, block_n dividing
    split_len; by default `default_block_n(head_dim)`); `num_warps`: the split kernel's
    (Triton's default, 4, when None); the GPU run's kernel sweep tries others. Returns
    [b, heads, head_dim] in q's dtype."""
    b, heads, dim = q.shape
    kv_heads = kc.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not split over {kv_heads} KV heads")
    _check_last_dim(q, kc, vc)
    out = torch.empty(b, heads, dim, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    block_n = default_block_n(dim) if block_n is None else block_n
    if split_len % block_n or block_n < 16:
        raise ValueError(f"block_n {block_n} must be >= 16 and divide split_len {split_len}")
    splits = num_splits(max_context, split_len)
    mid_o = torch.empty(b, heads, splits, dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(b, heads, splits, dtype=torch.float32, device=q.device)
    group = heads // kv_heads
    _decode_split_kernel[(b, kv_heads, splits)](
        q, kc, vc, block_tables, context_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        block_tables.stride(0),
        scale, sliding_window or 0, kc.shape[1], heads, splits,
        GROUP=group, G_P=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim,
        D_P=max(16, triton.next_power_of_2(dim)), BLOCK=block_n, SPLIT=split_len,
        IEEE=q.dtype == torch.float32 or INTERPRETED, UPCAST=INTERPRETED,
        **({} if num_warps is None else {"num_warps": num_warps}),
    )  # fmt: skip
    _decode_merge_kernel[(b, heads)](
        mid_o, mid_lse, out, out.stride(0), out.stride(1), heads, splits,
        HEAD_DIM=dim, D_P=triton.next_power_of_2(dim), S_P=triton.next_power_of_2(splits),
    )  # fmt: skip
    return out


def _check_last_dim(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("the head dimension must be contiguous")
