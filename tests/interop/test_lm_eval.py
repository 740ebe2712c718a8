"""lm-evaluation-harness 0.4.13's `local-completions` client against a live `tandem serve`.

Two tasks defined from local files (tests/interop/tasks/): a multiple-choice task, which lm-eval
scores by log-likelihood (each request a batch of token-id prompts with echo=true, logprobs=1,
max_tokens=1; it sums choices[i].logprobs.token_logprobs over the continuation and reads
is_greedy from top_logprobs), and a generate_until task (token-id prompts, stop "\\n").
Every log-likelihood and greedy flag lm-eval got equals transformers' fp32 answer on the same
tokens, and every generation equals transformers' greedy text cut at the stop string.
"""

from __future__ import annotations

import math

import pytest

from .lm_eval_client import encode_pair, evaluate
from .reference import TOL

MC, GEN = "tandem_interop_mc", "tandem_interop_gen"
MC_DOCS, GEN_DOCS = 6, 4  # lines of tasks/tandem_interop_mc.jsonl, tandem_interop_gen.jsonl
MC_REQUESTS = 20  # choices over the questions of tandem_interop_mc.jsonl
GEN_MAX_TOKENS = 8  # max_gen_toks of tandem_interop_gen.yaml


@pytest.fixture(scope="module")
def evaluation(server, model_name, interop_model, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf-datasets")
    return evaluate(server.url, model_name, str(interop_model), [MC, GEN], cache)


def test_both_tasks_complete(evaluation):
    res = evaluation["results"]
    assert set(res) >= {MC, GEN}, res
    assert 0.0 <= res[MC]["acc,none"] <= 1.0, res[MC]
    assert 0.0 <= res[GEN]["exact_match,none"] <= 1.0, res[GEN]
    assert len(evaluation["samples"][MC]) == MC_DOCS
    assert len(evaluation["samples"][GEN]) == GEN_DOCS


def test_loglikelihoods_equal_transformers(evaluation, reference):
    greedy = []
    for sample in evaluation["samples"][MC]:
        for (context, continuation), resps in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            ctx, cont = encode_pair(reference.tokenizer, context, continuation)
            assert cont, (context, continuation)
            (logprob, is_greedy), *_ = resps
            want, want_greedy = reference.continuation(ctx, cont)
            assert math.isfinite(logprob), (context, continuation, logprob)
            assert abs(logprob - want) < TOL, (context, continuation, logprob, want)
            assert bool(is_greedy) == want_greedy, (context, continuation, is_greedy)
            greedy.append(want_greedy)
    assert len(greedy) == MC_REQUESTS
    # The last two questions have the model's own greedy continuation among their choices.
    assert any(greedy) and not all(greedy), greedy


def test_generations_equal_transformers_greedy(evaluation, reference):
    texts = []
    for sample in evaluation["samples"][GEN]:
        ((context, gen_kwargs),) = sample["arguments"]
        assert gen_kwargs["until"] == ["\n"]
        ids = reference.tokenizer(context, add_special_tokens=False)["input_ids"]
        want = reference.greedy_text(list(ids), GEN_MAX_TOKENS, ignore_eos=False).split("\n")[0]
        ((got,),) = sample["resps"]
        assert got == want, (context, got, want)
        texts.append(got)
    assert any(texts), texts  # something was generated before the stop string


def test_every_kv_block_returned(evaluation, server):
    server.wait_all_blocks_free()
