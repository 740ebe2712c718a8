"""vLLM's `--chat-template`: a template's text or a file holding one answers chats in place of the
tokenizer's, a base model without a template included (through the real router: /tokenize and a
chat completion); a mistyped path and a template that does not parse stop start-up with the
reason; a request's own `chat_template` is a 400, as in vLLM without trusted request templates.
vLLM's `--tool-call-parser` reads calls in the format it names, whatever the template shows."""

from __future__ import annotations

import json
import shutil

import pytest
import requests
from router_fakes import FakeWorker

from engine.model_info import load_chat_template, read_model_info
from router.config import RouterConfig
from router.server import load_model_info

TEMPLATE = "{% for m in messages %}<<{{ m.role }}|{{ m.content }}>>{% endfor %}"
MESSAGES = [{"role": "user", "content": "the weather"}]


@pytest.fixture(scope="module")
def base_model(model_dir, tmp_path_factory):
    """The tiny model without any chat template (a base model's directory)."""
    bare = tmp_path_factory.mktemp("base") / "model"
    shutil.copytree(model_dir, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    config_path = bare / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    assert read_model_info(bare).chat_template is None
    return str(bare)


def test_a_file_or_the_text_itself(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE == load_chat_template(TEMPLATE)
    assert RouterConfig(model_path="m", chat_template=str(path)).chat_template == TEMPLATE
    with pytest.raises(ValueError, match="no such file, and not a Jinja template"):
        RouterConfig(model_path="m", chat_template=str(tmp_path / "missing.jinja"))


def test_a_template_that_does_not_parse_stops_start_up(base_model):
    with pytest.raises(ValueError, match="chat template: line 1"):
        read_model_info(base_model, chat_template="{% for m in messages %}{{ m.content }}")
    # A template that raises for some conversations on purpose is the template's rule.
    strict = "{{ raise_exception('a system message first') }}"
    assert read_model_info(base_model, chat_template=strict).chat_template == strict


def test_a_base_model_answers_chats_with_the_served_template(make_router, base_model):
    info = load_model_info(RouterConfig(model_path=base_model, chat_template=TEMPLATE))
    h = make_router([FakeWorker("d0", "colocated")], info=info)
    answer = requests.post(h.base_url + "/tokenize", json={"messages": MESSAGES}, timeout=20)
    want = info.tokenizer("<<user|the weather>>", add_special_tokens=False)["input_ids"]
    assert answer.status_code == 200 and answer.json()["tokens"] == want
    chat = h.openai().chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=3)
    assert chat.usage.prompt_tokens == len(want)


def test_without_it_a_base_model_refuses_chats(make_router, base_model):
    h = make_router([FakeWorker("d0", "colocated")], info=load_model_info(
        RouterConfig(model_path=base_model)))  # fmt: skip
    answer = requests.post(h.base_url + "/v1/chat/completions", json={"messages": MESSAGES})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "no_chat_template"


def test_a_requests_own_template_is_refused(make_router):
    h = make_router()
    body = {"messages": MESSAGES, "chat_template": TEMPLATE, "max_tokens": 2}
    answer = requests.post(h.base_url + "/v1/chat/completions", json=body, timeout=20)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "chat_template"


CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
PLAIN = "{% for m in messages %}{{ m.content }}{% endfor %}"  # shows no tool format


@pytest.mark.parametrize("parser", [None, "llama3_json"])
def test_tool_call_parser_reads_the_calls_the_template_does_not_show(
    make_router, model_dir, parser
):
    """vLLM's `--tool-call-parser`: the fake worker echoes the prompt, so the answer is the
    user's text, a Llama-3 JSON call. Forced, it is parsed as a call; detected from this
    template (no format), the tools go to a system message and the answer stays text."""
    info = load_model_info(RouterConfig(model_path=model_dir, chat_template=PLAIN))
    h = make_router(info=info, tool_call_parser=parser)
    prompt = info.tokenizer(CALL, add_special_tokens=False)["input_ids"]
    answer = h.openai().chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": CALL}], tools=TOOLS,
        max_tokens=len(prompt),
    )  # fmt: skip
    message = answer.choices[0].message
    if parser is None:
        assert message.tool_calls is None and message.content
        return
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
