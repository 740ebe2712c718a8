"""engine/structured: grammars compiled from specs hold random walks to valid outputs.

The walks pick uniformly among the tokens each mask allows (with a growing preference for
tokens that close strings, objects and arrays, so they end), on the tiny models' trained BPE
tokenizer: whatever token the mask lets through, the decoded text must parse and validate.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.structured import (
    GrammarCompiler,
    GrammarMatcher,
    StructuredError,
    apply_masks,
    apply_token_bitmask,
    unpack_bitmask,
    validate,
)
from tools.make_model import build_tokenizer

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_VOCAB = 1024
PADDED_VOCAB = TOKENIZER_VOCAB + 40  # the model's logits are wider than the tokenizer
EOS = 2
MAX_STEPS = 600  # generous: biased walks of these schemas end in well under 200 tokens


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TOKENIZER_VOCAB, 1024)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, PADDED_VOCAB, (EOS,))


@pytest.fixture(scope="module")
def closers(tokenizer):
    """Tokens made only of closing punctuation: preferring them ends strings and containers."""
    out = set()
    for t in range(TOKENIZER_VOCAB):
        text = tokenizer.decode([t])
        if text and set(text) <= set('"}]') and t != EOS:
            out.add(t)
    assert out
    return out


def walk(matcher: GrammarMatcher, rng: random.Random, closers=frozenset(), eos_p: float = 1.0):
    """Drive `matcher` to EOS with random allowed tokens; returns (tokens before EOS, ended)."""
    ids: list[int] = []
    for step in range(MAX_STEPS):
        allowed = matcher.allowed_token_ids()
        assert allowed, "a mask must allow at least one token"
        assert max(allowed) < TOKENIZER_VOCAB, "a token past the tokenizer was allowed"
        if EOS in allowed and (len(allowed) == 1 or rng.random() < eos_p):
            assert matcher.accept(EOS) and matcher.is_terminated()
            return ids, True
        choices = [t for t in allowed if t != EOS]
        closing = [t for t in choices if t in closers]
        if closing and rng.random() < min(0.95, 0.3 + step / 100):
            choices = closing
        token = rng.choice(choices)
        assert matcher.accept(token), f"an allowed token {token} was rejected"
        ids.append(token)
    return ids, False


# ------------------------------------------------------------------- random JSON schemas

NAMES = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
ENUM_VALUES = st.one_of(
    st.text(alphabet='abc XYZ"\\é-', max_size=5), st.integers(-20, 20), st.none()
)
LEAVES = st.one_of(
    st.integers(0, 10).map(lambda n: {"type": "string", "maxLength": n}),
    st.just({"type": "integer"}),
    st.tuples(st.integers(-50, 5), st.integers(0, 500)).map(
        lambda r: {"type": "integer", "minimum": r[0], "maximum": r[1]}
    ),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.lists(ENUM_VALUES, min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
)


@st.composite
def object_schemas(draw, children):
    props = draw(st.dictionaries(NAMES, children, max_size=4))
    schema = {
        "type": "object",
        "properties": props,
        "required": [k for k in props if draw(st.booleans())],
    }
    # Mostly closed objects; open ones let the walk add keys with arbitrary JSON values.
    if draw(st.integers(0, 3)):
        schema["additionalProperties"] = False
    return schema


@st.composite
def array_schemas(draw, children):
    max_items = draw(st.integers(0, 3))
    schema = {"type": "array", "items": draw(children), "maxItems": max_items}
    if draw(st.booleans()):
        schema["minItems"] = draw(st.integers(0, max_items))
    return schema


VALUES = st.recursive(
    LEAVES, lambda kids: st.one_of(object_schemas(kids), array_schemas(kids)), max_leaves=8
)
SCHEMAS = object_schemas(VALUES)


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(schema=SCHEMAS, seed=st.integers(0, 2**32 - 1))
def test_random_schema_walks_give_valid_json(compiler, tokenizer, closers, schema, seed):
    spec = json.dumps(schema)
    rng = random.Random(seed)
    for _ in range(2):
        ids, ended = walk(compiler.matcher("json_schema", spec), rng, closers)
        text = tokenizer.decode(ids)
        assert ended, f"walk did not end in {MAX_STEPS} tokens: {text[:200]!r}"
        jsonschema.validate(json.loads(text), schema)


# ------------------------------------------------------------------- other kinds


def test_json_object_walks_give_objects(compiler, tokenizer, closers):
    for seed in range(10):
        ids, ended = walk(compiler.matcher("json_object", ""), random.Random(seed), closers)
        assert ended
        assert isinstance(json.loads(tokenizer.decode(ids)), dict)


def test_json_layout_is_fixed(compiler, tokenizer):
    """One layout (json.dumps' separators): generation cannot wander into whitespace."""
    spec = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert compiler.matcher("json_schema", spec).accept_tokens(tokenizer.encode('{"a": 1}'))
    assert not compiler.matcher("json_schema", spec).accept_tokens(tokenizer.encode('{"a":1}'))
    assert not compiler.matcher("json_schema", spec).accept_tokens(tokenizer.encode("{ "))


@pytest.mark.parametrize(
    "pattern", [r"(ab|cd)+-[0-9]{1,3}", r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5})?", r"\d{3}-\d{4}"]
)
def test_regex_walks_match(compiler, tokenizer, pattern):
    for seed in range(10):
        ids, ended = walk(compiler.matcher("regex", pattern), random.Random(seed), eos_p=0.4)
        assert ended
        assert re.fullmatch(pattern, tokenizer.decode(ids))


def test_choice_walks_give_an_option(compiler, tokenizer):
    options = ["yes", "no", "maybe so", "a", "ab", 'q"uote\\', "é\n"]
    seen = set()
    for seed in range(60):
        matcher = compiler.matcher("choice", json.dumps(options))
        ids, ended = walk(matcher, random.Random(seed), eos_p=0.5)
        assert ended
        seen.add(tokenizer.decode(ids))
    assert seen <= set(options)
    assert len(seen) >= 4  # the walk reaches many options, not one forced string


def test_lark_grammar_walks_match(compiler, tokenizer):
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'
    for seed in range(10):
        ids, ended = walk(compiler.matcher("grammar", grammar), random.Random(seed), eos_p=0.5)
        assert ended
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", tokenizer.decode(ids))


def test_gbnf_grammar_is_accepted(compiler, tokenizer):
    matcher = compiler.matcher("grammar", 'root ::= "on" | "off"')
    assert matcher.accept_tokens(tokenizer.encode("off")) and matcher.is_accepting()


# ------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("json_schema", "{not json", "json_schema is not valid JSON"),
        ("json_schema", "[1, 2]", "must be a JSON object"),
        ("json_schema", '{"type": "strin"}', "strin"),
        ("json_schema", '{"type": "string", "pattern": "[a-"}', "regex"),
        ("json_schema", '{"type": "array", "uniqueItems": true}', "uniqueItems"),
        ("json_schema", '{"type": "string", "minLength": "x"}', "minLength"),
        ("regex", "a(b", "unclosed group"),
        ("regex", "", "regex must not be empty"),
        ("choice", "yes", "JSON list of strings"),
        ("choice", "[]", "non-empty"),
        ("choice", '["a", 2]', "choice[1] must be a string"),
        ("grammar", "start: missing_rule", "missing_rule"),
        ("grammar", "   ", "grammar must not be empty"),
        ("yaml", "a: 1", "unknown structured output kind"),
    ],
)
def test_bad_specs_raise_a_clear_error(compiler, kind, spec, message):
    with pytest.raises(StructuredError, match=re.escape(message)):
        compiler.compile(kind, spec)
    with pytest.raises(StructuredError, match=re.escape(message)):
        validate(kind, spec)  # the router's check: no tokenizer, same verdict


def test_structured_error_is_a_value_error():
    assert issubclass(StructuredError, ValueError)


# ------------------------------------------------------------------- masks


@pytest.mark.parametrize("padding", [1, 7, 40, 64])
def test_padding_tokens_are_always_masked(tokenizer, closers, padding):
    compiler = GrammarCompiler(tokenizer, TOKENIZER_VOCAB + padding, (EOS,))
    for kind, spec in [("json_object", ""), ("regex", "[a-z ]{0,12}"), ("choice", '["x"]')]:
        matcher = compiler.matcher(kind, spec)
        rng = random.Random(0)
        while True:
            logits = torch.zeros(TOKENIZER_VOCAB + padding)
            matcher.apply_mask(logits)
            assert torch.isneginf(logits[TOKENIZER_VOCAB:]).all()
            assert torch.isfinite(logits[:TOKENIZER_VOCAB]).any()
            if matcher.is_terminated():
                break
            allowed = torch.isfinite(logits).nonzero().flatten().tolist()
            assert allowed == matcher.allowed_token_ids()
            token = EOS if EOS in allowed else rng.choice(allowed)
            assert matcher.accept(token)


def test_complete_match_allows_only_eos(compiler, tokenizer):
    matcher = compiler.matcher("choice", '["stop"]')
    assert matcher.accept_tokens(tokenizer.encode("stop"))
    assert matcher.is_accepting() and not matcher.is_terminated()
    assert matcher.allowed_token_ids() == [EOS]
    assert matcher.accept(EOS) and matcher.is_terminated()
    assert not matcher.accept(EOS)  # nothing after termination


def test_rejected_token_returns_false(compiler, tokenizer):
    matcher = compiler.matcher("regex", "[0-9]+")
    assert not matcher.accept(tokenizer.encode("x")[0])
    assert matcher.is_error() and matcher.error
    assert matcher.allowed_token_ids() == [EOS]  # a broken sequence can still stop


def test_batched_masks_match_single_rows(compiler, tokenizer):
    specs = [("json_object", ""), ("regex", "[0-9]{2}"), ("choice", '["ab", "cd"]')]
    matchers = [compiler.matcher(*s) for s in specs]
    matchers[0].accept_tokens(tokenizer.encode('{"k": '))
    rows: list = [matchers[0], None, matchers[1], matchers[2], None]
    logits = torch.randn(len(rows), PADDED_VOCAB)
    expected = logits.clone()
    for i, m in enumerate(rows):
        if m is not None:
            m.apply_mask(expected[i])
    apply_masks(logits, rows)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [96, 100, 130])  # equal to, inside, past the 96 mask bits
def test_bitmask_application_matches_a_bool_mask(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, vocab, generator=gen).to(dtype)
    bits = [[(int(w) >> b) & 1 for w in row for b in range(32)] for row in bitmask]
    allowed = torch.tensor([(r + [0] * vocab)[:vocab] for r in bits], dtype=torch.bool)
    assert torch.equal(unpack_bitmask(bitmask, vocab), allowed)
    expected = logits.masked_fill(~allowed, float("-inf"))
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)


def test_bad_bitmask_rows_raise(compiler):
    matcher = compiler.matcher("regex", "a+")
    words = compiler.mask_words
    for row in (
        torch.zeros(words - 1, dtype=torch.int32),  # too short: llguidance checks the size
        torch.zeros(2 * words, dtype=torch.int32)[::2],  # not contiguous
        torch.zeros(words, dtype=torch.float32),
    ):
        with pytest.raises(ValueError):
            matcher.fill_bitmask(row)


# ------------------------------------------------------------------- replay and state


def _state(matcher: GrammarMatcher):
    return (
        matcher.allowed_token_ids(),
        matcher.is_accepting(),
        matcher.is_terminated(),
        matcher.num_tokens,
    )


def test_replay_gives_the_same_state(compiler, tokenizer, closers):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "tags"],
    }
    spec = json.dumps(schema)
    original = compiler.matcher("json_schema", spec)
    ids, ended = walk(original.copy(), random.Random(3), closers)
    assert ended
    ids.append(EOS)
    for k in range(len(ids) + 1):
        replayed = compiler.matcher("json_schema", spec, ids[:k])
        assert _state(replayed) == _state(original)
        if k < len(ids):
            assert original.accept(ids[k])


def test_replay_of_a_disallowed_token_raises(compiler, tokenizer):
    with pytest.raises(StructuredError, match="position 0"):
        compiler.matcher("regex", "[0-9]+", tokenizer.encode("x"))


def test_copy_and_rollback(compiler, tokenizer):
    matcher = compiler.matcher("json_object", "")
    prefix = tokenizer.encode('{"a": [1, ')
    assert matcher.accept_tokens(prefix)
    before = _state(matcher)
    twin = matcher.copy()
    assert twin.accept_tokens(tokenizer.encode("2]}"))
    assert _state(matcher) == before  # the copy is independent
    matcher.accept_tokens(tokenizer.encode("3"))
    matcher.rollback(1)
    assert _state(matcher) == before
    with pytest.raises(ValueError):
        matcher.rollback(len(prefix) + 1)


def test_compiled_grammars_are_cached(tokenizer):
    compiler = GrammarCompiler(tokenizer, TOKENIZER_VOCAB, (EOS,), cache_size=2)
    first = compiler.compile("regex", "a+")
    assert compiler.compile("regex", "a+") is first
    compiler.compile("regex", "b+")
    compiler.compile("regex", "c+")  # evicts a+, the least recently used
    assert compiler.compile("regex", "a+") is not first
    assert compiler.cache_info() == {"hits": 1, "misses": 4, "size": 2}


def test_structured_imports_without_torch():
    probe = "import sys, engine.structured; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
