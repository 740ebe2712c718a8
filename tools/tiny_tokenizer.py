"""The byte-level BPE tokenizer of `tandem make-model`'s checkpoints (tools/make_model.py):
trained once per vocabulary size on the embedded corpus (tools/tokenizer_corpus.py), with fixed
special tokens at ids 0..3 and a ChatML chat template that renders tools in the Hermes format.
`build_tokenizer` makes it, `save_tokenizer` writes it so transformers 4 and 5 both read it.
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Any

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
TURN_TOKEN = "<|im_start|>"
# Fixed ids 0..3: the trainer places special tokens first, in this order.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, TURN_TOKEN)


def _jinja(text: str) -> str:
    """`text` as a Jinja string literal (Jinja reads JSON's escapes)."""
    return json.dumps(text)


# Qwen2.5's wording, so the tiny models see the prompt a real hermes-format model would.
_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

# ChatML-like: each turn is "<|im_start|>{role}\n{content}<|eos|>\n", so one stop token
# (eos) ends both a plain completion and an assistant turn. With `tools`, Qwen2.5's layout
# (the hermes format router/tools.py parses): the tool signatures in the system turn,
# assistant calls as <tool_call> blocks, tool results as <tool_response> blocks in a user
# turn. Messages without tools render exactly as before tools existed (prompts unchanged).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ " + _jinja(_TOOLS_HEAD) + " }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ " + _jinja(_TOOLS_TAIL) + " + eos_token + '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\\n' + message['content'] }}{% endif %}"
    "{% for tool_call in message.tool_calls %}"
    "{% set call = tool_call.function if tool_call.function is defined else tool_call %}"
    '{{ \'\\n<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{% if call.arguments is string %}{{ call.arguments }}"
    "{% else %}{{ call.arguments | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token + '\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ eos_token + '\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2's split (Llama 3's, with single digits): words, numbers, punctuation runs, newlines.
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE once per vocab size per process; training is deterministic."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    from tools.tokenizer_corpus import ENGLISH_TEXT, synthetic_words

    tok = Tokenizer(models.BPE())
    # Exactly the pipeline transformers 5's Qwen2Tokenizer rebuilds around tokenizer.json
    # (it ignores the file's normalizer/pre-tokenizer for model_type qwen2), so every arch
    # tokenizes the same whichever class AutoTokenizer picks.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # English weighted up so its merges come first; pseudo-words fill the rest of the vocab.
    words = synthetic_words(max(2000, vocab_size * 4))
    lines = [ENGLISH_TEXT] * 32 + [" ".join(words[i : i + 16]) for i in range(0, len(words), 16)]
    tok.train_from_iterator(lines, trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        # Reserved tokens so every id the model can emit decodes to something.
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok.to_str()


def build_tokenizer(vocab_size: int, model_max_length: int) -> Any:
    """A `PreTrainedTokenizerFast` with exactly `vocab_size` tokens and a chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(tokenizer: Any, out: pathlib.Path) -> None:
    tokenizer.save_pretrained(out)
    # Newer transformers writes the template to chat_template.jinja; older ones only read
    # tokenizer_config.json. Keep it in both and name the class both major versions know.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["bos_token"], cfg["eos_token"], cfg["pad_token"] = BOS_TOKEN, EOS_TOKEN, PAD_TOKEN
    # Qwen2Tokenizer (transformers 5) would add an "<|endoftext|>" unk token past the vocab.
    cfg["unk_token"] = None
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
