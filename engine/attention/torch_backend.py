"""Reference attention in plain PyTorch (CPU and GPU), over the paged cache.

Decodes (one new token) are batched: their K/V is gathered through the block tables into a
padded [seqs, kv_len] view and one SDPA call with a length mask covers them all. Prefill
chunks run one sequence at a time; a chunk with no cached prefix attends to its own fresh K/V
(no gather), otherwise to the gathered cache with a causal mask offset by the cached length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.forward_context import get_forward_context
from engine.kv_cache import KVCache


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, scale: float, sliding_window: int | None = None):
        self.scale = scale
        self.sliding_window = sliding_window

    def forward(self, layer, q, k, v, cache: KVCache) -> torch.Tensor:
        meta = get_forward_context()
        cache.write(layer, meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        if meta.decode_idx.numel():
            self._decode(layer, q, out, cache, meta)
        for i in meta.prefill_idx:
            self._prefill_one(layer, i, q, k, v, out, cache, meta)
        return out

    def _decode(self, layer, q, out, cache, meta) -> None:
        idx = meta.decode_idx
        rows = torch.as_tensor([meta.query_start[i] for i in idx.tolist()], device=q.device)
        tables = meta.block_tables[idx]
        kb, vb = cache.gather(layer, tables, q.dtype)  # [b, blocks, bs, h, d]
        b = kb.shape[0]
        kb = kb.reshape(b, -1, kb.shape[-2], kb.shape[-1]).transpose(1, 2)
        vb = vb.reshape(b, -1, vb.shape[-2], vb.shape[-1]).transpose(1, 2)
        pos = torch.arange(kb.shape[2], device=q.device)
        lens = meta.decode_context_lens
        mask = pos[None, :] < lens[:, None]
        if self.sliding_window is not None:
            mask &= pos[None, :] > (lens[:, None] - 1 - self.sliding_window)
        qd = q[rows].unsqueeze(2)  # [b, h, 1, d]
        o = F.scaled_dot_product_attention(
            qd, kb, vb, attn_mask=mask[:, None, None, :], scale=self.scale,
            enable_gqa=qd.shape[1] != kb.shape[1],
        )
        out[rows] = o.squeeze(2)

    def _prefill_one(self, layer, i, q, k, v, out, cache, meta) -> None:
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
        gqa = qs.shape[0] != ks.shape[0]
        if computed == 0 and self.sliding_window is None:
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=gqa
            )
        else:
            qpos = torch.arange(computed, ctx, device=q.device)[:, None]
            kpos = torch.arange(ctx, device=q.device)[None, :]
            mask = kpos <= qpos
            if self.sliding_window is not None:
                mask &= kpos > qpos - self.sliding_window
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=gqa
            )
        out[start:end] = o.transpose(0, 1)
