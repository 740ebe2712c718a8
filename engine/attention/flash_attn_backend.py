"""flash-attn backend (CUDA only, optional `gpu` extra).

Prefill chunks use `flash_attn_varlen_func` over the batch's fresh K/V when nothing is cached,
else over K/V gathered from the paged cache. Decodes use `flash_attn_with_kvcache` with the
block table when the block size is a multiple of 256 (upstream flash-attn's paged-KV
constraint); with smaller blocks they fall back to a gathered varlen call. FP8 KV is
dequantized on gather (flash-attn 2 has no FP8 input path).

Not exercised in CI (no GPU there); the torch backend is the reference it must match.
"""

from __future__ import annotations

import torch

from engine.attention.params import LayerAttention
from engine.kv_cache import KVCache
from engine.model_runner import get_forward_context


def _window(window: int | None) -> tuple[int, int]:
    """flash-attn's (left, right) bounds for a window of `window` keys (None: unbounded)."""
    return (window - 1, 0) if window else (-1, -1)


class FlashAttentionBackend:
    name = "flash_attn"

    def __init__(self, scale: float, sliding_window: int | None = None):
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self.scale = scale
        self.sliding_window = sliding_window
        self._default_attention = LayerAttention(scale, sliding_window)  # built once, not per layer

    def forward(self, layer, q, k, v, cache: KVCache, attn=None) -> torch.Tensor:
        if attn is None:
            attn = self._default_attention
        scale, window = attn.scale, _window(attn.window)
        meta = get_forward_context()
        cache.write(layer, meta.slot_mapping, k, v)
        bs = cache.spec.block_size
        n = len(meta.num_computed)
        all_decode = meta.decode_idx.numel() == n
        if all_decode and bs % 256 == 0 and cache.scales is None:
            kc, vc, _, _ = cache.layer_views(layer)
            lens = meta.decode_context_lens.to(torch.int32)
            o = self._with_kvcache(
                q.unsqueeze(1),
                kc,
                vc,
                cache_seqlens=lens,
                block_table=meta.block_tables.to(torch.int32),
                softmax_scale=scale,
                causal=True,
                window_size=window,
            )
            return o.squeeze(1)
        # General path: gather each sequence's context into one packed varlen batch.
        ks, vs, cu_k = [], [], [0]
        for i in range(n):
            start, end = meta.query_start[i], meta.query_start[i + 1]
            if meta.num_computed[i] == 0:
                ks.append(k[start:end])
                vs.append(v[start:end])
            else:
                ctx = meta.context_lens[i]
                kb, vb = cache.gather(layer, meta.block_tables[i, : -(-ctx // bs)], q.dtype)
                ks.append(kb.reshape(-1, *kb.shape[-2:])[:ctx])
                vs.append(vb.reshape(-1, *vb.shape[-2:])[:ctx])
            cu_k.append(cu_k[-1] + ks[-1].shape[0])
        dev = q.device
        cu_q = torch.tensor(meta.query_start, dtype=torch.int32, device=dev)
        cu_kt = torch.tensor(cu_k, dtype=torch.int32, device=dev)
        qlens = [meta.query_start[i + 1] - meta.query_start[i] for i in range(n)]
        return self._varlen(
            q,
            torch.cat(ks),
            torch.cat(vs),
            cu_q,
            cu_kt,
            max(qlens),
            max(cu_k[i + 1] - cu_k[i] for i in range(n)),
            softmax_scale=scale,
            causal=True,
            window_size=window,
        )
