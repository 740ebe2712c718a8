"""The CPU decode fast path: the C++ layer loop (engine.models.decode_stack), the weights in one
block in stream order (engine.models.weight_arena) and the int8 head.

The loop must be the Python layers' exact twin (same kernels, same inputs): every token and
logprob equal with it on and off, at 1 and 3 decode rows, for bf16 and int8 weights, with and
without q/k/v biases, and it must actually run (counted) where it is supposed to."""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.llm import LLM
from engine.models import decode_stack, linear, llama, weight_arena
from engine.protocol import SamplingParams

OPS = kernels.ops()
needs_stack = pytest.mark.skipif(
    OPS is None or OPS.decode_stack is None,
    reason="the decode loop needs the linear CPU kernels (AVX-512 or AVX2+FMA; none here)",
)
PROMPTS = ["The quick brown fox", "Once upon a time, in a land", "1 2 3 4 5 6 7 8 9 10 11"]


class CountingStack:
    """The real stack, its calls counted by row count (a seam beside the real path)."""

    def __init__(self, stack):
        self.stack, self.rows = stack, []

    def run(self, x, *args):
        self.rows.append(x.shape[0])
        return self.stack.run(x, *args)


def _generate(llm: LLM, prompts, stack_on: bool):
    model = llm.engine.model
    counter = None
    if stack_on:
        model._decode_stack = llama.UNBUILT
        counter = CountingStack(model._stack())
        model._decode_stack = counter
    else:
        model._decode_stack = None  # built as "no stack": the Python layers run
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    with torch.inference_mode():
        outs = llm.generate(prompts, sp)
    return [(o.token_ids, o.logprobs) for o in outs], counter


@needs_stack
@pytest.mark.parametrize(
    "arch,quantization",
    [
        ("llama", None),
        ("qwen2", None),
        ("llama", "int8"),
        ("qwen2", "int8"),
        ("llama", "int8-w8a8"),
        ("qwen2", "int8-w8a8"),
    ],
)
def test_stack_is_the_python_layers_exact_twin(make_tiny_model, arch, quantization):
    kw = {"quantization": quantization} if quantization else {}
    llm = LLM(str(make_tiny_model(arch)), dtype="bfloat16", num_kv_blocks=64, **kw)
    if quantization == "int8-w8a8" and OPS.gemv_q8 is not None:  # the q8 products do run
        lins = [m for m in llm.engine.model.modules() if getattr(m, "scheme", None) == "int8"]
        assert lins and all(m.int8_q8 and linear.q8_fits(m.qweight, m.wscale) for m in lins)
    for prompts, rows in ((PROMPTS, 3), (PROMPTS[:1], 1)):
        fast, counter = _generate(llm, prompts, stack_on=True)
        slow, _ = _generate(llm, prompts, stack_on=False)
        assert fast == slow  # token ids and logprobs, bit for bit
        assert counter.rows and max(counter.rows) == rows, counter.rows


@needs_stack
def test_models_the_loop_does_not_cover_keep_the_python_layers(make_tiny_model):
    """q/k norm (qwen3) and fp32 weights (no GEMV kernel for them) build no stack; the engine
    still generates through the Python layers."""
    for arch, dtype in (("qwen3", "bfloat16"), ("llama", "float32")):
        llm = LLM(str(make_tiny_model(arch)), dtype=dtype, num_kv_blocks=32)
        assert decode_stack.build(llm.engine.model) is None
        out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(out[0].token_ids) == 3


def test_weights_sit_in_one_block_in_stream_order(make_tiny_model, monkeypatch):
    """Every tensor a decode step reads is a view of one block, laid out in the order the step
    reads them, with the values a load without the block gives."""
    path = str(make_tiny_model("qwen2"))  # tied head, q/k/v biases
    packed = LLM(path, dtype="bfloat16", num_kv_blocks=16).engine.model
    monkeypatch.setenv("TANDEM_WEIGHT_ARENA", "0")
    plain = LLM(path, dtype="bfloat16", num_kv_blocks=16).engine.model
    entries = weight_arena.stream_order(packed)
    ptrs = [t.data_ptr() for _, _, t in entries]
    assert ptrs == sorted(ptrs) and len(set(ptrs)) == len(ptrs)
    storages = {t.untyped_storage().data_ptr() for _, _, t in entries}
    assert len(storages) == 1
    assert packed.lm_head.weight is packed.model.embed_tokens.weight  # still tied
    ref = plain.state_dict()
    for name, t in packed.state_dict().items():
        assert torch.equal(t, ref[name]), name
    assert weight_arena.pack_weights(plain) == 0  # turned off


@needs_stack
def test_int8_quantizes_the_head_on_cpu_and_keeps_the_embedding(make_tiny_model):
    path = str(make_tiny_model("qwen2"))  # tied: the head gets its own int8 copy
    bf16 = LLM(path, dtype="bfloat16", num_kv_blocks=16).engine.model
    int8 = LLM(path, dtype="bfloat16", num_kv_blocks=16, quantization="int8").engine.model
    assert int8.lm_head.scheme == "int8" and int8.lm_head.qweight.dtype == torch.int8
    hidden_size = bf16.cfg.hidden_size  # one scale per 32 weights of a row, as GGUF's Q8_0
    assert int8.lm_head.wscale.shape == (bf16.cfg.vocab_size, hidden_size // 32)
    assert torch.equal(int8.model.embed_tokens.weight, bf16.model.embed_tokens.weight)
    for rows in (1, 5, 80):  # the GEMV, the tiled kernel and the dequantized GEMM
        hidden = torch.randn(rows, hidden_size).to(torch.bfloat16)
        exact, quant = bf16.compute_logits(hidden), int8.compute_logits(hidden)
        # The logits move by well under their spread; the argmax holds but for near-ties.
        assert (exact - quant).abs().max() < 0.05 * exact.std()
        assert (exact.argmax(-1) == quant.argmax(-1)).float().mean() >= 0.95
