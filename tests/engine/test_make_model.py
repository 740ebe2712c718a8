"""`tandem make-model`: checkpoints that Hugging Face transformers loads and runs."""

from __future__ import annotations

import json
import pathlib
import threading

import pytest
import torch
from safetensors.torch import load_file

from tools import make_model as make_model_module
from tools.make_model import ARCHS, COMPLETE_MARKER, cached_model, make_model, model_shape

PROMPT = "The capital of France is Paris, and the quick brown fox jumps."


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_model(root / arch, arch=arch, preset="tiny", seed=0) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_and_runs_tiny(arch: str, tiny_models: dict[str, pathlib.Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_models[arch]
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (path / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) <= model.config.vocab_size

    # Loaded weights are exactly the saved ones (nothing re-initialised as "missing").
    saved = load_file(path / "model.safetensors")
    live = model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(live[name], tensor), name

    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert int(ids.max()) < model.config.vocab_size
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    last = logits[0, -1]
    assert last.std() > 0.5  # logits spread out: greedy decoding has clear winners
    # Different positions give different distributions (attention/RoPE actually mix tokens).
    assert not torch.allclose(logits[0, -1], logits[0, -2])


def test_arch_features_differ(tiny_models: dict[str, pathlib.Path]) -> None:
    cfg = {a: json.loads((p / "config.json").read_text()) for a, p in tiny_models.items()}
    heads = {a: (c["num_attention_heads"], c["num_key_value_heads"]) for a, c in cfg.items()}
    assert heads["mistral"][0] == heads["mistral"][1]  # MHA
    assert 1 < heads["llama"][1] < heads["llama"][0]  # GQA
    assert heads["qwen3"][1] == 1  # MQA
    assert cfg["llama"]["rope_scaling"]["rope_type"] == "llama3"
    assert cfg["mistral"]["sliding_window"] is None
    assert cfg["qwen2"]["tie_word_embeddings"] is True
    assert cfg["qwen3"]["head_dim"] != cfg["qwen3"]["hidden_size"] // heads["qwen3"][0]

    qwen2 = load_file(tiny_models["qwen2"] / "model.safetensors")
    assert "lm_head.weight" not in qwen2  # tied
    assert qwen2["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0
    qwen3 = load_file(tiny_models["qwen3"] / "model.safetensors")
    q_norm = qwen3["model.layers.0.self_attn.q_norm.weight"]
    assert q_norm.shape == (cfg["qwen3"]["head_dim"],)
    assert not torch.equal(q_norm, torch.ones_like(q_norm))
    llama = load_file(tiny_models["llama"] / "model.safetensors")
    for name, tensor in llama.items():
        if name.endswith("norm.weight"):
            assert not torch.equal(tensor, torch.ones_like(tensor)), name


def test_llama3_rope_scaling_is_used(tiny_models: dict[str, pathlib.Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    rope_type = getattr(model.model.rotary_emb, "rope_type", None)
    assert rope_type == "llama3"


def test_same_seed_same_weights_different_seed_different(
    tmp_path: pathlib.Path, tiny_models: dict[str, pathlib.Path]
) -> None:
    again = make_model(tmp_path / "again", arch="qwen3", preset="tiny", seed=0)
    other = make_model(tmp_path / "other", arch="qwen3", preset="tiny", seed=1)
    first = (tiny_models["qwen3"] / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == first
    a, b = load_file(again / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert not torch.equal(a[name], b[name]), name
    assert (again / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_tokenizer_round_trip_and_chat_template(tiny_models: dict[str, pathlib.Path]) -> None:
    from transformers import AutoTokenizer

    for arch in ("llama", "qwen2"):  # qwen2 loads through transformers' own Qwen2Tokenizer
        tok = AutoTokenizer.from_pretrained(tiny_models[arch])
        for text in (PROMPT, "  two  spaces\n\tand tabs, 12345 digits; `code()` {x: 1}!", "a"):
            ids = tok.encode(text)
            assert ids and len(ids) < len(text) + 1
            assert tok.decode(ids) == text
        assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)  # no BOS
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == (
            "<|bos|><|im_start|>system\nBe brief.<|eos|>\n"
            "<|im_start|>user\nHi<|eos|>\n<|im_start|>assistant\n"
        )
        no_prompt = tok.apply_chat_template(messages, tokenize=False)
        assert not no_prompt.endswith("assistant\n")
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id and tok.eos_token_id in ids


def test_small_preset_sizes() -> None:
    for arch in ARCHS:
        shape = model_shape(arch, "small")
        assert 30e6 <= shape.num_parameters() <= 60e6, arch
        assert shape.vocab_size == 8192


def test_param_count_formula_matches_transformers() -> None:
    from transformers import AutoModelForCausalLM

    from tools.make_model import build_config

    for arch in ARCHS:
        shape = model_shape(arch, "tiny")
        model = AutoModelForCausalLM.from_config(build_config(shape))
        assert sum(p.numel() for p in model.parameters()) == shape.num_parameters(), arch


def test_max_position_embeddings_override(tmp_path: pathlib.Path) -> None:
    out = make_model(tmp_path / "m", arch="mistral", max_position_embeddings=4096)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 4096
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["model_max_length"] == 4096


def test_unknown_arch_is_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="unknown arch"):
        make_model(tmp_path / "x", arch="gpt2")


def test_cli(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoConfig

    from cluster.cli import main

    out = tmp_path / "cli-model"
    rc = main(["make-model", "--arch", "qwen3", "--preset", "tiny", "--seed", "1", str(out)])
    assert rc == 0
    assert "params=" in capsys.readouterr().out
    assert AutoConfig.from_pretrained(out).model_type == "qwen3"
    ref = make_model(tmp_path / "direct", arch="qwen3", preset="tiny", seed=1)
    assert (out / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()


def test_cached_model_is_made_once_and_reused(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoConfig

    path = cached_model("qwen3", "tiny", seed=2, cache_dir=tmp_path)
    assert path == tmp_path / "qwen3-tiny-seed2"
    assert (path / COMPLETE_MARKER).is_file()
    assert AutoConfig.from_pretrained(path).model_type == "qwen3"
    ref = make_model(tmp_path / "direct", arch="qwen3", preset="tiny", seed=2)
    assert (path / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()

    def must_not_make(*args, **kwargs):
        raise AssertionError("a complete cached model was made again")

    monkeypatch.setattr(make_model_module, "make_model", must_not_make)
    assert cached_model("qwen3", "tiny", seed=2, cache_dir=tmp_path) == path
    # Only the model and the reference are left: no temporary directory.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["direct", "qwen3-tiny-seed2"]


def _fake_make_model(calls: list[str], barrier: threading.Barrier | None = None):
    """A stand-in for make_model that writes one file naming its caller, optionally after
    every racing caller has started."""

    def fake(out, arch="llama", preset="tiny", seed=0, max_position_embeddings=None):
        if barrier is not None:
            barrier.wait(timeout=10)
        out = pathlib.Path(out)
        (out / "config.json").write_text(json.dumps({"made_by": threading.get_ident()}))
        calls.append(str(out))
        return out

    return fake


def test_cached_model_replaces_an_incomplete_directory(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(make_model_module, "make_model", _fake_make_model(calls))
    stale = tmp_path / "llama-small-seed0"
    stale.mkdir()
    (stale / "config.json").write_text("{}")  # a crash before the marker: never reused
    (stale / "half-written.safetensors").write_bytes(b"x")
    path = cached_model(cache_dir=tmp_path)
    assert path == stale and len(calls) == 1
    assert (path / COMPLETE_MARKER).is_file()
    assert not (path / "half-written.safetensors").exists()
    assert json.loads((path / "config.json").read_text())["made_by"]
    assert [p.name for p in tmp_path.iterdir()] == ["llama-small-seed0"]


def test_cached_model_failure_leaves_nothing_behind(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(out, **kwargs):
        (pathlib.Path(out) / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(make_model_module, "make_model", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        cached_model(cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="unknown arch"):
        cached_model("gpt2", cache_dir=tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_cached_model_two_racing_callers_share_one_copy(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    barrier = threading.Barrier(2)
    monkeypatch.setattr(make_model_module, "make_model", _fake_make_model(calls, barrier))
    results: list[pathlib.Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(cached_model("mistral", "tiny", cache_dir=tmp_path))
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    # Both made a copy (the barrier lets neither see the other's), one rename won, both
    # callers got that one, and the loser's copy is gone.
    assert len(calls) == 2
    assert results == [tmp_path / "mistral-tiny-seed0"] * 2
    assert (results[0] / COMPLETE_MARKER).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["mistral-tiny-seed0"]
