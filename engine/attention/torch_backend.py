"""Reference attention in plain PyTorch (CPU and GPU), over the paged cache.

Decodes (one new token) are batched: their K/V is gathered through the block tables into a
padded [seqs, kv_len] view and one SDPA call with a length mask covers them all. What the
decodes need besides K/V (rows, trimmed block tables, the mask) is built once per step and
reused by every layer. Prefill chunks run one sequence at a time; a chunk with no cached prefix
attends to its own fresh K/V (no gather), otherwise to the gathered cache with a causal mask
offset by the cached length.

Every path takes the layer's scale and window (`LayerAttention`, the backend's own unless the
layer passes its own: Gemma 3); the decodes' masks are built once per step and window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine import kernels
from engine.attention.params import LayerAttention
from engine.kv_cache import KVCache
from engine.model_runner import AttentionMetadata, get_forward_context


@dataclass(slots=True)
class DecodePlan:
    """What every layer's batched decode needs, derived once per step (not once per layer)."""

    rows: torch.Tensor | None  # query rows of the decodes; None when they are rows 0..n-1
    tables: torch.Tensor  # [b, blocks] block ids, trimmed to the longest decode context
    ctx: int  # keys to attend to when b == 1 (then no mask is needed)
    lens: torch.Tensor  # [b] int64 keys per decode (the new token's included)
    keys: int  # key slots of the gathered view (blocks x block size)
    uses_mask: bool  # the decodes attend through masks (GPU SDPA, the CPU gather reference)
    masks: dict = field(default_factory=dict)  # window -> mask, built on first use

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[b, 1, 1, keys] bool: the keys each decode sees within `window`; None where no mask
        is needed (the CPU kernel, or one sequence without a window: its keys are cut)."""
        if not self.uses_mask or (self.tables.shape[0] == 1 and window is None):
            return None
        if window not in self.masks:
            pos = torch.arange(self.keys, device=self.lens.device)
            m = pos[None, :] < self.lens[:, None]
            if window is not None:
                m &= pos[None, :] > (self.lens[:, None] - 1 - window)
            self.masks[window] = m[:, None, None, :]
        return self.masks[window]


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, scale: float, sliding_window: int | None = None, cpu_kernel: bool = True):
        self.scale = scale
        self.sliding_window = sliding_window
        # Built once: a model that passes no per-layer attention reads this on every layer
        # of every step.
        self._default_attention = LayerAttention(scale, sliding_window)
        # The compiled paged decode for CPU (None: the gather reference below is used).
        self._kernel = kernels.get("paged_decode") if cpu_kernel else None
        self._cache_write = kernels.get("cache_write") if cpu_kernel else None
        self._plan_meta: AttentionMetadata | None = None
        self._plan: DecodePlan | None = None
        self._blocks: torch.Tensor | None = None  # the step's slots split for KVCache.write_at
        self._offsets: torch.Tensor | None = None

    def layer_attention(self, attn: LayerAttention | None) -> LayerAttention:
        """The scale and window a call attends with: the layer's, else the backend's."""
        return attn if attn is not None else self._default_attention

    def forward(self, layer, q, k, v, cache: KVCache, attn=None) -> torch.Tensor:
        attn = self.layer_attention(attn)
        meta = get_forward_context()
        plan = self._decode_plan(meta, cache.spec.block_size, q.device)
        if self._cache_write is not None and cache.scales is None and k.dtype == cache.data.dtype:
            kc, vc, _, _ = cache.layer_views(layer)
            self._cache_write(kc, vc, self._blocks, self._offsets, k, v)
        else:
            cache.write_at(layer, self._blocks, self._offsets, k, v)
        if plan is not None and plan.rows is None and not meta.prefill_idx:
            return self._decode(layer, q, cache, plan, attn)  # decode-only step: no scatter
        out = torch.empty_like(q)
        if plan is not None:
            qd = q[: plan.tables.shape[0]] if plan.rows is None else q[plan.rows]
            o = self._decode(layer, qd, cache, plan, attn)
            if plan.rows is None:
                out[: o.shape[0]] = o
            else:
                out[plan.rows] = o
        for i in meta.prefill_idx:
            self._prefill_one(layer, i, (q, k, v, out), cache, meta, attn)
        return out

    def stack_args(self, cache: KVCache, dtype: torch.dtype, rows: int) -> tuple | None:
        """What the C++ layer loop (engine.models.decode_stack) needs for this step, or None
        when `forward` would not take the decode-only CPU kernel path in every layer (then the
        layers run in Python): (cache data, blocks, offsets, tables, lens, scale, window)."""
        if self._kernel is None or self._cache_write is None or cache.scales is not None:
            return None
        if cache.data.dtype != dtype or cache.data.device.type != "cpu":
            return None
        meta = get_forward_context()
        plan = self._decode_plan(meta, cache.spec.block_size, cache.data.device)
        if plan is None or plan.rows is not None or meta.prefill_idx:
            return None
        if plan.tables.shape[0] != rows:
            return None
        window = self.sliding_window or 0
        return cache.data, self._blocks, self._offsets, plan.tables, plan.lens, self.scale, window

    def _decode_plan(self, meta: AttentionMetadata, bs: int, device) -> DecodePlan | None:
        if meta is self._plan_meta:
            return self._plan
        self._blocks, self._offsets = meta.slot_mapping // bs, meta.slot_mapping % bs
        plan = None
        if meta.decode_idx.numel():
            idx = meta.decode_idx.tolist()
            rows = [meta.query_start[i] for i in idx]
            lens = [meta.context_lens[i] for i in idx]
            nblocks = -(-max(lens) // bs)
            contiguous = rows == list(range(len(rows)))
            if contiguous and len(idx) == meta.block_tables.shape[0]:
                tables = meta.block_tables[:, :nblocks]
            else:
                tables = meta.block_tables[meta.decode_idx, :nblocks]
            plan = DecodePlan(
                rows=None if contiguous else torch.tensor(rows, device=device),
                tables=tables,
                ctx=lens[0],
                lens=meta.decode_context_lens,
                keys=nblocks * bs,
                uses_mask=device.type != "cpu" or self._kernel is None,
            )
        self._plan_meta, self._plan = meta, plan
        return plan

    def _decode(self, layer, qd, cache: KVCache, plan: DecodePlan, attn) -> torch.Tensor:
        """qd: [b, heads, head_dim], one query per sequence. Returns the same shape."""
        dt = qd.dtype
        if qd.device.type == "cpu":
            return self._decode_cpu(layer, qd, cache, plan, attn).to(dt)
        kb, vb = cache.gather(layer, plan.tables, dt)  # [b, blocks, bs, h, d]
        b, h, d = kb.shape[0], kb.shape[-2], kb.shape[-1]
        kb = kb.reshape(b, -1, h, d)
        vb = vb.reshape(b, -1, h, d)
        mask = plan.mask(attn.window)
        if mask is None:  # a single sequence: attend to exactly its keys
            kb, vb = kb[:, : plan.ctx], vb[:, : plan.ctx]
        o = F.scaled_dot_product_attention(
            qd.unsqueeze(2),
            kb.transpose(1, 2),
            vb.transpose(1, 2),
            attn_mask=mask,
            scale=attn.scale,
            enable_gqa=qd.shape[1] != h,
        )
        return o.squeeze(2)

    def _decode_cpu(self, layer, qd, cache: KVCache, plan: DecodePlan, attn) -> torch.Tensor:
        if self._kernel is not None:  # reads the blocks in place: no gather, no copies
            k, v, ks, vs = cache.layer_views(layer)
            if qd.dtype not in (torch.float32, torch.bfloat16):  # the kernel takes these two
                qd = qd.float()
            return self._kernel(  # output in q's dtype
                qd, k, v, ks, vs, plan.tables, plan.lens, attn.scale, attn.window or 0
            )
        return self._decode_cpu_gather(layer, qd, cache, plan, attn)

    def _decode_cpu_gather(self, layer, qd, cache: KVCache, plan: DecodePlan, attn):
        """Decode attention as two fp32 batched matmuls over gathered K/V. On CPU, SDPA's
        one-query-per-sequence case is slow (and slower still in bf16, which these CPUs
        emulate): measured 2-7x."""
        f32 = torch.float32
        kb, vb = cache.gather(layer, plan.tables, cache.data.dtype if cache.scales is None else f32)
        b, h, d = kb.shape[0], kb.shape[-2], kb.shape[-1]
        kb = kb.view(b, -1, h, d)
        vb = vb.view(b, -1, h, d)
        mask = plan.mask(attn.window)
        if mask is None:
            kb, vb = kb[:, : plan.ctx], vb[:, : plan.ctx]
        # One copy each: heads to the front (so every matmul operand is a plain or transposed
        # contiguous matrix, with no hidden copies inside matmul) and up to fp32.
        keys = kb.shape[1]
        k = torch.empty(b, h, keys, d, dtype=f32).copy_(kb.transpose(1, 2))
        v = torch.empty(b, h, keys, d, dtype=f32).copy_(vb.transpose(1, 2))
        q = qd.to(f32).reshape(b, h, -1, d)  # query heads grouped by their kv head (GQA)
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(attn.scale)  # [b, h, g, keys]
        if mask is not None:
            scores.masked_fill_(~mask, float("-inf"))
        probs = scores.softmax(-1)
        return torch.matmul(probs, v).view(b, -1, d)  # [b, heads, d]

    def _prefill_one(self, layer, i, qkvo, cache, meta, attn: LayerAttention) -> None:
        """Sequence i's chunk of the step: its queries over its keys, into out's rows."""
        q, k, v, out = qkvo
        start, end = meta.query_start[i], meta.query_start[i + 1]
        computed, ctx = meta.num_computed[i], meta.context_lens[i]
        qs = q[start:end].transpose(0, 1)  # [h, n, d]
        if computed == 0:
            ks, vs = k[start:end], v[start:end]
        else:
            nblocks = -(-ctx // cache.spec.block_size)
            kb, vb = cache.gather(layer, meta.block_tables[i, :nblocks], q.dtype)
            ks = kb.reshape(-1, kb.shape[-2], kb.shape[-1])[:ctx]
            vs = vb.reshape(-1, vb.shape[-2], vb.shape[-1])[:ctx]
        ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)
        if q.device.type == "cpu" and q.dtype != torch.float32:
            # CPUs without bf16 instructions emulate bf16 SDPA several times slower than fp32;
            # the math is fp32 inside either way, so up-cast the inputs and round the output.
            qs, ks, vs = qs.float(), ks.float(), vs.float()
        gqa = qs.shape[0] != ks.shape[0]
        # A batch dim of 1: with 3-D inputs CPU SDPA takes its unfused "math" path, which
        # materialises the whole score matrix (measured 16x slower at 256 tokens).
        qs, ks, vs = qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0)
        if computed == 0 and attn.window is None:
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=attn.scale, enable_gqa=gqa
            )
        else:
            qpos = torch.arange(computed, ctx, device=q.device)[:, None]
            kpos = torch.arange(ctx, device=q.device)[None, :]
            mask = kpos <= qpos
            if attn.window is not None:
                mask &= kpos > qpos - attn.window
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, scale=attn.scale, enable_gqa=gqa
            )
        out[start:end] = o[0].transpose(0, 1).to(out.dtype)
