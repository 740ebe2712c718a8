"""`tandem serve` with quantized pools, 1 prefill + 1 decode worker, `--disagg-threshold 0` (every
request is prefilled on the prefill worker and its KV pulled over NIXL by the decode worker).

`--decode-quantization int8` (a random-weight tiny llama): the decode pool loads int8 weights,
the prefill pool keeps full ones, and disaggregated requests
- produce exactly the tokens of the same two engines wired in one process (fp32 prefill, KV
  copied, int8 decode): the served path adds no error of its own;
- agree with the unquantized model's greedy tokens within a stated bound: the first token
  always (it comes from the full-precision prefill pool), and at least 80% of all positions
  (92% measured here: 177 of 192; a random-weight model's next-token distributions are near
  flat, so int8 rounding flips near-ties and greedy paths part);
- were decoded from transferred KV (no recompute, exact bytes), and give every block back.

`--quantized` (the quantized profile) on a tiny llama trained on the tokenizer corpus (peaked
distributions, readable greedy text): FP8 W8A8 prefill pool (`fp8`), weight-only decode pool
(`int8` on CPU), FP8 KV (`fp8_e4m3`) handed between two pools that quantize their weights
differently. Corpus prompts
- produce exactly the tokens of the same two engines in one process (fp8 prefill, FP8 KV
  copied with its scales, int8 decode);
- agree with the unquantized fp32 model at >= 95% of positions and give its text for at least
  5 of 6 prompts (measured: 384 of 384 positions, 6 of 6 texts);
- were decoded from transferred FP8 KV (its byte count: one byte an element plus the per-token
  scales), and give every block back.
A KV dtype mismatch between the pools is refused at the handshake instead
(tests/kv_transfer/test_kv_dtype_handshake.py).

FP8 checkpoints as users have them (compressed-tensors FP8_DYNAMIC and block-wise
`quant_method: fp8`, written by tests/fp8_checkpoints.py from the trained model) serve with
the defaults: both pools keep the checkpoint's FP8 weights (W8A8 prefill, FP8 weight-only
decode), with the same exactness, agreement and KV checks."""

from __future__ import annotations

import random
import re

import openai
import pytest
from e2e_helpers import TransferCheck, kv_block_bytes
from kv_copy import disaggregated_greedy

from engine import LLM, SamplingParams
from engine.kv_cache import KVCache
from engine.llm_engine import EngineConfig, LLMEngine

MAX_TOKENS = 24
MIN_AGREEMENT = 0.80

# The quantized profile on the trained model.
PROFILE_TOKENS = 64
PROFILE_MIN_AGREEMENT = 0.95  # measured 1.0 (384 of 384 positions)
PROFILE_MIN_SAME_TEXTS = 5  # of 6 prompts; measured 6
PROMPT_TOKENS = 24
# Passages of tools/tokenizer_corpus.py ENGLISH_TEXT, by their opening words.
PASSAGES = (
    "Once upon a time",
    "Large language models",
    "User: What is the capital",
    "The history of science",
    "Recipe for a simple bread",
    '"Where are you going?"',
)


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
        assert _worker_weights(server) == {"prefill-0": "float32", "decode-0": "int8"}
        check = TransferCheck(server, e2e_model)
        got = _served_texts(server, prompts, MAX_TOKENS)
        check.verify([len(p) for p in prompts])
        server.wait_all_blocks_free()
    tok = _tokenizer(e2e_model)
    assert got == [tok.decode(ids, skip_special_tokens=True) for ids in want_int8]
    assert all(a[0] == b[0] for a, b in zip(want_int8, want_full, strict=True))
    assert _agreement(want_int8, want_full) >= MIN_AGREEMENT


@pytest.fixture(scope="session")
def trained_model(make_trained_model):
    """The tiny llama trained on the tokenizer corpus (it memorises it)."""
    return make_trained_model("llama")


def _profile_references(model, prompts, sp):
    """(fp8 prefill + FP8 KV + int8 decode in one process, fp32 LLM) greedy tokens, and the
    bytes of one FP8 KV block by the engine's own layout."""
    kw = dict(model=str(model), dtype="float32", num_kv_blocks=128, kv_dtype="fp8_e4m3")
    pe = LLMEngine(EngineConfig(**kw, role="prefill", quantization="fp8"))
    de = LLMEngine(EngineConfig(**kw, role="decode", quantization="int8"))
    assert (pe.quantization, de.quantization) == ("fp8", "int8")
    quant = disaggregated_greedy(pe, de, prompts, sp)
    full = [o.token_ids for o in LLM(str(model), dtype="float32").generate(prompts, sp)]
    return quant, full, KVCache.bytes_per_block(pe.kv_spec)


def _corpus_prompts(model) -> list[list[int]]:
    """The first PROMPT_TOKENS tokens of each of PASSAGES, by the model's tokenizer."""
    from tools.tokenizer_corpus import ENGLISH_TEXT

    tok = _tokenizer(model)
    passages = ENGLISH_TEXT.split("\n\n")
    out = []
    for opening in PASSAGES:
        (text,) = [p for p in passages if p.startswith(opening)]
        out.append(tok(text, add_special_tokens=False)["input_ids"][:PROMPT_TOKENS])
    assert all(len(p) == PROMPT_TOKENS for p in out)
    return out


def test_quantized_profile_serves_fp8_prefill_int8_decode_fp8_kv(start_serve, trained_model):
    prompts = _corpus_prompts(trained_model)
    sp = SamplingParams(max_tokens=PROFILE_TOKENS, temperature=0, ignore_eos=True)
    want_quant, want_full, block_bytes = _profile_references(trained_model, prompts, sp)
    # The helper's own arithmetic for the bytes TransferCheck expects matches the engine's.
    assert kv_block_bytes(trained_model, kv_dtype="fp8_e4m3") == block_bytes
    flags = ("--quantized", "--dtype", "float32", "--disagg-threshold", "0")
    with start_serve(trained_model, *flags) as server:
        assert _worker_weights(server) == {"prefill-0": "fp8", "decode-0": "int8"}
        check = TransferCheck(server, trained_model, kv_dtype="fp8_e4m3")
        got = _served_texts(server, prompts, PROFILE_TOKENS)
        check.verify([len(p) for p in prompts])
        server.wait_all_blocks_free()
    tok = _tokenizer(trained_model)
    assert got == [tok.decode(ids, skip_special_tokens=True) for ids in want_quant]
    assert _agreement(want_quant, want_full) >= PROFILE_MIN_AGREEMENT
    full_texts = [tok.decode(ids, skip_special_tokens=True) for ids in want_full]
    assert sum(a == b for a, b in zip(got, full_texts, strict=True)) >= PROFILE_MIN_SAME_TEXTS


@pytest.mark.parametrize("fmt", ["compressed-tensors", "block-fp8"])
def test_fp8_checkpoint_serves_disaggregated(start_serve, trained_model, tmp_path, fmt):
    """An FP8 checkpoint as users have it (llm-compressor's FP8_DYNAMIC, or block-wise
    `quant_method: fp8`) through `tandem serve` 1P1D with the defaults: both pools keep its
    FP8 weights (auto: W8A8 prefill; `weight-only` decode: FP8 weight-only), the KV is
    handed over, and the served tokens are exactly those of the same two engines in one
    process, which agree with the full-precision model's on >= 95% of positions."""
    import fp8_checkpoints as fc

    ckpt = tmp_path / fmt
    if fmt == "compressed-tensors":
        fc.write_compressed_tensors(trained_model, ckpt, weights="channel", activations="dynamic")
    else:
        fc.write_block_fp8(trained_model, ckpt)
    prompts = _corpus_prompts(trained_model)[:3]
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    kw = dict(model=str(ckpt), dtype="float32", num_kv_blocks=128)
    pe = LLMEngine(EngineConfig(**kw, role="prefill"))
    de = LLMEngine(EngineConfig(**kw, role="decode", quantization="weight-only"))
    assert (pe.quantization, de.quantization) == ("fp8", "fp8-weight-only")
    want = disaggregated_greedy(pe, de, prompts, sp)
    full = [o.token_ids for o in LLM(str(trained_model), dtype="float32").generate(prompts, sp)]
    flags = ("--dtype", "float32", "--disagg-threshold", "0")
    with start_serve(ckpt, *flags, "--decode-quantization", "weight-only") as server:
        assert _worker_weights(server) == {"prefill-0": "fp8", "decode-0": "fp8-weight-only"}
        check = TransferCheck(server, ckpt)
        got = _served_texts(server, prompts, 32)
        check.verify([len(p) for p in prompts])
        server.wait_all_blocks_free()
    tok = _tokenizer(trained_model)
    assert got == [tok.decode(ids, skip_special_tokens=True) for ids in want]
    assert _agreement(want, full) >= PROFILE_MIN_AGREEMENT


def _worker_weights(server) -> dict[str, str]:
    """worker id -> the weights its startup line reports (`tandem: <worker> ... weights X`)."""
    log = server.log_path.read_text()
    return dict(re.findall(r"tandem:\s+(\S+)\s+\S+\s+requests .* weights (\S+)", log))


def _served_texts(server, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Greedy completions of token-id prompts, one at a time, each checked to have been
    prefilled on the prefill pool and decoded on decode-0 to `max_tokens` tokens."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    got = []
    for prompt in prompts:
        raw = client.completions.with_raw_response.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert raw.headers["X-Tandem-Path"] == "remote"  # prefilled on the prefill pool
        assert raw.headers["X-Tandem-Decode-Worker"] == "decode-0"
        out = raw.parse()
        assert out.usage.completion_tokens == max_tokens
        got.append(out.choices[0].text)
    return got


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of positions where two sets of equally long greedy outputs agree."""
    pairs = [(x, y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def _tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))
