"""GGUF checkpoints in the engine (engine/gguf_file.py): `LLM("model.gguf")` is token-exact
with transformers (fp32) on GGUF files written from the random test models of each
architecture (tests/engine/gguf_writer.py, llama.cpp's layout): against the checkpoint they came
from for F32 files, against transformers reading the same file for Q8_0. A damaged or
unsupported file fails at load with an error naming the field or tensor. SmolLM2-135M-Instruct's
registry file (Q4_1/Q8_0 tensors) is checked served, through both pools, in
tests/interop/test_real_model.py."""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import pytest
import torch
from gguf_writer import write_gguf

from engine import LLM, SamplingParams
from engine.gguf_file import GGUFError, converted_metadata

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
PROMPTS = ("The quick brown fox", "Once upon a time, in a land far away", "tandem serves")
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def gguf_of(make_tiny_model, tmp_path_factory):
    """`get(arch, tensor_type) -> Path`: the tiny random checkpoint of `arch` as a GGUF file
    (one folder per file), written once per module."""

    @functools.cache
    def get(arch: str, tensor_type: str = "F32") -> Path:
        out = tmp_path_factory.mktemp(f"gguf-{arch}-{tensor_type}") / f"{arch}.gguf"
        return write_gguf(make_tiny_model(arch), out, tensor_type)

    return get


def _hf_greedy(model, tok, prompt: str) -> list[int]:
    ids = tok(prompt)["input_ids"]
    model.generation_config.eos_token_id = None  # the engine side ignores EOS too
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


def _tandem_greedy(path: Path, prompts) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(list(prompts), sp)]


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_gguf_token_exact_with_the_checkpoint_it_came_from(arch, gguf_of, make_tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = make_tiny_model(arch)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(src)
    got = _tandem_greedy(gguf_of(arch), PROMPTS)
    for prompt, ids in zip(PROMPTS, got, strict=True):
        assert ids == _hf_greedy(model, tok, prompt), (arch, prompt)


def test_llama3_rope_scaling_is_read_from_rope_freqs(gguf_of, make_tiny_model):
    """llama.cpp keeps llama-3 rope scaling as a tensor; the converted config states it as
    transformers does (the tiny llama's original context is 256 positions)."""
    import json

    reader = gguf.GGUFReader(gguf_of("llama"))
    assert any(t.name == "rope_freqs.weight" for t in reader.tensors)
    config = json.loads((converted_metadata(str(gguf_of("llama"))) / "config.json").read_text())
    source = json.loads((make_tiny_model("llama") / "config.json").read_text())
    rope = config["rope_parameters"]
    for key in ("rope_type", "factor", "low_freq_factor", "high_freq_factor"):
        assert rope[key] == source["rope_parameters"][key], key
    assert rope["original_max_position_embeddings"] == 256


def test_q8_0_gguf_token_exact_with_transformers_on_the_same_file(gguf_of):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_of("qwen2", "Q8_0")
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    got = _tandem_greedy(path, PROMPTS)
    for prompt, ids in zip(PROMPTS, got, strict=True):
        assert ids == _hf_greedy(model, tok, prompt), prompt


@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0"])
def test_a_converted_file_loads_from_its_tensor_index_without_parsing(
    gguf_of, monkeypatch, tensor_type
):
    """Once a file version is converted, loading it parses its metadata no more (GGUFReader
    reads every field, the whole vocabulary included: ~8 s of CPU per process for SmolLM2):
    the converted folder's tensor index maps the same tensors, type and bytes, and `LLM`
    gives the same tokens with the reader made to fail."""
    from engine import gguf_file

    path = gguf_of("llama", tensor_type)
    want = _tandem_greedy(path, PROMPTS[:1])  # converts the file (if not yet) and loads it
    reader = gguf.GGUFReader(path)
    arch, n_blocks, tensors = gguf_file._indexed_tensors(str(path))
    assert (arch, n_blocks) == ("llama", reader.fields["llama.block_count"].contents())
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for mine, ref in zip(tensors, reader.tensors, strict=True):
        assert mine.tensor_type == ref.tensor_type and mine.data.shape == ref.data.shape
        assert mine.data.dtype == ref.data.dtype and (mine.data == ref.data).all(), mine.name

    def refuse(*args):
        raise AssertionError("the GGUF file was parsed again")

    gguf_file._open_reader.cache_clear()
    monkeypatch.setattr(gguf_file, "_open_reader", refuse)
    assert _tandem_greedy(path, PROMPTS[:1]) == want


# ------------------------------------------------------------------ damaged and unsupported files


def _rewrite(src: Path, dst: Path, fields=None, drop_fields=(), tensors=None, drop_tensors=()):
    """`src` written again with metadata `fields` set (name -> (value, GGUFValueType)) or
    dropped, and `tensors` (name -> array) added or replacing, or dropped."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    fields = fields or {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in drop_fields or name == "general.architecture":
            continue
        value, vtype = fields.pop(name, (field.contents(), field.types[0]))
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub)
    for name, (value, vtype) in fields.items():
        writer.add_key_value(name, value, vtype)
    tensors = dict(tensors or {})
    for t in reader.tensors:
        if t.name not in drop_tensors:
            data = tensors.pop(t.name, None)
            writer.add_tensor(t.name, t.data if data is None else data)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _load_error(path: Path) -> str:
    with pytest.raises((GGUFError, ValueError)) as err:
        LLM(str(path), dtype="float32", num_kv_blocks=8)
    return str(err.value)


STR, U32 = gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT32


def test_truncated_file_is_named(gguf_of, tmp_path):
    data = gguf_of("qwen2").read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: len(data) // 2])
    assert "not a readable GGUF file" in _load_error(bad)


def test_bad_magic_is_named(gguf_of, tmp_path):
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGML" + gguf_of("qwen2").read_bytes()[4:])
    assert "not a readable GGUF file" in _load_error(bad)


def test_unsupported_architecture_names_the_field(gguf_of, tmp_path):
    bad = _rewrite(gguf_of("qwen2"), tmp_path / "arch.gguf")
    raw = bad.read_bytes().replace(b"qwen2", b"gpt2x", 1)  # the architecture value
    bad.write_bytes(raw)
    msg = _load_error(bad)
    assert "'general.architecture'" in msg and "gpt2x" in msg, msg


@pytest.mark.parametrize("field", ["qwen2.block_count", "qwen2.attention.head_count"])
def test_missing_metadata_names_the_field(field, gguf_of, tmp_path):
    bad = _rewrite(gguf_of("qwen2"), tmp_path / "missing.gguf", drop_fields=(field,))
    msg = _load_error(bad)
    assert f"'{field}' is missing" in msg, msg


def test_zero_count_names_the_field(gguf_of, tmp_path):
    fields = {"qwen2.embedding_length": (0, U32)}
    bad = _rewrite(gguf_of("qwen2"), tmp_path / "zero.gguf", fields=fields)
    assert "'qwen2.embedding_length' is 0" in _load_error(bad)


def test_missing_tensor_is_named(gguf_of, tmp_path):
    bad = _rewrite(gguf_of("qwen2"), tmp_path / "lacks.gguf", drop_tensors=("blk.1.ffn_up.weight",))
    assert "layers.1.mlp.gate_up_proj" in _load_error(bad)


def test_unknown_tensor_is_named(gguf_of, tmp_path):
    extra = {"blk.0.attn_bogus.weight": torch.zeros(4, 4).numpy()}
    bad = _rewrite(gguf_of("qwen2"), tmp_path / "extra.gguf", tensors=extra)
    assert "'blk.0.attn_bogus.weight'" in _load_error(bad)


def test_wrong_shape_is_named(gguf_of, tmp_path):
    reader = gguf.GGUFReader(gguf_of("qwen2"))
    up = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    wrong = {"blk.0.ffn_up.weight": up.data[:, :-1].copy()}
    bad = _rewrite(gguf_of("qwen2"), tmp_path / "shape.gguf", tensors=wrong)
    assert "model.layers.0.mlp.up_proj.weight: shape" in _load_error(bad)


def test_rope_freqs_that_are_not_llama3_are_refused(gguf_of, tmp_path):
    reader = gguf.GGUFReader(gguf_of("llama"))
    freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data.copy()
    freqs[: len(freqs) // 2] = 3.0  # high frequencies scaled: no llama-3 parameters give it
    bad = _rewrite(gguf_of("llama"), tmp_path / "rope.gguf", tensors={"rope_freqs.weight": freqs})
    assert "'rope_freqs.weight' is not llama-3 rope scaling" in _load_error(bad)


def test_other_formats_keep_loading(make_tiny_model):
    out = LLM(str(make_tiny_model("qwen2")), dtype="float32", num_kv_blocks=16).generate(
        ["hello"], SamplingParams(max_tokens=2, temperature=0)
    )
    assert len(out[0].token_ids) == 2
