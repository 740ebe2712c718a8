"""Greedy output must equal Hugging Face transformers' `generate` token for token (fp32, same
weights), for every architecture, with mixed prompt lengths in one call, with chunked prefill
on and off, with prefix-cache hits, and under preemption."""

from __future__ import annotations

import functools

import pytest
import torch

from engine import LLM, SamplingParams

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3"]
LENGTHS = [1, 2, 5, 15, 16, 17, 33, 64, 100, 150]
MAX_TOKENS = [12, 20, 8, 24, 16, 10, 18, 14, 22, 9]


def _prompts(seed: int = 0, lengths=LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


@functools.cache
def _hf_model(path: str, ignore_eos: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if ignore_eos:
        # Not min_new_tokens: that masks EOS out of the logits, which would change the argmax.
        model.generation_config.eos_token_id = None
    return model


def hf_greedy(path, prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> list[int]:
    model = _hf_model(str(path), ignore_eos)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def _check(llm: LLM, path, prompts, max_tokens) -> list:
    free0 = llm.engine.block_manager.num_free_blocks
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts, params)
    for p, m, o in zip(prompts, max_tokens, outs, strict=True):
        assert o.token_ids == hf_greedy(path, p, m), f"prompt of {len(p)} tokens diverged"
        assert o.finish_reason == "length"
        assert o.prompt_token_ids == p
    assert llm.engine.block_manager.num_free_blocks == free0
    return outs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_greedy_matches_hf(make_tiny_model, arch, chunked):
    path = make_tiny_model(arch)
    llm = LLM(
        path,
        dtype="float32",
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=48,
        enable_prefix_caching=False,
    )
    _check(llm, path, _prompts(), MAX_TOKENS)
    assert llm.engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_match_hf(make_tiny_model, arch):
    path = make_tiny_model(arch)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64, enable_prefix_caching=True)
    shared = _prompts(seed=1, lengths=[50])[0]
    tails = _prompts(seed=2, lengths=[1, 7, 16, 30, 3, 19, 40, 11])
    prompts = [shared + t for t in tails]
    # First call fills the cache; the second call's prompts share 3 full blocks with it.
    _check(llm, path, prompts[:1], [10])
    outs = _check(llm, path, prompts, [10, 14, 8, 12, 16, 9, 11, 13])
    assert all(o.num_cached_tokens >= 48 for o in outs)
    # Exactly the same prompt again: served from cache except its last block.
    again = _check(llm, path, [prompts[3]], [12])
    assert again[0].num_cached_tokens == (len(prompts[3]) - 1) // 16 * 16


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_matches_hf(make_tiny_model, arch):
    path = make_tiny_model(arch)
    # 20 blocks x 16 slots cannot hold 8 sequences of ~60-90 tokens at once.
    llm = LLM(path, dtype="float32", num_kv_blocks=20, max_num_batched_tokens=64)
    prompts = _prompts(seed=3, lengths=[40, 45, 50, 35, 60, 42, 38, 55])
    _check(llm, path, prompts, [24, 20, 30, 26, 18, 28, 22, 25])
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_stops_like_hf(make_tiny_model, arch):
    path = make_tiny_model(arch)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64)
    prompts = _prompts(seed=3, lengths=[40, 45, 50, 35, 60, 42, 38, 55])
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0))
    for p, o in zip(prompts, outs, strict=True):
        ref = hf_greedy(path, p, 40, ignore_eos=False)
        assert o.token_ids == ref
        assert o.finish_reason == (
            "stop" if ref[-1] in llm.engine.model_config.eos_token_ids else "length"
        )


def test_text_prompt_and_stop_token(make_tiny_model):
    path = make_tiny_model("llama")
    llm = LLM(path, dtype="float32")
    full = llm.generate(
        ["hello world, this is tandem"],
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    )[0]
    assert full.text == llm.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = full.token_ids[5]
    cut = llm.generate(
        ["hello world, this is tandem"],
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop,), ignore_eos=True),
    )[0]
    first = full.token_ids.index(stop)
    assert cut.token_ids == full.token_ids[: first + 1]
    assert cut.finish_reason == "stop"
    assert full.ttft is not None and full.ttft > 0 and full.tpot is not None and full.tpot > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_torch_reference_decode_matches_hf(make_tiny_model, arch):
    """The engine's torch decode path (what runs where the CPU kernels cannot be built) stays
    token-exact too: the compiled paged decode is swapped out for the gather reference."""
    path = make_tiny_model(arch)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=48, enable_prefix_caching=False)
    llm.engine.backend._kernel = None
    _check(llm, path, _prompts(seed=3), MAX_TOKENS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rope_rotation_is_hfs_formula_bit_for_bit(dtype):
    """`rope.rotate` skips building rotate_half(x) but must round exactly as HF's
    `x * cos + rotate_half(x) * sin` does, on a strided view of the projection output."""
    from transformers.models.llama.modeling_llama import rotate_half

    from engine.models.rope import rotate

    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        qkv = (torch.randn(37, 12, 128, generator=g) * 40).to(dtype)
        x = qkv[:, :10]  # q and k heads of a fused projection: not contiguous
        cos, sin = (torch.randn(37, 1, 128, generator=g).to(dtype) for _ in range(2))
        assert torch.equal(rotate(x, cos, sin), x * cos + rotate_half(x) * sin)
