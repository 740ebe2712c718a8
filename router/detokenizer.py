"""Incremental detokenization with stop strings.

Lifecycle per request: `add(ids)` for each in-order batch of tokens returns the text that is now
safe to send; `finish()` returns the rest. Safe means: (1) not the tail of an incomplete UTF-8
sequence (the decoder renders it as U+FFFD until the next token completes it) and (2) not a
suffix that could be the start of a stop string. When a stop string appears, the text is cut
before it and `stopped` becomes True; the caller then aborts the request on the workers.

Each step decodes only a short window (vLLM's prefix/read offsets: the new text is
`decode(ids[prefix:]) - decode(ids[prefix:read])`, so a tokenizer that strips or merges
leading spaces sees the same context either way), which keeps a step O(1) in the output length.
`finish()` decodes all ids once and hands out the rest of `tokenizer.decode(all_ids,
skip_special_tokens=True)`, so the pieces add up to exactly the one-shot decode whenever the
windowed text was a prefix of it (always, for byte-level BPE; a tokenizer that rewrites earlier
text, e.g. space clean-up, is logged once).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"


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

    def add(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        ids = self.token_ids
        before = self._decode(ids[self._prefix : self._read])
        after = self._decode(ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self._text += after[len(before) :]
            self._prefix, self._read = self._read, len(ids)
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
