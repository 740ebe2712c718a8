"""FP8 (e4m3) KV cache: the cache stores float8 with per-token, per-head scales, a block takes
half the bytes, attention reads it dequantized, and output stays close to the exact model."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.kv_cache import KVCache, KVCacheSpec


def test_fp8_block_is_half_the_bytes_plus_scales():
    kw = dict(
        model="LlamaForCausalLM",
        num_layers=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.bfloat16,
    )
    bf16, fp8 = KVCacheSpec(**kw), KVCacheSpec(**kw, kv_dtype="fp8_e4m3")
    assert fp8.block_bytes * 2 == bf16.block_bytes
    assert fp8.scale_block_bytes == 4 * 2 * 16 * 2 * 4  # one fp32 per token, head, k/v, layer
    assert fp8.compat_hash() != bf16.compat_hash()


def test_fp8_roundtrip_error_is_small():
    spec = KVCacheSpec("LlamaForCausalLM", 1, 2, 32, 4, torch.float32, kv_dtype="fp8_e4m3")
    cache = KVCache(spec, num_blocks=3)
    k, v = torch.randn(6, 2, 32) * 3, torch.randn(6, 2, 32)
    slots = torch.tensor([4, 5, 6, 7, 8, 9])
    cache.write(0, slots, k, v)
    assert cache.data.dtype == torch.float8_e4m3fn
    kb, vb = cache.gather(0, torch.tensor([1, 2]), torch.float32)
    got_k = kb.reshape(-1, 2, 32)[:6]
    rel = (got_k - k).abs().max() / k.abs().max()
    assert rel < 0.07  # e4m3 keeps 3 mantissa bits: <= 1/16 relative step


def test_fp8_kv_generation_tracks_the_exact_cache(make_tiny_model):
    path = make_tiny_model("llama")
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 20, 40, 70)]
    exact = LLM(path, dtype="float32").generate(prompts, sp)
    llm = LLM(path, dtype="float32", kv_dtype="fp8_e4m3")
    free = llm.engine.block_manager.num_free_blocks
    fp8 = llm.generate(prompts, sp)
    assert llm.engine.cache.scales is not None
    assert llm.engine.block_manager.num_free_blocks == free
    # The first token comes from the prefill's own K/V: identical. Later ones read FP8 KV.
    assert [o.token_ids[0] for o in fp8] == [o.token_ids[0] for o in exact]
    same = sum(
        a == b
        for x, y in zip(exact, fp8, strict=True)
        for a, b in zip(x.token_ids, y.token_ids, strict=True)
    )
    assert same / sum(len(o.token_ids) for o in exact) > 0.5
