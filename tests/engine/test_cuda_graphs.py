"""Decode steps through CUDA graphs' static, padded batches (engine.cuda_graphs).

On a CPU the buckets are not captured but the padded path is the same one a replay runs
(static buffers, padding rows with slot -1 and context 0, the Triton kernels under the
interpreter): greedy output must still equal transformers' and the path must have been taken.
On a GPU the graphs are captured and replayed, and must agree with eager decoding."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs, capture_sizes
from engine.model_runner import AttentionMetadata
from tests.engine.test_parity_hf import hf_greedy

pytest.importorskip(
    "triton", reason="triton is not installed (the test extra brings it on Linux x86_64 only)"
)
CUDA = torch.cuda.is_available()
PROMPT_LENGTHS = [1, 5, 17, 33]
MAX_TOKENS = [9, 3, 6, 2]  # the batch shrinks as requests finish: buckets 4, then 2, then 1


def test_capture_sizes_cover_every_batch_up_to_the_limit():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(30)[-1] == 30


def _engine(path, eager: bool) -> LLM:
    llm = LLM(path, dtype="float32", attention_backend="triton", max_num_seqs=6,
              enforce_eager=eager)  # fmt: skip
    e = llm.engine
    if not CUDA:  # not captured: every bucket runs its padded inputs without a graph
        e.runner.graphs = DecodeGraphs(e.model, e.cache, e.backend, 6, e.max_model_len)
    return llm


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])  # gemma3: per-layer scale/window
def test_padded_decode_batches_match_hf(make_tiny_model, arch):
    path = make_tiny_model(arch)
    llm = _engine(path, eager=False)
    sps = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate(_prompts(), sps)
    for p, m, o in zip(_prompts(), MAX_TOKENS, outs, strict=True):
        assert o.token_ids == hf_greedy(path, p, m)
    graphs = llm.engine.runner.graphs
    assert graphs.padded_runs >= max(MAX_TOKENS) - 2  # decode-only steps took the static path
    assert graphs.replays == (graphs.padded_runs if CUDA else 0)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def _meta(context_lens, prefill_idx=()):
    n = len(context_lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.int64), query_start=list(range(n + 1)),
        num_computed=[c - 1 for c in context_lens], context_lens=list(context_lens),
        block_tables=torch.zeros(n, 1, dtype=torch.int64),
        decode_idx=torch.tensor([i for i in range(n) if i not in prefill_idx]),
        prefill_idx=list(prefill_idx), decode_context_lens=torch.tensor(context_lens),
    )  # fmt: skip


def test_steps_a_graph_cannot_serve_run_eagerly(make_tiny_model):
    llm = _engine(make_tiny_model("llama"), eager=False)
    graphs = llm.engine.runner.graphs
    ids = torch.zeros(3, dtype=torch.int64)
    assert graphs.run(ids, ids, _meta([4, 5, 6], prefill_idx=(1,))) is None  # a prefill chunk
    too_long = graphs.batch.max_context + 1
    assert graphs.run(ids, ids, _meta([4, too_long, 6])) is None
    many = torch.zeros(7, dtype=torch.int64)  # above the largest bucket (max_num_seqs 6)
    assert graphs.run(many, many, _meta([4] * 7)) is None
    assert graphs.padded_runs == 0


def test_graphs_need_a_capturable_backend(make_tiny_model):
    llm = LLM(make_tiny_model("llama"), dtype="float32", attention_backend="torch")
    e = llm.engine
    with pytest.raises(ValueError, match="cannot be captured"):
        DecodeGraphs(e.model, e.cache, e.backend, 4, e.max_model_len)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_captured_graphs_equal_eager_decoding(make_tiny_model, arch):
    path = make_tiny_model(arch)
    sps = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in MAX_TOKENS]
    graphed = _engine(path, eager=False)
    assert graphed.engine.runner.graphs.graphs, "no graph was captured"
    got = [o.token_ids for o in graphed.generate(_prompts(), sps)]
    eager = _engine(path, eager=True)
    assert eager.engine.runner.graphs is None
    assert got == [o.token_ids for o in eager.generate(_prompts(), sps)]
    assert graphed.engine.runner.graphs.replays > 0
