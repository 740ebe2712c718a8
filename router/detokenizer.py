"""Incremental detokenization with stop strings.

Lifecycle per request: `add(ids)` for each in-order batch of tokens returns the text that is now
safe to send; `finish()` returns the rest. Safe means: (1) not the tail of an incomplete UTF-8
sequence (the decoder renders it as U+FFFD until the next token completes it) and (2) not a
suffix that could be the start of a stop string. When a stop string appears, the text is cut
before it and `stopped` becomes True; the caller then aborts the request on the workers.

Each step decodes only a short window (vLLM's prefix/read offsets: the new text is
`decode(ids[prefix:]) - decode(ids[prefix:read])`, so a tokenizer that strips or merges
leading spaces sees the same context either way), which keeps a step O(1) in the output length.
The window is stepped by `tokenizers.decoders.DecodeStream` (what vLLM v1 uses: the same
offsets in Rust, one decode per step instead of two) whenever the tokenizer's `decode` is
exactly its Rust decode (a Hugging Face fast tokenizer without the clean-up of spaces);
otherwise, and for the rest of a request once the stream refuses a step (the window's decode
rewrote its own start), each step decodes the window in Python with `tokenizer.decode`. Both
give the same pieces. No prompt context is used: the first output token is decoded alone.
`finish()` decodes all ids once and hands out the rest of `tokenizer.decode(all_ids,
skip_special_tokens=True)`, so the pieces add up to exactly the one-shot decode whenever the
windowed text was a prefix of it (always, for byte-level BPE; a tokenizer that rewrites earlier
text, e.g. space clean-up, is logged once). That is also where a final incomplete UTF-8
sequence comes out (as U+FFFD, as the one-shot decode renders it).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

log = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
# Fast-tokenizer classes whose decode is the Rust decode plus the optional clean-up of spaces
# (transformers 5, then 4); looked up only if the tokenizer's module is already loaded, since
# importing transformers loads torch.
_PLAIN_DECODE_CLASSES = (
    ("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
    ("transformers.tokenization_utils_fast", "PreTrainedTokenizerFast"),
)


def _cleans_up_spaces(tokenizer: Any) -> bool:
    """Whether `tokenizer.decode` rewrites spaces after the Rust decode."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    # transformers 5 skips the clean-up for BPE models unless forced; 4 has no such flag.
    force = getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", None
    )
    if force is None or force:
        return True
    return type(tokenizer.backend_tokenizer.model).__name__ != "BPE"


def stream_backend(tokenizer: Any) -> Tokenizer | None:
    """The Rust tokenizer a `DecodeStream` can step for `tokenizer`, when `tokenizer.decode(ids,
    skip_special_tokens=s)` is exactly its `decode(ids, s)`; None otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return None
    cls = type(tokenizer)
    for module, name in _PLAIN_DECODE_CLASSES:
        base = getattr(sys.modules.get(module), name, None)
        if base is None or not isinstance(tokenizer, base):
            continue
        if cls.decode is base.decode and cls._decode is base._decode:
            return None if _cleans_up_spaces(tokenizer) else backend
    return None


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.token_ids: list[int] = []
        self.emitted = ""  # text already handed out
        self.stopped = False
        self.stop_string: str | None = None
        self._text = ""  # windowed decode of token_ids[:_read]
        self._prefix = 0
        self._read = 0
        self._backend = stream_backend(tokenizer)
        self._stream: DecodeStream | None = None
        if self._backend is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._scanned = 0  # self._text[:_scanned] holds no complete stop string

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _emit_until(self, text: str, end: int) -> str:
        if end <= len(self.emitted):
            return ""
        piece = text[len(self.emitted) : end]
        self.emitted += piece
        return piece

    def _find_stop(self, text: str, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = text.find(s, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        return best

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of `text` that starts some stop string."""
        held, end = 0, len(text)
        for s in self.stop:
            for k in range(min(len(s) - 1, end), held, -1):
                if text.startswith(s[:k], end - k):
                    held = k
                    break
        return held

    def _advance(self, text: str) -> str:
        """Apply stop strings to the candidate `text` and hand out what is safe."""
        if self.stop:
            hit = self._find_stop(text, max(0, self._scanned - self._max_stop + 1))
            if hit is not None:
                return self._stop_at(text, hit)
            self._scanned = len(text)
        return self._emit_until(text, len(text) - self._held_back(text))

    def _step(self, token_ids: list[int]) -> str | None:
        """The window's new text once `token_ids` are appended (None: nothing complete yet),
        moving the offsets past it."""
        if self._stream is not None:
            try:
                # One id alone steps faster than a list of one.
                step = token_ids[0] if len(token_ids) == 1 else list(token_ids)
                piece = self._stream.step(self._backend, step)
            except Exception:
                # The stream checks that the window's decode still starts with what it handed
                # out (the Python step does not): the Python step takes over for good.
                self._stream = None
            else:
                if piece is not None:
                    self._prefix, self._read = self._read, len(self.token_ids)
                return piece
        ids = self.token_ids
        before = self._decode(ids[self._prefix : self._read])
        after = self._decode(ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(ids)
            return after[len(before) :]
        return None

    def add(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        if not token_ids:
            return ""  # nothing new: the window's decode is what the last step saw
        self.token_ids.extend(token_ids)
        piece = self._step(token_ids)
        if piece:
            self._text += piece
        return self._advance(self._text)

    def finish(self) -> str:
        """Everything not yet handed out (no hold-back: no more tokens will come)."""
        if self.stopped:
            return ""
        full = self._decode(self.token_ids)
        if not full.startswith(self.emitted):
            log.warning("incremental detokenization diverged from the one-shot decode")
            full = self._text + self._decode(self.token_ids[self._read :])
        if self.stop:
            hit = self._find_stop(full, max(0, len(self.emitted) - self._max_stop + 1))
            if hit is not None:
                return self._stop_at(full, hit)
        return self._emit_until(full, len(full))

    def _stop_at(self, text: str, hit: tuple[int, str]) -> str:
        self.stopped = True
        self.stop_string = hit[1]
        return self._emit_until(text, hit[0] + (len(hit[1]) if self.include_stop else 0))

    @property
    def text(self) -> str:
        return self.emitted
