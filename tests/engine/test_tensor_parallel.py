"""Tensor parallelism inside the engine (engine/distributed.py, engine/models/parallel.py):
greedy fp32 output at TP 2 (and TP 4 with replicated KV heads) equals transformers token for
token and TP 1, logprobs within 1e-4 of TP 1; int8 and FP8 layers at TP 2 equal TP 1 (the same
quantized weights and scales, only the all-reduce's summation order differs); settings TP
cannot serve are refused by name; a killed rank is a clear error and leaves no process behind.

Each TP engine starts real rank processes (a few seconds): one engine per test, shut down at
its end."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import signal
import time

import fp8_checkpoints as fc
import pytest
import torch

from engine import LLM, SamplingParams
from engine.distributed import WAIT_SLICE_S, ProcessGroup, TPError, TPModelRunner
from engine.llm_engine import EngineConfig
from engine.model_runner import ModelRunner
from engine.scoring import teacher_forced_logits

LENGTHS = [1, 5, 17, 40, 70]
MAX_TOKENS = 8
SETTINGS = {"dtype": "float32", "num_kv_blocks": 96, "max_num_batched_tokens": 48}


def _prompts(lengths=LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


@functools.cache
def _hf(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _hf_greedy(path, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = _hf(str(path)).generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def _generate(llm: LLM, n: int = 1):
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=3, n=n
    )  # fmt: skip
    return llm.generate(_prompts(), params)


def _assert_close_logprobs(got, want, tol: float = 1e-4) -> None:
    assert got.token_ids == want.token_ids
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert abs(a[0] - b[0]) <= tol, (a, b)
        assert [t for t, _ in a[2]] == [t for t, _ in b[2]], (a, b)
        assert max(abs(x - y) for (_, x), (_, y) in zip(a[2], b[2], strict=True)) <= tol


@functools.cache
def _tp1(path, **settings) -> LLM:
    return LLM(path, **{**SETTINGS, **settings})


def _check_tp(path, tp: int, hf: bool = True, w8a8: bool = False, **settings) -> LLM:
    """A TP `tp` engine on `path`: equal to TP 1 (tokens, logprobs within 1e-4), and to
    transformers when `hf`; with n=2 (a fork copies the prompt's last block on every rank).
    Teacher-forced logits of a 60-token prompt within 1e-4 of TP 1's; `w8a8`: activations are
    rounded to e4m3 (steps of 1/16 relative), so an fp32 ulp of all-reduce order can move one
    across a rounding point: logprobs within 0.05, 95% of the logits within 1e-4, none off by
    more than 0.25."""
    llm = LLM(path, tensor_parallel_size=tp, **{**SETTINGS, **settings})
    try:
        assert isinstance(llm.engine.runner, TPModelRunner)
        free0 = llm.engine.block_manager.num_free_blocks
        ref = _tp1(path, **settings)
        tol = 0.05 if w8a8 else 1e-4
        for n in (1, 2):
            outs, want = _generate(llm, n), _generate(ref, n)
            for p, o, w in zip(_prompts(), outs, want, strict=True):
                if hf:
                    assert o.token_ids == _hf_greedy(path, p), f"prompt of {len(p)} diverged"
                _assert_close_logprobs(o, w, tol)
                for c, cw in zip(o.choices, w.choices, strict=True):
                    _assert_close_logprobs(c, cw, tol)
        assert llm.engine.block_manager.num_free_blocks == free0
        ids = _prompts([60])[0]
        diff = teacher_forced_logits(llm.engine, ids) - teacher_forced_logits(ref.engine, ids)
        diff = diff.abs()
        if w8a8:
            assert float((diff <= 1e-4).float().mean()) >= 0.95 and float(diff.max()) <= 0.25
        else:
            assert float(diff.max()) <= 1e-4
    finally:
        llm.engine.shutdown()
    assert all(p.poll() is not None for p in llm.engine.tp.procs)
    return llm


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3"])
def test_tp2_matches_hf_and_tp1(make_tiny_model, arch):
    """llama: GQA 4/2, llama3 rope; mistral: MHA; qwen2: qkv bias, tied embeddings; qwen3:
    q/k norms and one KV head (so each of the two ranks keeps a copy of it); phi3: q/k/v and
    gate/up stored fused, each cut part by part (`Shard.fused_rows`); gemma3: (1 + w) norms
    replicated, the post-attention norm after the o_proj all-reduce, per-layer windows."""
    _check_tp(make_tiny_model(arch), 2)


def test_tp4_replicates_kv_heads(make_tiny_model):
    path = make_tiny_model("llama")  # 4 query heads, 2 KV heads
    llm = _check_tp(path, 4)
    assert llm.engine.kv_spec.num_kv_heads == 1
    assert llm.engine.model.model.layers[0].self_attn.num_heads == 1


def test_tp1_keeps_the_plain_path(make_tiny_model):
    engine = _tp1(make_tiny_model("llama")).engine
    assert engine.tp is None and type(engine.runner) is ModelRunner
    assert engine.config.tensor_parallel_size == 1


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_tp2_equals_tp1(make_tiny_model, method):
    """Quantized after loading: a row-parallel shard takes its rows' scales from the whole
    rows (all-reduced max), so both TP sizes hold the same int8 / e4m3 weights."""
    _check_tp(make_tiny_model("qwen2"), 2, hf=False, w8a8=method == "fp8", quantization=method)


@pytest.mark.parametrize(
    ("writer", "w8a8"),
    [
        (lambda s, d: fc.write_compressed_tensors(s, d, "channel", "dynamic"), True),
        (lambda s, d: fc.write_block_fp8(s, d, block=(16, 16)), False),
    ],
    ids=["channel-w8a8", "block16-weight-only"],
)
def test_fp8_checkpoint_tp2_equals_tp1(make_tiny_model, tmp_path, writer, w8a8):
    """An FP8 checkpoint's weights and scales read per rank: per-channel scales with their
    rows, block-wise scales cut at block boundaries."""
    path = writer(make_tiny_model("llama"), tmp_path / "fp8")
    method = "fp8" if w8a8 else "fp8-weight-only"
    _check_tp(path, 2, hf=False, w8a8=w8a8, quantization=method)


def _reaped(llm_or_tp) -> bool:
    return all(p.poll() is not None for p in llm_or_tp.procs)


def test_fp8_blocks_a_rank_would_split_are_refused(make_tiny_model, tmp_path):
    # 128-column blocks: down_proj's 352 columns split at 176, inside a block.
    path = fc.write_block_fp8(make_tiny_model("llama"), tmp_path / "fp8")
    before = _children()
    with pytest.raises(ValueError, match="inside a 128-column FP8 scale block"):
        LLM(path, tensor_parallel_size=2, **SETTINGS)
    assert _children() <= before  # the rank it started is gone


def _children() -> set[int]:
    """Live child processes of this one (Linux /proc)."""
    me, kids = str(os.getpid()), set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            kids.add(int(pid))
    return kids


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tensor_parallel_size": 3}, "must divide num_attention_heads"),
        ({"tensor_parallel_size": 8}, "must divide num_attention_heads"),
        ({"tensor_parallel_size": 0}, "integer >= 1"),
        ({"tensor_parallel_size": 2, "load_format": "dummy"}, "needs a checkpoint"),
    ],
)
def test_settings_tp_cannot_serve_are_refused(make_tiny_model, settings, message):
    before = _children()
    with pytest.raises(ValueError, match=message):
        LLM(make_tiny_model("llama"), **{**SETTINGS, **settings})
    assert _children() <= before


def test_kv_heads_tp_cannot_split_are_refused(make_tiny_model):
    from engine.config import ModelConfig
    from engine.models.parallel import check_tp

    cfg = ModelConfig.from_pretrained(make_tiny_model("llama"))  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="must divide num_key_value_heads"):
        check_tp(dataclasses.replace(cfg, num_heads=6, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match="must be a multiple of it"):
        check_tp(dataclasses.replace(cfg, num_heads=6, num_kv_heads=2, intermediate_size=6), 3)
    with pytest.raises(ValueError, match="intermediate_size"):
        check_tp(dataclasses.replace(cfg, intermediate_size=351), 2)
    assert EngineConfig(model="x", tensor_parallel_size=4).tensor_parallel_size == 4


def test_killed_rank_is_a_clear_error_and_leaves_no_process(make_tiny_model):
    llm = LLM(make_tiny_model("llama"), tensor_parallel_size=2, **SETTINGS)
    tp = llm.engine.tp
    try:
        assert len(_generate(llm)) == len(LENGTHS)
        os.kill(tp.procs[0].pid, signal.SIGKILL)
        tp.procs[0].wait(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(TPError, match=r"rank 1 \(pid \d+\) exited with status -9"):
            _generate(llm)
        assert time.monotonic() - t0 < 10
        with pytest.raises(TPError, match="group is down"):  # and stays refused
            _generate(llm)
        assert llm.engine.block_manager.num_free_blocks == 96  # the aborts freed every block
    finally:
        llm.engine.shutdown()
    assert _reaped(tp) and not _children() & {p.pid for p in tp.procs}


class _Work:
    """A gloo work whose wait times out `slow` times, then returns (or raises `error`)."""

    def __init__(self, slow: int = 0, error: str = ""):
        self.slow, self.error, self.waits = slow, error, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if self.error:
            raise RuntimeError(self.error)
        if len(self.waits) <= self.slow:
            raise RuntimeError("Operation timed out!")


def _group(device: str, alive) -> ProcessGroup:
    group = object.__new__(ProcessGroup)  # no gloo: the wait loop alone
    group.device, group.alive = torch.device(device), alive
    return group


def test_rank0_waits_in_slices_and_names_a_rank_that_died_meanwhile():
    # gloo does not always notice a SIGKILLed peer: CI saw a broadcast wait out its whole
    # 120 s. Rank 0 waits in slices and looks at its ranks' processes between them.
    checks = []

    def alive():
        checks.append(1)
        if len(checks) == 3:
            raise TPError("tensor-parallel group is down: rank 1 (pid 7) exited with status -9")

    work = _Work(slow=100)
    with pytest.raises(TPError, match="rank 1"):
        _group("cpu", alive).wait(work)
    assert len(work.waits) == 3 and {w.total_seconds() for w in work.waits} == {WAIT_SLICE_S}
    slow = _Work(slow=2)  # a slow rank that is alive: waited for, checked between slices
    _group("cpu", lambda: checks.append(1)).wait(slow)
    assert len(slow.waits) == 3 and len(checks) == 5
    with pytest.raises(RuntimeError, match="Connection closed"):  # other errors at once
        _group("cpu", alive).wait(_Work(error="Connection closed by peer"))
    assert len(checks) == 5
    with pytest.raises(RuntimeError, match="Timed out waiting 0ms"):  # its own deadline
        _group("cpu", lambda: None).wait(_Work(slow=100), datetime.timedelta(0))
    for device, check in (("cuda", alive), ("cpu", None)):  # NCCL, and ranks 1..N: as before
        plain = _Work()
        _group(device, check).wait(plain)
        assert plain.waits == [None]


def test_gguf_tp2_matches_hf(make_tiny_model, tmp_path):
    """A GGUF file read per rank: llama's q/k rows are put back in rotate-half order with the
    whole model's head counts before a rank takes its slice."""
    from gguf_writer import write_gguf

    src = make_tiny_model("llama")
    path = write_gguf(src, tmp_path / "llama.gguf", "F32")
    llm = LLM(str(path), tensor_parallel_size=2, **SETTINGS)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        for p, o in zip(_prompts(), llm.generate(_prompts(), params), strict=True):
            assert o.token_ids == _hf_greedy(src, p)
    finally:
        llm.engine.shutdown()
