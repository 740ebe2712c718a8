"""`tandem serve --decode-quantization int8`: the decode pool loads int8 weights, the prefill
pool keeps full ones, and disaggregated requests (prefill there, KV over NIXL, int8 decode
here):
- produce exactly the tokens of the same two engines wired in one process (fp32 prefill, KV
  copied, int8 decode): the served path adds no error of its own;
- agree with the unquantized model's greedy tokens within a stated bound: the first token
  always (it comes from the full-precision prefill pool), and at least 80% of all positions
  (92% measured here: 177 of 192; a random-weight model's next-token distributions are near
  flat, so int8 rounding flips near-ties and greedy paths part). Accuracy bounds on peaked
  models belong to the quantization issue's benchmarks;
- were decoded from transferred KV (no recompute, exact bytes), and give every block back."""

from __future__ import annotations

import random
import re

import openai
from e2e_helpers import TransferCheck
from kv_copy import disaggregated_greedy

from engine import LLM, SamplingParams
from engine.llm_engine import EngineConfig, LLMEngine

MAX_TOKENS = 24
MIN_AGREEMENT = 0.80


def _prompts(n: int = 8) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, 1000) for _ in range(rng.randrange(20, 60))] for _ in range(n)]


def _references(model, prompts, sp):
    kw = dict(model=str(model), dtype="float32", num_kv_blocks=128)
    pe = LLMEngine(EngineConfig(**kw, role="prefill"))
    de = LLMEngine(EngineConfig(**kw, role="decode", quantization="int8"))
    int8 = disaggregated_greedy(pe, de, prompts, sp)
    full = [o.token_ids for o in LLM(str(model), dtype="float32").generate(prompts, sp)]
    return int8, full


def test_int8_decode_pool_serves_disaggregated_requests(start_serve, e2e_model):
    prompts = _prompts()
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    want_int8, want_full = _references(e2e_model, prompts, sp)
    with start_serve(
        e2e_model, "--dtype", "float32", "--disagg-threshold", "0", "--decode-quantization", "int8"
    ) as server:
        weights = dict(
            re.findall(
                r"tandem:\s+(\S+)\s+\S+\s+requests .* weights (\S+)", server.log_path.read_text()
            )
        )
        assert weights == {"prefill-0": "float32", "decode-0": "int8"}
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        check = TransferCheck(server, e2e_model)
        got = []
        for prompt in prompts:
            raw = client.completions.with_raw_response.create(
                model=model,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert raw.headers["X-Tandem-Path"] == "remote"  # prefilled on the prefill pool
            assert raw.headers["X-Tandem-Decode-Worker"] == "decode-0"
            out = raw.parse()
            assert out.usage.completion_tokens == MAX_TOKENS
            got.append(out.choices[0].text)
        check.verify([len(p) for p in prompts])
        server.wait_all_blocks_free()
    tok = _tokenizer(e2e_model)
    assert got == [tok.decode(ids, skip_special_tokens=True) for ids in want_int8]
    assert all(a[0] == b[0] for a, b in zip(want_int8, want_full, strict=True))
    same = sum(
        x == y for a, b in zip(want_int8, want_full, strict=True) for x, y in zip(a, b, strict=True)
    )
    assert same / (len(prompts) * MAX_TOKENS) >= MIN_AGREEMENT


def _tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))
