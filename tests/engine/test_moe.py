"""Sparse mixture-of-experts decoders (engine/models/moe.py): Mixtral and Qwen3-MoE, kept out
of the suites every architecture runs (test_parity_hf and the others iterate
tools.make_model.ARCHS; these are MOE_ARCHS). The routing (top-k, each family's weights and
dtype) equals transformers' MoE block on random hidden states; greedy fp32 output equals
transformers token for token in mixed batches, one prompt at a time, chunked, from a prefix
cache, past a Mixtral sliding window, on the torch ops and at TP 2; logprobs equal its
log-softmax; Qwen3-MoE's dense layers are where transformers puts them; transformers 5's 3-D
expert tensors load as the per-expert ones do; int8 / FP8 quantize every expert and keep the
router exact; and what the engine does not compute is refused by name."""

from __future__ import annotations

import dataclasses

import fp8_checkpoints as fc
import pytest
import torch
from checkpoint_variants import (
    check_greedy,
    check_logprobs,
    header_only_gguf,
    random_prompts,
    variant,
)
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.gguf_file import GGUFError
from engine.models import MoECausalLM, decode_stack
from engine.models.linear import Linear
from engine.models.moe import SparseMoE
from engine.models.parallel import check_tp

ARCHS = ("mixtral", "qwen3_moe")
LENGTHS = [1, 5, 17, 40, 70]
HF_BLOCKS = {
    "mixtral": ("mixtral", "MixtralSparseMoeBlock"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
}


@pytest.fixture(scope="module", params=ARCHS)
def moe(request, make_tiny_model):
    return request.param, make_tiny_model(request.param)


def _llm(path, **settings) -> LLM:
    base = {"dtype": "float32", "max_num_batched_tokens": 32, "enable_prefix_caching": False}
    return LLM(path, **{**base, **settings})


def test_config_reads_the_experts(make_tiny_model):
    mixtral = ModelConfig.from_pretrained(make_tiny_model("mixtral")).moe
    assert (mixtral.num_experts, mixtral.top_k, mixtral.intermediate_size) == (8, 2, 256)
    assert mixtral.renormalize and not mixtral.weights_in_activation_dtype
    assert mixtral.sparse_layers == (True, True)
    qwen = ModelConfig.from_pretrained(make_tiny_model("qwen3_moe"))
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.intermediate_size) == (8, 3, 96)
    assert not qwen.moe.renormalize and qwen.moe.weights_in_activation_dtype
    assert qwen.moe.sparse_layers == (True, False, True) and qwen.intermediate_size == 384
    assert qwen.qk_norm and qwen.head_dim == 48 and qwen.sliding_window is None


@pytest.mark.parametrize("arch", ARCHS)
def test_make_model_counts_the_experts(arch):
    from transformers import AutoModelForCausalLM

    from tools.make_model import build_config, model_shape

    shape = model_shape(arch, "tiny")
    hf = AutoModelForCausalLM.from_config(build_config(shape))
    assert sum(p.numel() for p in hf.parameters()) == shape.num_parameters()


def _hf_block(arch: str, path, dtype, **change):
    """transformers' own MoE block of `arch` (its eager expert loop) with random weights."""
    import importlib

    from transformers import AutoConfig

    module, name = HF_BLOCKS[arch]
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    config = AutoConfig.from_pretrained(path, **change)
    config._experts_implementation = "eager"
    block = getattr(mod, name)(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5 * 2)
    return block.to(dtype).eval(), config


def _our_block(block, cfg: ModelConfig, dtype) -> SparseMoE:
    with torch.device("cpu"):
        ours = SparseMoE(cfg).to(dtype).eval()
    with torch.no_grad():
        ours.gate.weight.copy_(block.gate.weight)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(block.experts.gate_up_proj[e])
            expert.down_proj.weight.copy_(block.experts.down_proj[e])
    return ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("arch", "change"),
    [("mixtral", {}), ("qwen3_moe", {}), ("qwen3_moe", {"norm_topk_prob": True})],
    ids=["mixtral", "qwen3_moe", "qwen3_moe-norm_topk_prob"],
)
def test_routing_and_block_equal_transformers(make_tiny_model, tmp_path, arch, change, dtype):
    """On random hidden states: the experts chosen, their weights (renormalised or not, in
    the dtype the family weights in) and the block's output equal transformers' MoE block;
    the data tells the rules apart (flipping renormalisation moves transformers' output)."""
    path = variant(make_tiny_model(arch), tmp_path / "m", weights=False, **change)
    block, _ = _hf_block(arch, path, dtype)
    cfg = ModelConfig.from_pretrained(path)
    ours = _our_block(block, cfg, dtype)
    x = (torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(1))).to(dtype)
    with torch.no_grad():
        _, ref_weights, ref_experts = block.gate(x)
        weights, experts = ours.route(x)
        assert torch.equal(experts, ref_experts)
        assert (
            weights.dtype == ref_weights.dtype == (dtype if arch == "qwen3_moe" else torch.float32)
        )
        assert torch.equal(weights, ref_weights)
        if cfg.moe.renormalize:
            torch.testing.assert_close(weights.float().sum(-1), torch.ones(64), atol=1e-2, rtol=0)
        else:
            assert float(weights.float().sum(-1).min()) < 0.9  # the softmax's own values
        out, ref = ours(x), block(x[None])[0]
        assert out.dtype == dtype
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-6 if dtype == torch.float32 else 0)
    if arch == "qwen3_moe":
        flipped, _ = _hf_block(arch, path, dtype, norm_topk_prob=not cfg.moe.renormalize)
        with torch.no_grad():
            assert (flipped(x[None])[0] - ref).abs().max() > 1e-2


@pytest.mark.parametrize("mode", ["batched-chunked", "one-at-a-time"])
def test_greedy_equals_transformers(moe, mode):
    """Prompts of 1-70 tokens in one batch with a 32-token budget (chunked prefill beside
    decodes), or each alone and whole."""
    _, path = moe
    prompts = random_prompts(LENGTHS)
    llm = _llm(path, enable_chunked_prefill=mode == "batched-chunked")
    if mode == "batched-chunked":
        check_greedy(llm, path, prompts, max_tokens=10)
    else:
        for p in prompts:
            check_greedy(llm, path, [p], max_tokens=10)
    # The C++ decode loop computes a dense MLP: never built for experts.
    assert decode_stack.build(llm.engine.model) is None and llm.engine.model._stack() is None
    assert not llm.engine.model.graph_capturable


def test_prefix_cache_hits_equal_transformers(moe):
    _, path = moe
    llm = _llm(path, enable_prefix_caching=True, block_size=8)
    shared = random_prompts([40], seed=1)[0]
    prompts = [shared + t for t in random_prompts([3, 11, 20], seed=2)]
    check_greedy(llm, path, prompts[:1], max_tokens=8)
    sp = SamplingParams(max_tokens=1, temperature=0)
    assert llm.generate(prompts[1:2], sp)[0].num_cached_tokens >= 40
    check_greedy(llm, path, prompts, max_tokens=8)


def test_logprobs_equal_transformers(moe):
    _, path = moe
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=16)
    prompt = random_prompts([37], seed=3)[0]
    check_logprobs(llm, path, prompt, max_tokens=6)


def test_torch_ops_and_reference_decode_equal_transformers(make_tiny_model):
    """No fused CPU ops (torch's SiLU in every expert) and the gather-and-mask decode."""
    path = make_tiny_model("qwen3_moe")
    llm = _llm(path)
    llm.engine.model.use_fused_cpu_ops(False)
    llm.engine.backend._kernel = None
    check_greedy(llm, path, random_prompts([9, 33], seed=4), max_tokens=8)


def test_mixtral_sliding_window_equals_transformers(make_tiny_model, tmp_path):
    path = variant(make_tiny_model("mixtral"), tmp_path / "m", sliding_window=24)
    assert ModelConfig.from_pretrained(path).window_of(1) == 24
    check_greedy(_llm(path), path, random_prompts([50, 20], seed=5), max_tokens=10)


@pytest.mark.parametrize(
    "change",
    [{}, {"mlp_only_layers": [0, 2]}, {"decoder_sparse_step": 2}, {"num_experts": 0}],
    ids=["tiny", "mlp_only_layers", "decoder_sparse_step", "no-experts"],
)
def test_dense_layers_are_where_transformers_puts_them(make_tiny_model, tmp_path, change):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = variant(make_tiny_model("qwen3_moe"), tmp_path / "m", weights=False, **change)
    cfg = ModelConfig.from_pretrained(path)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    want = tuple(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers)
    assert cfg.moe.sparse_layers == want
    with torch.device("cpu"):
        ours = MoECausalLM(cfg)
    assert tuple(isinstance(layer.mlp, SparseMoE) for layer in ours.model.layers) == want
    assert sum(p.numel() for p in ours.parameters()) == cfg.num_params()


def _stacked_copy(src, dst, prefix: str = "mlp"):
    """The checkpoint as transformers 5 holds it in memory: each layer's experts in two 3-D
    tensors (`{prefix}.experts.gate_up_proj`, `.down_proj`), Mixtral's router as `mlp.gate`."""
    import shutil

    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    state = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).state_dict()
    state = {k.replace(".mlp.experts.", f".{prefix}.experts."): v for k, v in state.items()}
    save_file({k: v.contiguous() for k, v in state.items()}, dst / "model.safetensors")
    return dst, state


def test_stacked_expert_tensors_load_as_the_per_expert_ones(moe, tmp_path):
    arch, path = moe
    prefix = "block_sparse_moe" if arch == "mixtral" else "mlp"
    stacked, state = _stacked_copy(path, tmp_path / "m", prefix)
    assert any(k.endswith("experts.gate_up_proj") and v.dim() == 3 for k, v in state.items())
    a, b = _llm(path).engine.model.state_dict(), _llm(stacked).engine.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    check_greedy(_llm(stacked), stacked, random_prompts([12], seed=6), max_tokens=6)


def test_a_stacked_tensor_of_the_wrong_shape_or_twice_is_refused(make_tiny_model, tmp_path):
    from safetensors.torch import load_file

    path = make_tiny_model("qwen3_moe")
    stacked, state = _stacked_copy(path, tmp_path / "m")
    name = "model.layers.0.mlp.experts.down_proj"
    save_file({**state, name: state[name][:5].contiguous()}, stacked / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{name}: shape \(5, 128, 96\), expected \[8 experts"):
        _llm(stacked)
    per_expert = load_file(path / "model.safetensors")
    save_file({**per_expert, name: state[name]}, stacked / "model.safetensors")
    with pytest.raises(ValueError, match="which another tensor of the checkpoint fills"):
        _llm(stacked)
    dense = "model.layers.1.mlp.experts.gate_up_proj"  # layer 1 is dense
    save_file(
        {**state, dense: state[name.replace("down", "gate_up")].clone()},
        stacked / "model.safetensors",
    )
    with pytest.raises(ValueError, match=f"unexpected weight '{dense}'"):
        _llm(stacked)


@pytest.mark.parametrize("method", ["int8", "fp8-weight-only"])
def test_quantization_covers_every_expert_and_keeps_the_router_exact(make_tiny_model, method):
    path = make_tiny_model("qwen3_moe")
    full, quant = _llm(path), _llm(path, quantization=method)
    layers = quant.engine.model.model.layers
    linears = [m for m in layers.modules() if isinstance(m, Linear)]
    # qkv and o of 3 layers, gate_up and down of 2 x 8 experts and of the dense layer 1
    assert len(linears) == 3 * 2 + 16 * 2 + 2 and all(m.quantized for m in linears)
    routers = [layer.mlp.gate for layer in layers if isinstance(layer.mlp, SparseMoE)]
    assert all(not isinstance(r, Linear) and r.weight.dtype == torch.float32 for r in routers)
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = random_prompts([5, 17, 40], seed=7)
    a, b = full.generate(prompts, sp), quant.generate(prompts, sp)
    pairs = [
        p for x, y in zip(a, b, strict=True) for p in zip(x.token_ids, y.token_ids, strict=True)
    ]
    same = sum(t == u for t, u in pairs)
    assert same >= 0.5 * 30, (a, b)


def test_bf16_tracks_transformers(make_tiny_model):
    """bf16 (the CPU bf16 kernels in every expert) within a few bf16 steps of transformers'
    logits at nearly every position; not token-exact for any architecture (the prefill
    attention runs in fp32 here), and a router near a tie picks another expert under other
    rounding (transformers' own bf16 and fp32 disagree so at 2-3 of these 60 positions)."""
    from transformers import AutoModelForCausalLM

    from engine.scoring import teacher_forced_logits

    path = make_tiny_model("mixtral")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=64, enable_prefix_caching=False)
    ids = random_prompts([60], seed=8)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    got = teacher_forced_logits(llm.engine, ids).float()
    close = (got - ref).abs().amax(-1) < 0.1 * ref.std()
    assert float(close.float().mean()) >= 0.9
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_tp2_equals_transformers_and_tp1(moe):
    """Every expert's width cut over two ranks, the router replicated, one all-reduce of the
    experts' weighted partial sums per block."""
    from test_tensor_parallel import _check_tp

    _check_tp(moe[1], 2)


def test_tp_slices_of_stacked_expert_tensors_are_the_per_expert_slices(moe, tmp_path):
    """Each rank reads a 3-D expert tensor's slice from the file (safetensors slicing along its
    width): per expert, the rank's gate | up rows and down columns of the per-expert tensors."""
    import contextlib

    from engine.loader import _Checkpoint
    from engine.models.parallel import Shard, ShardedCheckpoint

    arch, path = moe
    prefix = "block_sparse_moe" if arch == "mixtral" else "mlp"
    stacked, _ = _stacked_copy(path, tmp_path / "m", prefix)
    cfg = ModelConfig.from_pretrained(path)
    proj = {p: f"{p}_proj" for p in ("gate", "up", "down")}
    if arch == "mixtral":
        proj = {"gate": "w1", "up": "w3", "down": "w2"}
    layer = f"model.layers.0.{prefix}.experts"
    with contextlib.ExitStack() as stack:
        whole, per_expert = _Checkpoint(str(stacked), stack), _Checkpoint(str(path), stack)
        for rank in range(2):
            shard = Shard.of(cfg, rank, 2)
            a, b = ShardedCheckpoint(whole, shard), ShardedCheckpoint(per_expert, shard)
            gate_up, down = a.get(f"{layer}.gate_up_proj"), a.get(f"{layer}.down_proj")
            width = shard.local_config().moe.intermediate_size
            assert gate_up.shape == (8, 2 * width, cfg.hidden_size)
            for e in range(8):
                part = {p: b.get(f"{layer}.{e}.{n}.weight") for p, n in proj.items()}
                assert torch.equal(gate_up[e], torch.cat([part["gate"], part["up"]]))
                assert torch.equal(down[e], part["down"]) and down[e].shape[1] == width


def test_tp_must_divide_the_expert_width(make_tiny_model):
    cfg = ModelConfig.from_pretrained(make_tiny_model("qwen3_moe"))
    check_tp(cfg, 2)
    moe = dataclasses.replace(cfg.moe, intermediate_size=90)
    with pytest.raises(ValueError, match=r"each expert's intermediate size \(90\)"):
        check_tp(dataclasses.replace(cfg, moe=moe), 4)


@pytest.mark.parametrize(
    ("arch", "change", "named"),
    [
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step is 0"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok is 9"),
        ("mixtral", {"num_experts_per_tok": 0}, "num_experts_per_tok is 0"),
        (
            "mixtral",
            {"quantization_config": fc.compressed_tensors_config("channel", "dynamic")},
            "FP8 checkpoints of mixture-of-experts models are not supported",
        ),
        (
            "qwen3_moe",
            {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"},
            "'Qwen2MoeForCausalLM' is not supported: its shared expert",
        ),
    ],
    ids=["decoder_sparse_step", "top-k-over", "top-k-zero", "fp8-checkpoint", "qwen2_moe"],
)
def test_what_the_decoder_cannot_compute_is_refused(make_tiny_model, tmp_path, arch, change, named):
    path = variant(make_tiny_model(arch), tmp_path / "m", weights=False, **change)
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_pretrained(path)


def test_olmoe_is_refused_by_name(tmp_path):
    from transformers import OlmoeConfig

    OlmoeConfig(vocab_size=300, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_experts=4, eos_token_id=2, architectures=["OlmoeForCausalLM"]
                ).save_pretrained(tmp_path)  # fmt: skip
    with pytest.raises(ValueError, match="'OlmoeForCausalLM' is not supported: its q/k norms"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("arch", "named"),
    [
        ("llama", "'llama.expert_count' is 8; mixture-of-experts GGUF files are not supported"),
        ("qwen3moe", "'general.architecture' is 'qwen3moe'"),
    ],
)
def test_a_gguf_file_with_experts_is_refused(tmp_path, arch, named):
    """llama.cpp writes Mixtral as "llama" with `llama.expert_count`, Qwen3-MoE as "qwen3moe";
    both refused before anything is mapped."""
    path = header_only_gguf(tmp_path / "moe.gguf", arch, expert_count=8)
    with pytest.raises(GGUFError, match=named):
        ModelConfig.from_pretrained(path)
