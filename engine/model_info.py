"""What a local Hugging Face model directory (or GGUF file) says about serving it, read in one
place for the router and the engine: the tokenizer (and its chat template), the context window, the
vocabulary size, the EOS ids and the sampling defaults of generation_config.json.

Lifecycle: the router calls `read_model_info(path, max_model_len)` once at start-up (in a
thread; router/server.py's `load_model_info`); the engine reads the same pieces while it builds
(`engine.config.ModelConfig.from_pretrained`: `load_hf_config`, `eos_token_ids`,
`context_window`; `engine.llm.LLM` and the structured-output compiler: `load_tokenizer`).
So `max_model_len` is computed by one function (`context_window`) on both sides of a socket.

Importing this module does not import torch (tests/engine/test_model_info.py checks it in a
fresh interpreter): the router imports it. transformers is imported inside the readers, since
its Auto classes load torch when it is installed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.gguf_file import hf_source, is_gguf

# generation_config.json fields that become sampling defaults (vLLM applies the same ones).
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(slots=True)
class ModelInfo:
    """What the router needs of the served model (`read_model_info`)."""

    tokenizer: Any
    max_model_len: int
    vocab_size: int
    # Sampling defaults from generation_config.json (vLLM applies them the same way).
    generation_defaults: dict = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's chat template (None: the model answers no chat requests)."""
        return getattr(self.tokenizer, "chat_template", None)


def has_tokenizer(model: str | Path) -> bool:
    if is_gguf(model):  # the vocabulary is in the file's metadata (checked with it)
        return Path(model).is_file()
    return any(Path(model, f).is_file() for f in _TOKENIZER_FILES)


def load_tokenizer(model: str | Path, *, required: bool = False) -> Any:
    """The model directory's tokenizer (`AutoTokenizer`, chat template included). Without
    tokenizer files: None, or with `required` whatever error transformers raises."""
    if not required and not has_tokenizer(model):
        return None
    from transformers import AutoTokenizer

    path, kwargs = hf_source(model)
    return AutoTokenizer.from_pretrained(path, **kwargs)


def load_hf_config(model: str | Path) -> Any:
    """config.json (or a GGUF file's metadata) through transformers' AutoConfig (4.x and 5.x
    keys both understood)."""
    from transformers import AutoConfig

    path, kwargs = hf_source(model)
    return AutoConfig.from_pretrained(path, **kwargs)


def context_window(hf_config: Any, cap: int | None, model: str | Path = "") -> int:
    """The context window served: `max_position_embeddings`, lowered to `cap` when one is set
    (a falsy cap is no cap). A config without it needs a cap, which is then the window."""
    window = getattr(hf_config, "max_position_embeddings", None) or cap
    if window is None:
        raise ValueError(f"{model}: config has no max_position_embeddings; set max_model_len")
    if cap:
        window = min(window, cap)
    return int(window)


def _id_list(value: Any) -> list[int]:
    return value if isinstance(value, list) else [] if value is None else [value]


def config_eos_token_ids(hf_config: Any) -> tuple[int, ...]:
    """EOS ids as config.json states them (what the router's grammar compiler uses)."""
    return tuple(_id_list(getattr(hf_config, "eos_token_id", None)))


def eos_token_ids(model: str | Path, hf_config: Any) -> tuple[int, ...]:
    """EOS ids the engine stops on: generation_config.json's (it may list several), then
    config.json's, without repeats."""
    ids: list[int] = []
    gen = Path(model, "generation_config.json")
    if not is_gguf(model) and gen.is_file():
        ids += _id_list(json.loads(gen.read_text()).get("eos_token_id"))
    ids += _id_list(getattr(hf_config, "eos_token_id", None))
    return tuple(dict.fromkeys(int(i) for i in ids))


def generation_defaults(model: str | Path) -> dict:
    """The sampling fields a model's generation_config.json sets (absent file: none)."""
    path = Path(model, "generation_config.json")
    if is_gguf(model) or not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {k: config[k] for k in GENERATION_DEFAULT_FIELDS if config.get(k) is not None}


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template rule: the file `value` names, else `value` itself when it reads
    as a Jinja template; anything else is a mistyped path, refused rather than served as text."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template longer than a file name may be is no path
        pass
    if any(mark in value for mark in ("{{", "{%", "\n")):
        return value
    raise ValueError(f"chat template {value!r}: no such file, and not a Jinja template")


def _with_chat_template(tok: Any, template: str) -> Any:
    """`tok` answering chats with `template`, which must at least parse (a template that raises
    for some conversations, as many do on purpose, is the template's own rule)."""
    from jinja2 import TemplateSyntaxError

    tok.chat_template = template
    try:
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    except TemplateSyntaxError as e:
        raise ValueError(f"chat template: line {e.lineno}: {e.message}") from e
    except Exception:  # noqa: BLE001 - rendering rules of the template itself
        pass
    return tok


def read_model_info(
    model: str | Path,
    max_model_len: int | None = None,
    tokenizer: str | Path | None = None,
    chat_template: str | None = None,
) -> ModelInfo:
    """Tokenizer (the model's own, or `tokenizer`: another directory or GGUF file; with
    `chat_template`, a template's text, answering chats with it), context window (capped by
    `max_model_len`), vocabulary size, EOS ids and sampling defaults of the model directory.
    The tokenizer is required, and must not name ids the model lacks."""
    source = tokenizer or model
    if tokenizer is not None and not has_tokenizer(tokenizer):
        raise ValueError(f"tokenizer {str(tokenizer)!r}: no {' or '.join(_TOKENIZER_FILES)}")
    tok = load_tokenizer(source, required=True)
    if chat_template is not None:
        tok = _with_chat_template(tok, chat_template)
    hf_config = load_hf_config(model)
    window = context_window(hf_config, max_model_len, model)
    vocab = getattr(hf_config, "vocab_size", None) or len(tok)
    if len(tok) > vocab:
        # Its ids past the embedding would make every prompt that uses them a 400.
        raise ValueError(
            f"tokenizer {str(source)!r} has {len(tok)} tokens; model {str(model)!r} embeds {vocab}"
        )
    tokenizer = tok
    return ModelInfo(
        tokenizer,
        window,
        int(vocab),
        generation_defaults(model),
        config_eos_token_ids(hf_config),
    )
