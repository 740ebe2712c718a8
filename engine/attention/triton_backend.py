"""The CUDA attention backend: Triton kernels over the paged cache, safe to capture as a graph.

K/V of the step's tokens go into the cache with one Triton kernel per layer; decodes attend
through the paged decode kernel, which reads the blocks in place (no per-step gather). A
decode-only step touches nothing but tensors (slot mapping, block tables, context lengths) and
one host-side bound on the context length, so `engine.cuda_graphs` captures it once per batch
size and replays it. Prefill chunks, which never run inside a graph, use the reference
backend's SDPA path one sequence at a time. FP8 KV caches stay on the reference backend
(`select_backend`).
"""

from __future__ import annotations

import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels import triton_attention as kernels
from engine.kv_cache import KVCache
from engine.model_runner import get_forward_context


class TritonAttentionBackend(TorchAttentionBackend):
    name = "triton"
    graph_safe = True  # decode-only steps may be captured as CUDA graphs

    def __init__(self, scale: float, sliding_window: int | None = None):
        super().__init__(scale, sliding_window, cpu_kernel=False)

    def forward(self, layer, q, k, v, cache: KVCache, attn=None) -> torch.Tensor:
        if cache.scales is not None:
            raise ValueError("the triton backend does not read FP8 KV caches")
        attn = self.layer_attention(attn)  # plain numbers: captured into a graph as constants
        meta = get_forward_context()
        kc, vc, _, _ = cache.layer_views(layer)
        kernels.write_kv(k, v, kc, vc, meta.slot_mapping)
        if not meta.prefill_idx:  # decode-only: rows 0..n-1 in order, tensors only
            return kernels.paged_decode(
                q, kc, vc, meta.block_tables, meta.decode_context_lens, attn.scale,
                attn.window, max(meta.context_lens),
            )  # fmt: skip
        out = torch.empty_like(q)
        plan = self._decode_plan(meta, cache.spec.block_size, q.device)
        if plan is not None:
            rows = plan.rows if plan.rows is not None else slice(0, plan.tables.shape[0])
            out[rows] = kernels.paged_decode(
                q[rows], kc, vc, plan.tables, plan.lens, attn.scale, attn.window,
                max(meta.context_lens),
            )  # fmt: skip
        for i in meta.prefill_idx:
            self._prefill_one(layer, i, (q, k, v, out), cache, meta, attn)
        return out
