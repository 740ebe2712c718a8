"""Log-probabilities against transformers' fp32 log-softmax, prompt log-probabilities (every
position, through chunking and past a warm prefix cache), and n choices forked from one
prompt: equal to the same seeds run alone, sharing the prompt's blocks, colocated and across
the hand-off."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.llm_engine import EngineConfig, LLMEngine
from engine.roles import DECODE, PREFILL
from tests.kv_copy import CopyConnector

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]


def _hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _check_entry(entry, ref_row: torch.Tensor, token: int, k: int) -> None:
    lp, rank, top = entry
    assert abs(lp - ref_row[token].item()) < 1e-4
    assert rank == int((ref_row > ref_row[token]).sum()) + 1
    assert len(top) == k
    ref_top = torch.topk(ref_row, k)
    assert [t for t, _ in top] == ref_top.indices.tolist()
    assert max(abs(v - r) for (_, v), r in zip(top, ref_top.values.tolist(), strict=True)) < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_and_prompt_logprobs_equal_transformers(make_tiny_model, arch):
    model = make_tiny_model(arch)
    # A small token budget: the prompt is scored across several chunks.
    llm = LLM(model, dtype="float32", block_size=4, max_num_batched_tokens=8)
    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate([PROMPT], sp)[0]
    ref = _hf_logprobs(model, PROMPT + out.token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for p in range(1, len(PROMPT)):
        _check_entry(out.prompt_logprobs[p], ref[p - 1], PROMPT[p], 2)
    assert len(out.logprobs) == len(out.token_ids)
    for j, token in enumerate(out.token_ids):
        _check_entry(out.logprobs[j], ref[len(PROMPT) - 1 + j], token, 3)
        assert out.logprobs[j][1] == 1  # greedy: the chosen token is the likeliest


def test_prompt_logprobs_bypass_a_warm_prefix_cache(make_tiny_model):
    llm = LLM(make_tiny_model("llama"), dtype="float32", block_size=4)
    llm.generate([PROMPT], SamplingParams(max_tokens=1))  # warms the prefix cache
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = llm.generate([PROMPT], sp)[0]
    assert out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=1))[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None and plain.logprobs is None


def test_n_choices_equal_their_seeds_run_alone_and_free_every_block(make_tiny_model):
    llm = LLM(make_tiny_model("qwen2"), dtype="float32", block_size=4, num_kv_blocks=64)
    sp = SamplingParams(max_tokens=8, temperature=1.0, n=4, seed=11, ignore_eos=True, logprobs=0)
    out = llm.generate([PROMPT], sp)[0]
    assert [c.token_ids for c in out.choices][0] == out.token_ids
    for i, choice in enumerate(out.choices):
        alone = llm.generate(
            [PROMPT], SamplingParams(max_tokens=8, temperature=1.0, seed=11 + i, ignore_eos=True)
        )[0]
        assert choice.token_ids == alone.token_ids
        assert choice.cumulative_logprob == pytest.approx(sum(e[0] for e in choice.logprobs))
    assert len({tuple(c.token_ids) for c in out.choices}) > 1
    assert llm.engine.block_manager.num_free_blocks == 64


def test_forked_choices_share_the_prompt_blocks(make_tiny_model):
    engine = LLMEngine(
        EngineConfig(model=str(make_tiny_model("llama")), dtype="float32", block_size=4,
                     num_kv_blocks=64, enable_prefix_caching=False)
    )  # fmt: skip
    sp = SamplingParams(max_tokens=4, temperature=1.0, n=4, seed=1, ignore_eos=True)
    engine.add_request("r", PROMPT, sp)  # 19 tokens: 4 full blocks and a partial one
    outputs = engine.step()
    assert sorted(o.choice for o in outputs) == [0, 1, 2, 3]
    # One copy of the 4 full blocks plus 4 last blocks (each choice writes its own next token).
    assert 64 - engine.block_manager.num_free_blocks == 4 + 4
    tables = [engine.seqs[k].block_table for k in ("r", "r#1", "r#2", "r#3")]
    assert all(t[:4] == tables[0][:4] for t in tables)
    assert len({t[4] for t in tables}) == 4
    while engine.has_unfinished():
        engine.step()
    assert engine.pop_finished("r") is not None
    assert engine.block_manager.num_free_blocks == 64


def test_n_choices_across_the_hand_off_match_colocated(make_tiny_model):
    model = str(make_tiny_model("mistral"))

    def engine(role):
        return LLMEngine(EngineConfig(model=model, dtype="float32", block_size=4, role=role,
                                      num_kv_blocks=64))  # fmt: skip

    sp = SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=5, ignore_eos=True, logprobs=1)
    colocated = LLM(model, dtype="float32", block_size=4).generate([PROMPT], sp)[0]
    pe, de = engine(PREFILL), engine(DECODE)
    connector = CopyConnector(pe, de)
    outputs: dict[int, list[int]] = {}
    pe.add_request("r", PROMPT, sp)
    for out in pe.step():
        outputs.setdefault(out.choice, []).extend(out.token_ids)
    handoff = connector.handoffs["r"]
    assert [c for c, _ in handoff.choices] == [0, 1, 2]
    de.add_remote_request("r", PROMPT, handoff.first_token, sp, handoff.choices)
    while de.has_unfinished() or de.scheduler.fetching:
        for out in de.step():
            outputs[out.choice].extend(out.token_ids)
    assert [outputs[i] for i in range(3)] == [c.token_ids for c in colocated.choices]
    # The decode worker received the prompt's KV once; all its blocks come back.
    assert len(connector.admitted) == 1
    assert de.pop_finished("r") is not None
    assert de.block_manager.num_free_blocks == 64 and pe.block_manager.num_free_blocks == 64


def test_abort_drops_every_choice(make_tiny_model):
    engine = LLMEngine(EngineConfig(model=str(make_tiny_model("llama")), dtype="float32",
                                    block_size=4, num_kv_blocks=64))  # fmt: skip
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=50, n=3, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort("r")
    assert not engine.seqs and engine.block_manager.num_free_blocks == 64
