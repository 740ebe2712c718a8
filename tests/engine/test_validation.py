"""Bad parameters raise ValueError naming the field, and leave the engine untouched."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop_token_ids": (-3,)}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_sampling_params_reject(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(make_tiny_model):
    return LLM(make_tiny_model("llama"), dtype="float32")


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([], "empty"),
        ("", "empty"),
        ([1, 2, 1024], r"\[0, 1024\)"),
        ([-1, 5], r"\[0, 1024\)"),
        ([5] * 1024, "context window"),
    ],
)
def test_bad_prompts(llm, prompt, match):
    free = llm.engine.block_manager.num_free_blocks
    with pytest.raises(ValueError, match=match):
        llm.generate([[7, 8, 9], prompt], SamplingParams(max_tokens=4))
    # All-or-nothing: the good prompt was not admitted either.
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.num_free_blocks == free


def test_engine_config_rejects(make_tiny_model):
    path = make_tiny_model("llama")
    for kwargs, field in [
        ({"block_size": 12}, "block_size"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"dtype": "int3"}, "dtype"),
        ({"attention_backend": "magic"}, "attention_backend"),
        ({"load_format": "pt"}, "load_format"),
    ]:
        with pytest.raises(ValueError, match=field):
            LLM(path, **kwargs)


def test_prompt_larger_than_cache(make_tiny_model):
    llm = LLM(make_tiny_model("llama"), dtype="float32", num_kv_blocks=2)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([[5] * 40], SamplingParams(max_tokens=2))


def test_dummy_load_format_is_seeded(make_tiny_model):
    path = make_tiny_model("qwen3")
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    a = LLM(path, load_format="dummy", seed=5, dtype="float32").generate([[4, 5, 6]], sp)
    b = LLM(path, load_format="dummy", seed=5, dtype="float32").generate([[4, 5, 6]], sp)
    c = LLM(path, load_format="dummy", seed=6, dtype="float32").generate([[4, 5, 6]], sp)
    assert a[0].token_ids == b[0].token_ids
    assert a[0].token_ids != c[0].token_ids
