"""Gemma 3 (`Gemma3ForCausalLM`) beyond the suites every architecture runs (test_parity_hf,
test_logprobs_and_choices, test_tensor_parallel, test_cuda_graphs, test_make_model): the tiny
checkpoint's features each change transformers' output (so parity tests them); greedy fp32
output equals transformers' past the sliding window on every attention and fused-op path the
engine takes on CPU; logprobs past the window equal its log-softmax; bf16 norms and embeddings
round as transformers'; int8 quantizes every projection and stays close; a transformers 4.x
config and attention biases are served alike; what the decoder does not compute is refused
with the config field named (and a gemma3 GGUF file by its architecture)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_variants import check_greedy as _check_greedy
from checkpoint_variants import check_logprobs, header_only_gguf, random_prompts
from checkpoint_variants import variant as _variant

from engine import LLM, SamplingParams, kernels
from engine.config import ModelConfig
from engine.gguf_file import GGUFError
from engine.models import decode_stack
from engine.models.gemma import GemmaCausalLM, GemmaRMSNorm
from engine.models.linear import Linear

WINDOW = 20  # the tiny checkpoint's sliding window (tools/make_model.py)
LENGTHS = [60, 5, 19, 20, 21, 100]  # around and past the window
REPO = Path(__file__).resolve().parents[2]


def _prompts(lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    return random_prompts(lengths, seed)


@pytest.fixture(scope="module")
def gemma(make_tiny_model) -> Path:
    return make_tiny_model("gemma3")


def test_config_reads_what_gemma_computes(gemma):
    cfg = ModelConfig.from_pretrained(gemma)
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert cfg.head_dim == 48 != cfg.hidden_size // cfg.num_heads
    assert cfg.attention_scale == 24**-0.5  # query_pre_attn_scalar: not head_dim, not 128 / 4
    assert [cfg.window_of(i) for i in range(cfg.num_layers)] == [WINDOW, WINDOW, None, WINDOW]
    assert cfg.qk_norm and cfg.tie_word_embeddings and not (cfg.qkv_bias or cfg.o_bias)
    rope = cfg.hf_config.rope_parameters
    assert rope["sliding_attention"]["rope_theta"] != rope["full_attention"]["rope_theta"]
    assert rope["full_attention"]["rope_type"] == "linear"


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": 4096},  # no window within the prompt
        {"query_pre_attn_scalar": 48},  # the scale head_dim would give
        {"rope_local_base_freq": 1000000.0, "rope_parameters": None},  # one rope base
        {"rope_scaling": None, "rope_parameters": None},  # global rope unscaled
        {"layer_types": ["sliding_attention"] * 4},
    ],
    ids=["window", "scale", "local-rope", "global-scaling", "layer-types"],
)
def test_each_gemma_feature_changes_transformers_output(gemma, tmp_path, change):
    """The tiny checkpoint exercises each: transformers' logits move when it is undone, so a
    decoder that ignored it would fail the parity tests."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor(_prompts([60]))
    logits = []
    for path in (gemma, _variant(gemma, tmp_path / "m", **change)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(ids).logits[0, -1])
    assert (logits[0] - logits[1]).abs().max() > 1e-2


def _llm(path, **settings) -> LLM:
    base = {"dtype": "float32", "max_num_batched_tokens": 32, "enable_prefix_caching": False}
    return LLM(path, **{**base, **settings})


def test_greedy_past_the_window_on_the_fused_cpu_ops(gemma):
    """The default CPU path (fused add+norm and RoPE, the paged decode kernel), chunked."""
    llm = _llm(gemma)
    model = llm.engine.model
    assert isinstance(model, GemmaCausalLM)
    if kernels.ops() is not None:  # built here: the fused ops must be what ran
        assert model.model.norm.fused is kernels.ops() and model.model.norm.fused.rope_
        assert llm.engine.backend._kernel is not None
    _check_greedy(llm, gemma, _prompts())


@pytest.mark.parametrize("path", ["torch-ops", "gather-reference", "triton-ops"])
def test_greedy_past_the_window_on_the_other_paths(gemma, path):
    """torch ops (no CPU kernels); the gather-and-mask decode (a mask per window, as on a
    GPU); the GPU's Triton norm ops (run by the interpreter here), whole prompts."""
    llm = _llm(gemma, enable_chunked_prefill=path != "triton-ops", max_num_batched_tokens=128)
    model = llm.engine.model
    if path == "torch-ops":
        model.use_fused_cpu_ops(False)
        assert model.model.norm.fused is None
    elif path == "gather-reference":
        llm.engine.backend._kernel = None
    else:
        pytest.importorskip(
            "triton",
            reason="triton is not installed (the test extra brings it on Linux x86_64 only)",
        )
        model.use_fused_ops(kernels.gpu_ops())
        assert model.model.layers[0].self_attn.fused.rope_ is not None  # q/k after their norms
    _check_greedy(llm, gemma, _prompts(seed=1))


def test_greedy_past_the_window_on_the_triton_backend(gemma):
    """The CUDA attention backend (its KV write and paged decode kernels, by the interpreter
    here): decodes long past the window, so full layers read keys a sliding one must not."""
    pytest.importorskip(
        "triton", reason="triton is not installed (the test extra brings it on Linux x86_64 only)"
    )
    llm = _llm(gemma, attention_backend="triton")
    assert llm.engine.backend.name == "triton"
    _check_greedy(llm, gemma, _prompts([30], seed=3), max_tokens=12)


def test_logprobs_past_the_window_equal_transformers(gemma):
    llm = LLM(gemma, dtype="float32", block_size=4, max_num_batched_tokens=16)
    prompt = _prompts([50], seed=2)[0]
    check_logprobs(llm, gemma, prompt, max_tokens=8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norms_and_embeddings_round_as_transformers(gemma, dtype):
    """Each loaded norm holds 1 + w of the checkpoint's w in the serving dtype, and applies
    as transformers' Gemma3RMSNorm bit for bit (bf16: one rounding after the fp32 product);
    in fp32 the fused add + norm (CPU kernel) within an ulp, as it is Llama's norm; the scaled
    embeddings are transformers'."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gemma, dtype=dtype).eval()
    model = LLM(gemma, dtype=dtype, num_kv_blocks=16).engine.model
    hf_norms = {n: m for n, m in hf.named_modules() if n.endswith("norm")}
    ours = {n: m for n, m in model.named_modules() if isinstance(m, GemmaRMSNorm)}
    assert hf_norms.keys() == ours.keys() and len(ours) == 6 * len(model.model.layers) + 1
    g = torch.Generator().manual_seed(0)
    for name, norm in ours.items():
        w = hf_norms[name].weight
        assert norm.weight.dtype == torch.float32
        assert torch.equal(norm.weight, 1.0 + w.float()), name
        x = (torch.randn(5, w.shape[0], generator=g) * 4).to(dtype)
        with torch.no_grad():
            assert torch.equal(norm(x), hf_norms[name](x)), name
            if dtype == torch.float32 and w.shape[0] == model.cfg.hidden_size:
                r = torch.randn(5, w.shape[0], generator=g)
                fused = norm.add_forward(x, r)[0]
                torch.testing.assert_close(fused, hf_norms[name](x + r), rtol=1e-6, atol=1e-6)
    ids = torch.tensor(_prompts([30])[0])
    with torch.no_grad():
        ref = hf.model.embed_tokens(ids[None])[0]
        assert torch.equal(model.model.embed_tokens(ids) * model.model.embed_scale, ref)


def test_bf16_tracks_transformers_and_builds_no_decode_loop(gemma):
    """bf16 is not token-exact for any architecture (the CPU prefill attention runs in fp32,
    transformers' SDPA in bf16); Gemma's logits stay within the same few bf16 steps. The C++
    decode loop, Llama's layer, is not built for it; the Python layers serve every step."""
    from transformers import AutoModelForCausalLM

    from engine.scoring import teacher_forced_logits

    hf = AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.bfloat16).eval()
    llm = LLM(gemma, dtype="bfloat16", num_kv_blocks=64, enable_prefix_caching=False)
    assert decode_stack.build(llm.engine.model) is None and llm.engine.model._stack() is None
    ids = _prompts([60])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    got = teacher_forced_logits(llm.engine, ids).float()
    assert (got - ref).abs().max() < 0.1 * ref.std()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


@pytest.mark.parametrize("method", ["int8", "int8-w8a8"])
def test_int8_quantizes_every_projection_and_stays_close(gemma, method):
    full = _llm(gemma)
    quant = _llm(gemma, quantization=method)
    layers = quant.engine.model.model.layers
    schemes = [m.scheme for m in layers.modules() if isinstance(m, Linear)]
    assert schemes == ["int8"] * 4 * len(layers)  # qkv, o, gate_up, down
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = _prompts([5, 17, 40, 90], seed=4)
    a, b = full.generate(prompts, sp), quant.generate(prompts, sp)
    pairs = [
        p for x, y in zip(a, b, strict=True) for p in zip(x.token_ids, y.token_ids, strict=True)
    ]
    same = sum(t == u for t, u in pairs)
    assert same >= 0.6 * 4 * 12, (a, b)


def test_a_transformers_4_config_is_served_alike(gemma, tmp_path):
    """4.x's spelling (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern;
    no rope_parameters or layer_types) reads as the same model and stays token-exact."""
    legacy = _variant(
        gemma, tmp_path / "m", rope_parameters=None, layer_types=None, sliding_window_pattern=3
    )
    a, b = ModelConfig.from_pretrained(gemma), ModelConfig.from_pretrained(legacy)
    assert (a.layer_types, a.attention_scale) == (b.layer_types, b.attention_scale)
    assert a.hf_config.rope_parameters == b.hf_config.rope_parameters
    _check_greedy(_llm(legacy), legacy, _prompts([45, 8], seed=5))


def test_attention_biases_are_served(gemma, tmp_path):
    """attention_bias: q/k/v and o biases (random, so they matter) as the Llama family's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src = AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32)
    cfg = AutoConfig.from_pretrained(gemma, attention_bias=True)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    model.load_state_dict(src.state_dict(), strict=False)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    out = tmp_path / "bias"
    shutil.copytree(gemma, out)
    model.save_pretrained(out)
    assert ModelConfig.from_pretrained(out).o_bias
    _check_greedy(_llm(out), out, _prompts([33, 4], seed=6))


def test_rope_tables_import_no_modeling_module(gemma):
    """Both layer types' tables come from the config alone, as every architecture's do."""
    code = (
        "import sys; from engine.config import ModelConfig; from engine.models.rope import "
        f"rope_tables; c = ModelConfig.from_pretrained({str(gemma)!r});"
        "[rope_tables(c.hf_config, c.architecture, 64, c.head_dim, t) for t in set(c.layer_types)];"
        "print([m for m in sys.modules if 'modeling_gemma3' in m])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


ROPE = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": ["sliding_attention"] * 3 + ["chunked_attention"]}, "layer_types"),
        ({"sliding_window": None}, "sliding_window"),
        (
            {
                "rope_scaling": None,
                "rope_parameters": {
                    "sliding_attention": ROPE,
                    "full_attention": {**ROPE, "rope_type": "dynamic", "factor": 2.0},
                },
            },
            r"rope_parameters\['full_attention'\]\['rope_type'\]",
        ),
        (
            {
                "rope_parameters": {
                    "sliding_attention": {**ROPE, "partial_rotary_factor": 0.5},
                    "full_attention": ROPE,
                },
            },
            r"rope_parameters\['sliding_attention'\]\['partial_rotary_factor'\]",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_what_the_decoder_cannot_compute_is_refused(gemma, tmp_path, change, named):
    path = _variant(gemma, tmp_path / "m", weights=False, **change)
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_pretrained(path)


def test_a_gemma3_gguf_file_is_refused(tmp_path):
    """engine/gguf_file.py reads llama/qwen2/qwen3 layouts; a gemma3 file is refused by name
    before anything is mapped (its norms would be read as Llama's)."""
    path = header_only_gguf(tmp_path / "gemma3.gguf", "gemma3")
    with pytest.raises(GGUFError, match="'general.architecture' is 'gemma3'"):
        ModelConfig.from_pretrained(path)
