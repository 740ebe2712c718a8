"""Token reordering (router.generation) and incremental detokenization (router.detokenizer)."""

from __future__ import annotations

import random

import pytest

from engine.protocol import TokenMessage
from router.detokenizer import IncrementalDetokenizer
from router.generation import TokenReorderBuffer


def tm(index, ids, finish=None, **kw):
    return TokenMessage("r", index, list(ids), finish_reason=finish, **kw)


def flat(deliveries):
    return [t for d in deliveries for t in d.token_ids]


def test_in_order_delivery():
    buf = TokenReorderBuffer()
    assert flat(buf.push(tm(0, [10]), 0.0)) == [10]
    out = buf.push(tm(1, [11, 12], "length"), 0.0)
    assert flat(out) == [11, 12] and out[-1].finish_reason == "length"
    assert buf.finished and buf.next_index == 3


def test_reorder_duplicates_and_overlap():
    buf = TokenReorderBuffer()
    assert buf.push(tm(2, [12]), 1.0) == []
    assert buf.gap_deadline(5.0) == 6.0
    assert buf.push(tm(2, [12]), 1.5) == []  # duplicate of a buffered message
    out = buf.push(tm(0, [10, 11]), 2.0)
    assert flat(out) == [10, 11, 12]
    assert buf.gap_deadline(5.0) is None
    assert buf.push(tm(1, [11]), 2.0) == []  # already delivered
    assert flat(buf.push(tm(2, [12, 13, 14]), 2.0)) == [13, 14]  # overlap trimmed
    assert buf.num_duplicates == 2
    out = buf.push(tm(5, [], "stop"), 2.0)  # empty finish at the next index
    assert out[0].finish_reason == "stop" and buf.finished


def test_shuffled_stream_reassembles():
    rng = random.Random(0)
    msgs = [tm(i, [100 + i]) for i in range(30)] + [tm(30, [130], "length")]
    msgs += rng.sample(msgs, 10)  # duplicates
    rng.shuffle(msgs)
    buf = TokenReorderBuffer()
    got, finish = [], None
    for m in msgs:
        for d in buf.push(m, 0.0):
            got += d.token_ids
            finish = d.finish_reason or finish
    assert got == [100 + i for i in range(31)] and finish == "length"


def test_gap_clock_restarts_after_progress():
    buf = TokenReorderBuffer()
    buf.push(tm(3, [1]), 1.0)
    buf.push(tm(0, [1]), 4.0)  # progress, but index 1..2 still missing
    assert buf.gap_deadline(2.0) == 6.0


def test_error_ends_at_once():
    buf = TokenReorderBuffer()
    buf.push(tm(1, [5]), 0.0)
    out = buf.push(tm(7, [], "error", error="oom"), 0.0)
    assert out[0].finish_reason == "error" and out[0].error == "oom" and buf.finished
    assert buf.push(tm(0, [4]), 0.0) == []


@pytest.fixture(scope="module")
def tok(model_info):
    return model_info.tokenizer


def stream_text(tok, ids, stop=(), chunk=1):
    d = IncrementalDetokenizer(tok, tuple(stop))
    pieces = []
    for i in range(0, len(ids), chunk):
        pieces.append(d.add(ids[i : i + chunk]))
        if d.stopped:
            break
    pieces.append(d.finish())
    return pieces, d


@pytest.mark.parametrize("chunk", [1, 3])
def test_detokenizer_matches_one_shot_decode(tok, chunk):
    text = "Hello wörld — naïve café 你好 🙂 plain ascii, and <|eos|> then more."
    ids = tok(text)["input_ids"] + [2, 1]  # special tokens are skipped
    pieces, d = stream_text(tok, ids, chunk=chunk)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in "".join(pieces[:-1])  # no half characters were sent
    assert d.text == "".join(pieces)


def test_detokenizer_byte_fallback_ids(tok):
    # Random ids (including lone byte tokens that form invalid UTF-8) still add up exactly.
    rng = random.Random(1)
    ids = [rng.randrange(4, 1024) for _ in range(200)]
    pieces, _ = stream_text(tok, ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


def test_stop_string_truncates_and_holds_back(tok):
    text = "one two three four five"
    ids = tok(text)["input_ids"]
    pieces, d = stream_text(tok, ids, stop=["three", "nope"])
    assert "".join(pieces) == "one two "
    assert d.stopped and d.stop_string == "three"
    # A prefix of the stop string is never sent while it might still complete.
    d = IncrementalDetokenizer(tok, ("two three",))
    sent = ""
    for t in tok("one two thr")["input_ids"]:
        sent += d.add([t])
    assert sent == "one "
    assert d.finish() == "two thr"  # the stream ended without the stop string: release it


def test_stop_string_spanning_tokens_and_earliest_wins(tok):
    ids = tok("alpha beta gamma delta")["input_ids"]
    pieces, d = stream_text(tok, ids, stop=["delta", "ta gam"])
    assert "".join(pieces) == "alpha be"
    assert d.stop_string == "ta gam"


@pytest.fixture(scope="module")
def sentencepiece_style_tok():
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


def test_detokenizer_exact_for_sentencepiece_style(sentencepiece_style_tok, caplog):
    t = sentencepiece_style_tok
    rng = random.Random(0)
    cases = [t(" Hello wörld — the  quick 你好 🙂 fox")["input_ids"]]
    cases += [[rng.randrange(0, 600) for _ in range(rng.randrange(1, 40))] for _ in range(100)]
    for ids in cases:
        pieces, _ = stream_text(t, ids)
        assert "".join(pieces) == t.decode(ids, skip_special_tokens=True)
    assert "diverged" not in caplog.text
