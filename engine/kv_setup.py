"""One rank's KV cache and attention backend, built the same way by rank 0 (LLMEngine) and the
other tensor-parallel ranks (engine.distributed): `kv_spec_for`, then `build_kv`. Its own
module because the attention backends import the model runner (its forward context)."""

from __future__ import annotations

import torch

from engine.attention import select_backend
from engine.kv_cache import KVCache, KVCacheSpec


def kv_spec_for(config, mc, shard, dtype: torch.dtype) -> KVCacheSpec:
    """One rank's KVCacheSpec, as rank 0 (LLMEngine) and the other ranks (engine.distributed)
    both build it: the rank's own KV heads, and the model's whole head layout (the transfer
    compares the total, and maps head slices between pools of other TP sizes). `config` is an
    EngineConfig or its fields; `shard` the rank's engine.models.parallel.Shard, None
    without TP."""
    return KVCacheSpec(
        model=mc.architecture,
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads if shard is None else shard.num_kv_heads,
        head_dim=mc.head_dim,
        block_size=config.block_size,
        dtype=dtype,
        kv_dtype=config.kv_dtype,
        total_kv_heads=mc.num_kv_heads,
        kv_head_start=0 if shard is None else shard.kv_head_start,
        tp_size=1 if shard is None else shard.size,
    )


def build_kv(spec: KVCacheSpec, config, mc, device: torch.device, num_blocks: int):
    """(KVCache, attention backend) of one rank, built the same way on every rank."""
    cache = KVCache(spec, num_blocks, device)
    backend = select_backend(
        config.attention_backend, device, mc.head_dim**-0.5, mc.sliding_window, config.kv_dtype
    )
    return cache, backend


def auto_num_blocks(spec: KVCacheSpec, config, device: torch.device, max_model_len: int) -> int:
    """KV blocks when the config names none: 85% of free GPU memory, or the CPU budget
    (`kv_cache_memory_gb`, default 1 GiB); never more than the batch could ever use."""
    per_block = KVCache.bytes_per_block(spec)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * 0.85)
    else:
        budget = int((config.kv_cache_memory_gb or 1.0) * 2**30)
    per_seq = -(-max_model_len // config.block_size)
    cap = config.max_num_seqs * per_seq + 1
    return max(1, min(budget // per_block, cap))
