"""`GrammarCompiler`: one per engine (and per router), built from the model's tokenizer.

Compiling a grammar against a vocabulary (llguidance builds its lexer and the token trie walk
tables) takes from a fraction of a millisecond for a small schema to hundreds for a large one,
and a service sees the same few schemas over and over (one per tool set or response format),
so compiled grammars are kept in a bounded LRU keyed by (kind, spec). Each request then takes
a `GrammarMatcher`, a deep copy of the compiled template (microseconds), and advances its own.

No torch here: the router imports this module to validate specs.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from llguidance import LLMatcher, LLTokenizer

# CompiledGrammar lives beside GrammarMatcher (each names the other); re-exported here.
from engine.structured.matcher import CompiledGrammar, GrammarMatcher
from engine.structured.specs import StructuredError, check_grammar, grammar_text

DEFAULT_CACHE_SIZE = 256


def tokenizer_size(tokenizer: Any) -> int:
    """Tokens the HF tokenizer knows, added tokens included."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(
            "structured outputs need a fast (Rust-backed) Hugging Face tokenizer, "
            f"got {type(tokenizer).__name__}"
        )
    return max(len(tokenizer), backend.get_vocab_size(with_added_tokens=True))


def ll_tokenizer(tokenizer: Any, n_vocab: int, eos_token_ids: tuple[int, ...]) -> LLTokenizer:
    """llguidance's view of an HF fast tokenizer, as `llguidance.hf.from_tokenizer` builds it,
    taking the Rust backend directly: transformers 5's tokenizer classes are not all
    `PreTrainedTokenizerFast` subclasses, which that helper insists on."""
    backend = copy.copy(tokenizer.backend_tokenizer)
    # Padding and truncation settings would change how llguidance re-tokenizes text.
    backend.no_padding()
    backend.no_truncation()
    return LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=list(eos_token_ids))


class GrammarCompiler:
    """Compiles (kind, spec) pairs for one tokenizer and model, with an LRU cache.

    `vocab_size` is the model's logits width, which may exceed the tokenizer (embedding tables
    padded to a multiple of 64 or 128): llguidance gets that many tokens, and the ones past the
    tokenizer have no bytes, so no grammar ever allows them. `eos_token_ids` are the tokens
    that end a sequence; a complete match allows only those.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        eos = tuple(int(t) for t in eos_token_ids)
        if not eos and getattr(tokenizer, "eos_token_id", None) is not None:
            eos = (int(tokenizer.eos_token_id),)
        if not eos:
            raise ValueError("structured outputs need at least one EOS token id")
        if vocab_size < 1 or cache_size < 1:
            raise ValueError("vocab_size and cache_size must be positive")
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = eos
        self.tokenizer_size = tokenizer_size(tokenizer)
        # Never fewer tokens than the tokenizer has: llguidance indexes masks by token id.
        n_vocab = max(self.vocab_size, self.tokenizer_size)
        self.ll_tokenizer = ll_tokenizer(tokenizer, n_vocab, eos)
        self.mask_words = (n_vocab + 31) // 32
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def compile(self, kind: str, spec: str) -> CompiledGrammar:
        """The compiled grammar for (kind, spec), from the cache when it is there; raises
        StructuredError for a bad spec."""
        key = (kind, spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
            self.misses += 1
        # Compiled outside the lock (llguidance releases the GIL while it builds), so a slow
        # schema never stalls requests whose grammars are cached; a race compiles twice.
        compiled = self._build(kind, spec)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, kind: str, spec: str) -> CompiledGrammar:
        grammar = grammar_text(kind, spec)
        # log_level=0: a rejected token is reported through accept()'s result, not stderr.
        template = LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if template.is_error():
            check_grammar(kind, grammar, self.ll_tokenizer)  # raises with the short message
            raise StructuredError(f"invalid {kind}: {template.get_error().splitlines()[0]}")
        return CompiledGrammar(
            kind=kind,
            spec=spec,
            template=template,
            vocab_size=self.vocab_size,
            mask_words=self.mask_words,
            eos_token_ids=frozenset(self.eos_token_ids),
        )

    def validate(self, kind: str, spec: str) -> None:
        """Raise StructuredError if (kind, spec) does not compile; caches it when it does."""
        self.compile(kind, spec)

    def matcher(self, kind: str, spec: str, tokens: Iterable[int] = ()) -> GrammarMatcher:
        """A matcher for (kind, spec) that has already accepted `tokens`."""
        return self.compile(kind, spec).matcher(tokens)

    def clear_cache(self) -> None:
        """Forget every compiled grammar (matchers already made keep working)."""
        with self._lock:
            self._cache.clear()

    def cache_info(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "size": len(self._cache)}
