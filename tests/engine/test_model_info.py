"""engine/model_info.py, the one reader of a model directory that the router and the engine share
(tokenizer, chat template, context window, vocabulary, EOS ids, sampling defaults), and
`LLM(model, **settings)`."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.config import ModelConfig
from engine.llm import LLM
from engine.llm_engine import EngineConfig
from engine.model_info import (
    ModelInfo,
    context_window,
    eos_token_ids,
    generation_defaults,
    load_tokenizer,
    read_model_info,
)
from router.config import RouterConfig
from router.server import load_model_info

REPO = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
import engine.model_info
print(json.dumps({m: m in sys.modules for m in ("torch", "transformers")}))
"""


def test_importing_the_reader_loads_neither_torch_nor_transformers():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "torch": False,
        "transformers": False,
    }


@pytest.fixture(scope="module")
def model(make_tiny_model) -> str:
    return str(make_tiny_model("llama"))


def test_read_model_info(model):
    info = read_model_info(model)
    hf = json.loads(Path(model, "config.json").read_text())
    assert isinstance(info, ModelInfo)
    assert info.max_model_len == hf["max_position_embeddings"]
    assert info.vocab_size == hf["vocab_size"] == len(info.tokenizer)
    assert info.eos_token_ids == (hf["eos_token_id"],)
    assert info.chat_template and "<|im_start|>" in info.chat_template
    assert info.tokenizer.decode(info.tokenizer("hello world")["input_ids"]) == "hello world"


@pytest.mark.parametrize("cap", [None, 2, 100, 1024, 5000])
def test_router_and_engine_compute_the_same_context_window(model, cap):
    router = load_model_info(RouterConfig(model_path=model, max_model_len=cap)).max_model_len
    engine = ModelConfig.from_pretrained(model).context_window(cap)
    assert router == engine == min(1024, cap or 1024)


def test_the_engine_serves_that_window(model):
    llm = LLM(model, dtype="float32", num_kv_blocks=8, max_model_len=100)
    assert llm.engine.max_model_len == read_model_info(model, 100).max_model_len == 100
    assert LLM(model, dtype="float32", num_kv_blocks=8).engine.max_model_len == 1024


def test_context_window_precedence():
    assert context_window(SimpleNamespace(max_position_embeddings=4096), None) == 4096
    assert context_window(SimpleNamespace(max_position_embeddings=4096), 512) == 512
    assert context_window(SimpleNamespace(max_position_embeddings=512), 4096) == 512
    assert context_window(SimpleNamespace(), 300) == 300  # no key: the cap is the window
    with pytest.raises(ValueError, match="no max_position_embeddings; set max_model_len"):
        context_window(SimpleNamespace(), None, "some/dir")


def test_eos_ids_and_generation_defaults(tmp_path):
    assert eos_token_ids(tmp_path, SimpleNamespace(eos_token_id=[5, 6])) == (5, 6)
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [7, 5], "temperature": 0.6, "top_k": None, "foo": 1})
    )
    # generation_config.json's ids first (it may list several), then config.json's, once each.
    assert eos_token_ids(tmp_path, SimpleNamespace(eos_token_id=5)) == (7, 5)
    assert generation_defaults(tmp_path) == {"temperature": 0.6}


def test_tokenizer_optional_for_the_engine_required_for_the_router(model, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(Path(model, "config.json"), bare / "config.json")
    assert load_tokenizer(bare) is None
    with pytest.raises((OSError, ValueError)):
        read_model_info(bare)


def test_llm_settings_are_engine_config_fields(model):
    llm = LLM(model)
    assert llm.engine.config == EngineConfig(model=model)  # EngineConfig's defaults, all
    llm = LLM(Path(model), dtype="float32", max_num_seqs=3, block_size=4, num_kv_blocks=16)
    assert llm.engine.config == dataclasses.replace(
        EngineConfig(model=model), dtype="float32", max_num_seqs=3, block_size=4, num_kv_blocks=16
    )
    with pytest.raises(TypeError, match="'blok_size', 'max_seqs'") as err:
        LLM(model, blok_size=4, max_seqs=2, dtype="float32")
    assert "block_size" in str(err.value)  # the known ones are listed


def _without_tokenizer(model: str, dest: Path) -> Path:
    """The model's weights and config, no tokenizer files."""
    dest.mkdir()
    for f in Path(model).iterdir():
        if f.is_file() and not f.name.startswith(("tokenizer", "special_tokens", "vocab")):
            shutil.copy(f, dest / f.name)
    assert load_tokenizer(dest) is None
    return dest


def test_a_tokenizer_from_elsewhere_serves_a_model_without_one(model, tmp_path):
    bare = _without_tokenizer(model, tmp_path / "weights-only")
    info = read_model_info(bare, tokenizer=model)
    assert info.chat_template == read_model_info(model).chat_template
    via_router = load_model_info(RouterConfig(model_path=str(bare), tokenizer=model))
    assert via_router.vocab_size == info.vocab_size
    ids = info.tokenizer("the tokenizer override")["input_ids"]
    own = LLM(model, dtype="float32", num_kv_blocks=16)
    other = LLM(bare, dtype="float32", num_kv_blocks=16, tokenizer=model)
    assert other.tokenizer("the tokenizer override")["input_ids"] == ids
    from engine.protocol import SamplingParams

    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    assert [o.text for o in other.generate(["hello there"], greedy)] == [
        o.text for o in own.generate(["hello there"], greedy)
    ]


def test_a_tokenizer_override_that_cannot_serve_is_refused(model, tmp_path, make_tiny_model):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        read_model_info(model, tokenizer=tmp_path)
    # A tokenizer naming ids past the model's embedding would turn prompts into 400s.
    small = Path(make_tiny_model("llama"))
    big_vocab = tmp_path / "big"
    shutil.copytree(small, big_vocab)
    cfg = json.loads((big_vocab / "config.json").read_text())
    cfg["vocab_size"] = len(read_model_info(model).tokenizer) - 1
    (big_vocab / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="embeds"):
        read_model_info(big_vocab, tokenizer=model)
