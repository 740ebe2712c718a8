"""Structured outputs inside the engine: the grammar mask holds a random-weight model to a JSON
schema, a regex and a choice, colocated and across the hand-off (the decode engine replays the
prefill engine's first token into its grammar state), for every choice of n."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.llm_engine import EngineConfig, LLMEngine
from engine.roles import DECODE, PREFILL
from tests.kv_copy import CopyConnector

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(make_tiny_model):
    return LLM(make_tiny_model("llama"), dtype="float32", block_size=4)


def _gen(llm, structured, **kw):
    sp = SamplingParams(max_tokens=120, structured=structured, **kw)
    return llm.generate(["Hello there"], sp)[0]


def test_json_schema_output_validates_for_every_choice(llm):
    out = _gen(llm, ("json_schema", json.dumps(SCHEMA)), temperature=1.0, n=3, seed=4)
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_regex_choice_and_json_object(llm):
    out = _gen(llm, ("regex", r"[a-c]{2,5}-[0-9]{3}"), temperature=0)
    assert re.fullmatch(r"[a-c]{2,5}-[0-9]{3}", out.text), out.text
    out = _gen(llm, ("choice", json.dumps(["yes", "no", "maybe"])), temperature=0)
    assert out.text in ("yes", "no", "maybe")
    out = _gen(llm, ("json_object", ""), temperature=1.0, seed=3)
    assert isinstance(json.loads(out.text), dict)


def test_a_bad_spec_is_refused_when_added(llm):
    with pytest.raises(ValueError, match="(?i)json|schema"):
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(structured=("json_schema", "{")))
    assert "bad" not in llm.engine.seqs


def test_grammar_state_crosses_the_hand_off(make_tiny_model):
    model = str(make_tiny_model("qwen3"))

    def engine(role):
        return LLMEngine(EngineConfig(model=model, dtype="float32", block_size=4, role=role))

    spec = ("json_schema", json.dumps(SCHEMA))
    sp = SamplingParams(max_tokens=120, temperature=1.0, seed=9, n=2, structured=spec)
    prompt = [5, 6, 7, 8, 9, 10]
    colocated = LLM(model, dtype="float32", block_size=4).generate([prompt], sp)[0]
    pe, de = engine(PREFILL), engine(DECODE)
    connector = CopyConnector(pe, de)
    tokens: dict[int, list[int]] = {0: [], 1: []}
    pe.add_request("r", prompt, sp)
    for out in pe.step():
        tokens[out.choice] += out.token_ids
    h = connector.handoffs["r"]
    de.add_remote_request("r", prompt, h.first_token, sp, h.choices)
    while de.has_unfinished() or de.scheduler.fetching:
        for out in de.step():
            tokens[out.choice] += out.token_ids
    assert [tokens[0], tokens[1]] == [c.token_ids for c in colocated.choices]
    for choice in colocated.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)
