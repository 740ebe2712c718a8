"""router.detokenizer on `tokenizers.decoders.DecodeStream`, against the windowed Python decode it
replaced (kept below, verbatim, as `LegacyDetokenizer`) and against the one-shot decode.

Property tests over random token sequences of every test model's tokenizer (`tandem
make-model`, each arch as AutoTokenizer loads it), a Llama-2-style one (metaspace, byte
fallback, leading-space strip) and a tokenizer with no Rust decode (the Python path): every
piece `add` returns, the `finish` piece, `stopped` and `stop_string` must be the old ones byte
for byte, stop strings (with and without `include_stop`) and `skip_special_tokens` included.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.model_info import load_tokenizer
from router.detokenizer import IncrementalDetokenizer, stream_backend
from tools.make_model import ARCHS

log = logging.getLogger(__name__)
_REPLACEMENT = "\ufffd"


class LegacyDetokenizer:
    """The windowed detokenizer as it was before DecodeStream (the reference)."""

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


# ---------------------------------------------------------------------------- tokenizers


def _sentencepiece_style():
    """A Llama-2/Mistral-style tokenizer: metaspace, byte fallback, leading-space strip."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


class PythonOnlyTokenizer:
    """A tokenizer known only by its `decode` (no Rust backend): the Python window path."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return len(self.inner)


TOKENIZERS = (*ARCHS, "sentencepiece_style", "python_only")


@pytest.fixture(scope="module")
def tokenizers(make_tiny_model) -> dict[str, Any]:
    toks: dict[str, Any] = {arch: load_tokenizer(make_tiny_model(arch)) for arch in ARCHS}
    toks["sentencepiece_style"] = _sentencepiece_style()
    toks["python_only"] = PythonOnlyTokenizer(toks["llama"])
    return toks


def test_decode_stream_is_used_where_the_rust_decode_is_the_decode(tokenizers):
    for name in (*ARCHS, "sentencepiece_style"):
        assert stream_backend(tokenizers[name]) is tokenizers[name].backend_tokenizer, name
    assert stream_backend(tokenizers["python_only"]) is None
    # A tokenizer whose decode cleans up spaces after the Rust decode (a WordPiece one: BPE
    # models skip the clean-up in transformers 5) is not the Rust decode.
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, ".": 2}, unk_token="[UNK]"))
    cleaning = PreTrainedTokenizerFast(
        tokenizer_object=wordpiece, clean_up_tokenization_spaces=True
    )
    plain = PreTrainedTokenizerFast(tokenizer_object=wordpiece, clean_up_tokenization_spaces=False)
    assert stream_backend(cleaning) is None
    assert stream_backend(plain) is plain.backend_tokenizer


# ---------------------------------------------------------------------------- properties


def _run(detok, ids: list[int], chunks: list[int]) -> tuple[list[str], bool, str | None]:
    """Feed `ids` in chunks of the given sizes (cycled), then finish."""
    pieces, i, k = [], 0, 0
    while i < len(ids):
        n = chunks[k % len(chunks)]
        pieces.append(detok.add(ids[i : i + n]))
        i, k = i + n, k + 1
        if detok.stopped:
            break
    pieces.append(detok.finish())
    return pieces, detok.stopped, detok.stop_string


def _vocab(tok) -> int:
    return len(tok)


@st.composite
def _case(draw, vocab: int):
    # Half the cases also draw ids past the vocabulary (the decode skips them).
    high = vocab + 8 if draw(st.booleans()) else vocab - 1
    ids = draw(st.lists(st.integers(0, high), max_size=48))
    chunks = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    skip = draw(st.booleans())
    return ids, chunks, skip


_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_pieces_equal_the_old_detokenizer_and_add_up_to_the_one_shot_decode(tokenizers, name):
    tok = tokenizers[name]

    @_SETTINGS
    @given(case=_case(_vocab(tok)))
    def check(case):
        ids, chunks, skip = case
        new = _run(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, chunks)
        old = _run(LegacyDetokenizer(tok, skip_special_tokens=skip), ids, chunks)
        assert new == old
        # The Llama-2-style tokenizer marks its byte-fallback tokens special: kept
        # (skip_special_tokens=False), a window can cut a byte sequence the one-shot decode
        # joins, and neither detokenizer adds up to it then (they agree, as asserted above).
        if name != "sentencepiece_style" or skip:
            assert "".join(new[0]) == tok.decode(ids, skip_special_tokens=skip)

    check()


@pytest.mark.parametrize("name", TOKENIZERS)
def test_stop_strings_equal_the_old_detokenizer(tokenizers, name):
    tok = tokenizers[name]

    @_SETTINGS
    @given(case=_case(_vocab(tok)), data=st.data())
    def check(case, data):
        ids, chunks, skip = case
        text = tok.decode(ids, skip_special_tokens=skip)
        # Stop strings cut from the text itself (so they match, often across tokens), plus
        # one that may never match.
        stops = []
        for _ in range(data.draw(st.integers(1, 3))):
            if text and data.draw(st.booleans()):
                a = data.draw(st.integers(0, len(text) - 1))
                stops.append(text[a : a + data.draw(st.integers(1, 6))])
            else:
                stops.append(data.draw(st.text(min_size=1, max_size=4)))
        include = data.draw(st.booleans())
        args = (tuple(stops), include, skip)
        new = _run(IncrementalDetokenizer(tok, *args), ids, chunks)
        old = _run(LegacyDetokenizer(tok, *args), ids, chunks)
        assert new == old

    check()


def test_incomplete_utf8_at_the_end_is_released_as_the_one_shot_decode_renders_it(tokenizers):
    tok = tokenizers["llama"]
    ids = tok("a 🙂")["input_ids"]
    for cut in range(1, len(ids)):
        new = _run(IncrementalDetokenizer(tok), ids[:cut], [1])
        old = _run(LegacyDetokenizer(tok), ids[:cut], [1])
        assert new == old
        assert "".join(new[0]) == tok.decode(ids[:cut], skip_special_tokens=True)
    # Some cut ends inside the emoji: its partial bytes come out (as U+FFFD) only at finish.
    partial = [_run(IncrementalDetokenizer(tok), ids[:cut], [1])[0] for cut in range(1, len(ids))]
    assert any(_REPLACEMENT in p[-1] and _REPLACEMENT not in "".join(p[:-1]) for p in partial)


def test_a_step_the_stream_refuses_falls_back_to_the_python_window(tokenizers):
    """DecodeStream raises when the window's decode no longer starts with what it handed out;
    the detokenizer then decodes the window in Python for the rest of the request."""
    tok = tokenizers["llama"]
    ids = tok("one two three four five six")["input_ids"]

    class Refusing:
        def step(self, backend, token_ids):
            raise Exception("InvalidPrefix")

    for at in range(len(ids)):
        d = IncrementalDetokenizer(tok, ("four",))
        pieces = []
        for i in range(len(ids)):
            if i == at:
                d._stream = Refusing()
            pieces.append(d.add(ids[i : i + 1]))
            if d.stopped:
                break
        pieces.append(d.finish())
        old = _run(LegacyDetokenizer(tok, ("four",)), ids, [1])
        assert (pieces, d.stopped, d.stop_string) == old
        if at == 0:
            assert d._stream is None  # the Python window took over for good
