"""vLLM's `--reasoning-parser`: a reasoning model's `<think>...</think>` split from its chat answer
into `reasoning` (and `reasoning_content`), whole and streamed, through the real router (the
fake worker echoes the prompt, so the answer is the user's text); where thinking starts, read
from the prompt and the parser; a constrained answer left whole; thinking sent back in an
assistant message reaching the template; a tokenizer without the markers refused at start."""

from __future__ import annotations

import json
import shutil

import pytest
import requests
from router_fakes import FakeWorker

from router.config import RouterConfig
from router.reasoning import (
    CONTENT,
    THINKING,
    UNDECIDED,
    ReasoningSplit,
    initial_mode,
    split_whole,
    think_token_ids,
)
from router.server import load_model_info, request_parser

PLAIN = "{% for m in messages %}{{ m.content }}{% endfor %}"
TEXTS = [
    "<think>\nlet me see</think>\n\nThe answer is 4.",
    "hmm</think>42",
    "plain answer",
    "  <think>cut short",
    "<thi",
    "a</thin",
    "<think></think>",
    "",
]


def _fed(mode: str, text: str, step: int) -> tuple[str, str]:
    split, reasoning, content = ReasoningSplit(mode), "", ""
    for i in range(0, len(text), step):
        r, c = split.feed(text[i : i + step])
        reasoning, content = reasoning + r, content + c
        assert "<think>" not in r + c or mode == CONTENT and "<think>" in text[: i + step]
    r, c = split.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("mode", [THINKING, UNDECIDED, CONTENT])
def test_any_chunking_splits_as_the_whole_answer(mode):
    for text in TEXTS:
        whole = split_whole(mode, text)
        for step in (1, 2, 3, 5, 8):
            reasoning, content = _fed(mode, text, step)
            assert (reasoning or None, content or None) == whole, (text, step)
    assert split_whole(THINKING, TEXTS[0]) == ("\nlet me see", "The answer is 4.")  # no blank lines
    assert split_whole(UNDECIDED, "plain answer") == (None, "plain answer")
    assert split_whole(THINKING, "cut short") == ("cut short", None)  # as vLLM: all thinking


def test_where_thinking_starts():
    assert initial_mode("qwen3", "<|im_start|>assistant\n<think>\n", True) == THINKING
    assert initial_mode("qwen3", "assistant\n<think>\n\n</think>\n\n", True) == CONTENT
    assert initial_mode("qwen3", "<|im_start|>assistant\n", True) == UNDECIDED
    assert initial_mode("qwen3", "<|im_start|>assistant\n", False) == CONTENT
    assert initial_mode("deepseek_r1", "<｜Assistant｜>", True) == THINKING


@pytest.fixture(scope="module")
def thinking_model(model_dir, tmp_path_factory):
    """The tiny model with `<think>` and `</think>` tokens and a template that writes the user's
    text alone (so the echoing fake worker answers it back)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(model_dir, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["vocab_size"] = len(tok)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def _router(make_router, model: str, parser: str = "qwen3", template: str = PLAIN):
    config = RouterConfig(model_path=model, chat_template=template)
    info = load_model_info(config)
    return make_router(
        [FakeWorker("d0", "colocated")], info=info, model_path=model, reasoning_parser=parser
    ), info


def _ask(h, info, text: str, **extra):
    max_tokens = len(info.tokenizer(text, add_special_tokens=False)["input_ids"])
    messages = [{"role": "user", "content": text}]
    return h.openai().chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=max_tokens, **extra
    )


def test_a_whole_answer_splits(make_router, thinking_model):
    h, info = _router(make_router, thinking_model)
    message = _ask(h, info, "<think>plan it</think>Paris.").choices[0].message
    assert message.content == "Paris."
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == "plan it"
    plain = _ask(h, info, "Paris.").choices[0].message
    assert plain.content == "Paris." and "reasoning" not in plain.model_extra


def test_a_stream_splits_and_no_delta_holds_half_a_marker(make_router, thinking_model):
    h, info = _router(make_router, thinking_model)
    stream = _ask(h, info, "<think>plan it well</think>Paris is the one.", stream=True)
    reasoning, content = [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning"):
            assert extra["reasoning"] == extra["reasoning_content"] and delta.content is None
            reasoning.append(extra["reasoning"])
        content.append(delta.content or "")
    assert "".join(reasoning) == "plan it well" and "".join(content) == "Paris is the one."
    assert len(reasoning) > 1  # streamed piece by piece, not held to the end


def test_deepseek_r1_thinks_from_the_first_token(make_router, thinking_model):
    h, info = _router(make_router, thinking_model, "deepseek_r1")
    message = _ask(h, info, "plan it</think>Paris.").choices[0].message
    assert (message.model_extra["reasoning"], message.content) == ("plan it", "Paris.")
    cut = _ask(h, info, "still planning").choices[0].message
    assert (cut.model_extra["reasoning"], cut.content) == ("still planning", None)


def test_thinking_off_or_a_constrained_answer_stays_whole(make_router, thinking_model):
    h, info = _router(make_router, thinking_model)
    text = "<think>plan it</think>Paris."
    off = _ask(h, info, text, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == text
    constrained = _ask(h, info, text, response_format={"type": "json_object"})
    message = constrained.choices[0].message
    assert message.content == text and "reasoning" not in message.model_extra


def test_thinking_sent_back_reaches_the_template(make_router, thinking_model):
    template = "{% for m in messages %}[{{ m.reasoning_content }}|{{ m.reasoning }}]{% endfor %}"
    h, _ = _router(make_router, thinking_model, template=template)
    for name in ("reasoning", "reasoning_content"):
        messages = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", name: "t"},
        ]
        answer = requests.post(h.base_url + "/tokenize", json={"messages": messages}, timeout=20)
        assert answer.status_code == 200
        text = h.server.model_info.tokenizer.decode(answer.json()["tokens"])
        assert "[t|t]" in text, (name, text)


def test_a_tokenizer_without_the_markers_is_refused(model_dir, thinking_model):
    config = RouterConfig(model_path=model_dir, reasoning_parser="qwen3")
    with pytest.raises(ValueError, match="no </think> token"):
        request_parser(config, load_model_info(config))
    tok = load_model_info(RouterConfig(model_path=thinking_model)).tokenizer
    tok.add_special_tokens({"additional_special_tokens": ["</think>"]})
    with pytest.raises(ValueError, match="marks </think> special"):
        think_token_ids(tok, "qwen3")


TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}  # fmt: skip
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


def _accepts(compiled, tokenizer, text: str) -> bool:
    matcher = compiled.matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.accept_tokens(ids) and matcher.accept(next(iter(compiled.eos_token_ids)))


@pytest.mark.parametrize("mode", [THINKING, UNDECIDED])
def test_auto_tools_grammar_lets_the_model_think_first(thinking_model, mode):
    from engine.structured.compiler import GrammarCompiler
    from router.tools import auto_tools_grammar

    info = load_model_info(RouterConfig(model_path=thinking_model))
    tok = info.tokenizer
    ids = think_token_ids(tok, "qwen3")
    compiled = GrammarCompiler(tok, len(tok), info.eos_token_ids).compile(
        "grammar", auto_tools_grammar([TOOL], "hermes", thinking=mode, think_ids=ids)
    )
    opened = "<think>" if mode == UNDECIDED else ""
    for good in (f"{opened}plan it</think>\n\n{CALL}", f"{opened}plan</think>It is noon."):
        assert _accepts(compiled, tok, good), good
    bad = [f"{opened}plan</think>Sure. {CALL}", f"{opened}a</think>b</think>c"]
    if mode == THINKING:
        bad.append(CALL)  # the prompt opened the thinking: it must close first
    else:
        assert _accepts(compiled, tok, CALL) and _accepts(compiled, tok, "It is noon.")
    for text in bad:
        assert not _accepts(compiled, tok, text), text


def test_thinking_then_a_tool_call_whole_and_streamed(make_router, thinking_model):
    config = RouterConfig(model_path=thinking_model, chat_template=PLAIN)
    h = make_router(
        [FakeWorker("d0", "colocated")], info=load_model_info(config), model_path=thinking_model,
        reasoning_parser="qwen3", tool_call_parser="hermes",
    )  # fmt: skip
    info = h.server.model_info
    text = f"<think>plan it</think>\n\n{CALL}"
    answer = _ask(h, info, text, tools=[TOOL])
    message = answer.choices[0].message
    assert message.model_extra["reasoning"] == "plan it" and not message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_time", {"zone": "UTC"})
    ]
    reasoning, arguments = "", ""
    for chunk in _ask(h, info, text, tools=[TOOL], stream=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning") or ""
        assert not delta.content
        arguments += "".join(c.function.arguments or "" for c in delta.tool_calls or ())
    assert reasoning == "plan it" and json.loads(arguments) == {"zone": "UTC"}


def test_responses_answer_a_reasoning_item_first(make_router, thinking_model):
    """/v1/responses: the thinking is a `reasoning` output item before the message, whole and
    streamed (reasoning_text events), counted in output_tokens_details.reasoning_tokens."""
    h, info = _router(make_router, thinking_model)
    text = "<think>plan it</think>Paris."
    ids = info.tokenizer(text, add_special_tokens=False)["input_ids"]
    client = h.openai()
    whole = client.responses.create(model="tiny-llama", input=text, max_output_tokens=len(ids))
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "plan it" and whole.output_text == "Paris."
    assert whole.usage.output_tokens_details.reasoning_tokens == len(
        info.tokenizer("<think>plan it", add_special_tokens=False)["input_ids"]
    )
    events = list(
        client.responses.create(
            model="tiny-llama", input=text, max_output_tokens=len(ids), stream=True
        )
    )
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, said) == ("plan it", "Paris.")
    done = events[-1].response
    assert [item.type for item in done.output] == ["reasoning", "message"]
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == [0, 1]


def test_a_reasoning_item_sent_back_reaches_the_template(make_router, thinking_model):
    from router.responses_api import chat_messages

    items = [
        {"type": "message", "role": "user", "content": "q"},
        {"type": "reasoning", "text": "t"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    ]
    assert chat_messages(None, items)[-1]["reasoning_content"] == "t"
    h, info = _router(make_router, thinking_model)
    replay = [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "t"}]},
        {"type": "message", "role": "assistant", "content": "a"},
        {"role": "user", "content": "again"},
    ]  # fmt: skip
    answer = requests.post(
        h.base_url + "/v1/responses", json={"input": replay, "max_output_tokens": 2}, timeout=20
    )
    assert answer.status_code == 200, answer.text
