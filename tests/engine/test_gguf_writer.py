"""tests/engine/gguf_writer.py: the GGUF files it writes load in Hugging Face transformers as the
checkpoint they came from -- the same weights, the same greedy text, the same token ids.

transformers is the independent reader here: its GGUF loader undoes llama.cpp's q/k permutation,
maps the tensor names back and rebuilds the tokenizer from metadata, so a writer that disagrees
with llama.cpp's layout fails these tests.

Three things a GGUF states that transformers' loader (5.x, legacy path for llama/qwen2/qwen3)
does not read, so the tests hand them over at load time, each taken from the file or checked
against it first:

- qwen3's `attention.key_length` (its mapping has no head_dim, so Qwen3Config's default 128 is
  used and the 48-wide tiny heads do not fit);
- llama's `rope_freqs.weight` (llama3 rope scaling; transformers ignores the tensor and loads
  default rope), checked against transformers' own llama3 frequencies in
  `test_llama3_rope_freqs_match_transformers`;
- text normalization: a GGUF has no normalizer, so text that is not already NFC can encode
  differently (the non-ASCII strings below are NFC).

Each GGUF goes in a directory of its own: given a directory that also holds tokenizer.json,
`AutoTokenizer.from_pretrained(dir, gguf_file=...)` would read that file and test nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from gguf_writer import write_gguf

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
PROMPTS = ("The quick brown fox", "Once upon a time, in a land far away")
TEXTS = (
    "Hello world 12345",
    "café naïve — Grüße, 日本語のテキスト, Привет мир 🙂",
    "  leading spaces\n\n\ttabs\r\nand lines",
    "<|im_start|>user\nspecial tokens in text<|eos|>",
)
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi — in Français, s'il vous plaît."},
]


@dataclass
class Converted:
    arch: str
    gguf_path: Path
    ref_model: Any
    ref_tok: Any
    model: Any
    tok: Any


def _reader_field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _load_overrides(gguf_path: Path, ref_config: Any) -> dict[str, Any]:
    """Config values the file states but transformers' GGUF loader does not read."""
    reader = gguf.GGUFReader(gguf_path)
    arch = _reader_field(reader, "general.architecture")
    overrides: dict[str, Any] = {}
    if (key_length := _reader_field(reader, f"{arch}.attention.key_length")) is not None:
        overrides["head_dim"] = int(key_length)
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        # The tensor itself is checked against these settings in the rope test below.
        overrides["rope_parameters"] = dict(ref_config.rope_parameters)
    return overrides


def _load_pair(src: Path, gguf_path: Path) -> tuple[Any, Any, Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        **_load_overrides(gguf_path, ref_model.config),
    ).eval()
    ref_tok = AutoTokenizer.from_pretrained(src)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return ref_model, ref_tok, model, tok


@pytest.fixture(scope="module", params=ARCHS)
def converted(request, make_tiny_model, tmp_path_factory) -> Converted:
    arch = request.param
    src = make_tiny_model(arch, "tiny", 0)
    gguf_path = write_gguf(src, tmp_path_factory.mktemp(f"gguf-{arch}") / f"{arch}.gguf")
    return Converted(arch, gguf_path, *_load_pair(src, gguf_path))


def test_parameters_are_identical(converted):
    ref = dict(converted.ref_model.named_parameters())
    got = dict(converted.model.named_parameters())
    assert sorted(got) == sorted(ref)
    for name, value in ref.items():
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], value), name


def test_greedy_generation_is_identical(converted):
    tok = converted.ref_tok
    for prompt in PROMPTS:
        enc = tok(prompt, return_tensors="pt")
        kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
        with torch.no_grad():
            want = converted.ref_model.generate(**enc, **kwargs)
            got = converted.model.generate(**enc, **kwargs)
        assert want.shape[1] > enc["input_ids"].shape[1], "generated nothing: the check is empty"
        assert torch.equal(got, want), prompt


def test_tokenizer_encodes_identically(converted):
    ref, tok = converted.ref_tok, converted.tok
    texts = list(TEXTS)
    if ref.chat_template:
        assert tok.chat_template == ref.chat_template
        texts.append(ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True))
        want = ref.apply_chat_template(MESSAGES, add_generation_prompt=True)
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True) == want
    for text in texts:
        ids = ref(text)["input_ids"]
        assert tok(text)["input_ids"] == ids, text
        assert tok.decode(ids) == ref.decode(ids), text
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        ref.bos_token,
        ref.eos_token,
        ref.pad_token,
    )
    # transformers' byte-level GGUF tokenizer adds an "<|endoftext|>" past the vocab when the file
    # has no unknown token; every id the model has must still mean the same token.
    n_vocab = converted.model.config.vocab_size
    assert {t: i for t, i in tok.get_vocab().items() if i < n_vocab} == ref.get_vocab()


def test_metadata_and_tensor_layout(converted):
    reader = gguf.GGUFReader(converted.gguf_path)
    config = converted.ref_model.config
    arch = "llama" if converted.arch == "mistral" else converted.arch
    assert _reader_field(reader, "general.architecture") == arch
    if converted.arch == "mistral":
        assert "mistral" in _reader_field(reader, "general.name").lower()
    assert _reader_field(reader, f"{arch}.block_count") == config.num_hidden_layers
    assert _reader_field(reader, f"{arch}.attention.head_count_kv") == config.num_key_value_heads
    assert _reader_field(reader, f"{arch}.rope.freq_base") == pytest.approx(
        config.rope_parameters["rope_theta"]
    )
    has_key_length = _reader_field(reader, f"{arch}.attention.key_length") is not None
    assert has_key_length == (config.head_dim != config.hidden_size // config.num_attention_heads)
    assert _reader_field(reader, "general.file_type") == gguf.LlamaFileType.ALL_F32
    assert _reader_field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _reader_field(reader, "tokenizer.ggml.pre") == "qwen2"  # make_model's split regex
    assert _reader_field(reader, "tokenizer.ggml.add_bos_token") is False
    names = {t.name for t in reader.tensors}
    assert ("output.weight" in names) == (not config.tie_word_embeddings)
    assert ("rope_freqs.weight" in names) == (converted.arch == "llama")
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)


def test_llama3_rope_freqs_match_transformers(make_tiny_model, tmp_path):
    """rope_freqs.weight divides each default rope frequency into the llama3-scaled one, as
    transformers computes it (the tiny llama's original context is 256, so it matters)."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_model("llama", "tiny", 0)
    reader = gguf.GGUFReader(write_gguf(src, tmp_path / "llama.gguf"))
    (freqs,) = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    config = model.config
    dim, theta = config.head_dim, config.rope_parameters["rope_theta"]
    default = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    ratio = default / model.model.rotary_emb.inv_freq
    assert not torch.allclose(ratio, torch.ones_like(ratio)), "no scaling: the check is empty"
    torch.testing.assert_close(torch.from_numpy(freqs.data.copy()), ratio, rtol=1e-5, atol=0)


@pytest.mark.parametrize("tensor_type", ["F16", "BF16", "Q8_0"])
def test_reduced_types_on_llama(make_tiny_model, tmp_path, tensor_type):
    """2-D weights come back as the type's rounding of the original (Q8_0: within half a step
    of its per-32 scale); 1-D norms stay F32 and exact, as llama.cpp writes them."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_model("llama", "tiny", 0)
    path = write_gguf(src, tmp_path / f"llama-{tensor_type}.gguf", tensor_type)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        want = gguf.GGMLQuantizationType.F32 if len(t.shape) == 1 else qtype
        assert t.tensor_type == want, t.name
    ref = dict(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).named_parameters())
    got = dict(
        AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=path.name, dtype=torch.float32
        ).named_parameters()
    )
    assert sorted(got) == sorted(ref)
    cast = {"F16": torch.float16, "BF16": torch.bfloat16}.get(tensor_type)
    for name, value in ref.items():
        assert got[name].shape == value.shape, name
        if value.ndim == 1:
            assert torch.equal(got[name], value), name
        elif cast is not None:
            assert torch.equal(got[name], value.to(cast).float()), name
        else:
            err = (got[name] - value).abs().max().item()
            assert 0 < err < 0.01 * value.abs().max().item(), (name, err)


def test_rejects_unknown_tensor_type(make_tiny_model, tmp_path):
    with pytest.raises(ValueError, match="tensor_type"):
        write_gguf(make_tiny_model("llama", "tiny", 0), tmp_path / "x.gguf", "Q4_K")
    assert not (tmp_path / "x.gguf").exists()
