"""Tool calls on a model whose chat template is in Mistral's format (`[TOOL_CALLS]` then a JSON
list of calls), through a real router with the openai client: the template is recognised, a
tool loop's OpenAI ids reach the template in the 9-character shape it demands, the "auto"
grammar names the marker by its token id, the marker (a special token) is decoded so the call
is read back, streamed as OpenAI deltas, and the EOS token's text stays out of the answer.

The worker is a fake that answers a fixed token sequence (the router is what is tested); the
tokenizer is the tiny test model's with Mistral's control tokens added as special tokens."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from router_fakes import FakeWorker

from router.config import RouterConfig
from router.server import load_model_info

# A template in Mistral v0.3's shape (written here, not Mistral's file): tools before the last
# user turn, calls as `[TOOL_CALLS] [...]` with 9-character ids, results as [TOOL_RESULTS].
TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{{- '[INST] ' + message.content + '[/INST]' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '[TOOL_CALLS] [' }}
{%- for call in message.tool_calls %}
{%- if call.id is not defined or call.id | length != 9 %}{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}
{{- '{"name": ' + (call.function.name | tojson) + ', "arguments": ' + (call.function.arguments | tojson) + ', "id": "' + call.id + '"}' }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- elif message.role == 'assistant' %}
{{- message.content + eos_token }}
{%- elif message.role == 'tool' %}
{%- if message.tool_call_id | length != 9 %}{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}
{{- '[TOOL_RESULTS] {"content": ' + (message.content | tojson) + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}"""  # noqa: E501
CONTROL = ["[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
           "[/TOOL_RESULTS]", "[INST]", "[/INST]"]  # fmt: skip
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "What time is it in Tokyo?"}]
CALL_TEXT = ' [{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}]'


@pytest.fixture(scope="module")
def mistral_model(model_dir, tmp_path_factory):
    """The tiny model's directory with a Mistral-style tokenizer: (path, tokenizer)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("mistral") / "mistral-tiny"
    shutil.copytree(model_dir, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    # The router reads only the config: its vocabulary must cover the added ids.
    config = json.loads((out / "config.json").read_text())
    config["vocab_size"] = max(config["vocab_size"], len(tok))
    (out / "config.json").write_text(json.dumps(config))
    return out, AutoTokenizer.from_pretrained(out)


def _router(make_router, mistral_model, script: list[int]):
    path, _ = mistral_model
    info = load_model_info(RouterConfig(model_path=str(path)))
    worker = FakeWorker("d0", "colocated", script=script)
    return make_router([worker], info=info, model_path=str(path)), worker


def _call_script(tok) -> list[int]:
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    return [marker, *tok.encode(CALL_TEXT, add_special_tokens=False), tok.eos_token_id]


def test_an_auto_call_in_mistral_format_is_read_back_whole_and_streamed(make_router, mistral_model):
    _, tok = mistral_model
    h, worker = _router(make_router, mistral_model, _call_script(tok))
    client = h.openai()
    r = client.chat.completions.create(
        model="tiny-llama", messages=ASK, tools=[TIME], max_tokens=64
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments) == {"zone": "Asia/Tokyo"}
    # The grammar names the marker by its token id: the model writes the one token it knows.
    request = worker.received[-1]
    kind, grammar = request.sampling.structured
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert kind == "grammar" and f"<[{marker}]>" in grammar
    from engine.structured.compiler import GrammarCompiler

    compiled = GrammarCompiler(tok, len(tok), (tok.eos_token_id,)).compile(kind, grammar)
    other = [
        marker,
        *tok.encode(CALL_TEXT.replace("get_time", "get_date"), add_special_tokens=False),
    ]
    for ids, ok in ((_call_script(tok), True), (other, False)):
        assert compiled.matcher().accept_tokens(ids) is ok
    stream = client.chat.completions.create(
        model="tiny-llama", messages=ASK, tools=[TIME], max_tokens=64, stream=True
    )
    deltas, finish, content = [], None, ""
    for chunk in stream:
        (c,) = chunk.choices
        deltas += c.delta.tool_calls or []
        content += c.delta.content or ""
        finish = c.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert deltas[0].id and deltas[0].function.name == "get_time"
    args = [d.function.arguments for d in deltas[1:]]
    assert len(args) > 1 and json.loads("".join(args)) == {"zone": "Asia/Tokyo"}


def test_prose_keeps_no_eos_text_and_a_tool_loop_reaches_the_template(make_router, mistral_model):
    _, tok = mistral_model
    prose = [*tok.encode("It is noon.", add_special_tokens=False), tok.eos_token_id]
    h, worker = _router(make_router, mistral_model, prose)
    client = h.openai()
    r = client.chat.completions.create(
        model="tiny-llama", messages=ASK, tools=[TIME], max_tokens=64
    )
    # Special tokens are decoded to see the marker; the EOS that ended the answer is not text.
    assert r.choices[0].message.content == "It is noon."
    assert r.choices[0].finish_reason == "stop"
    # The loop as an OpenAI client sends it back: ids "call_...", which the template refuses.
    call = {"id": "call_4f1c2a9b8e7d6c5b4a3f2e1d", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "Asia/Tokyo"}'}}  # fmt: skip
    loop = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "09:00"},
            {"role": "user", "content": "Thanks."}]  # fmt: skip
    r = client.chat.completions.create(
        model="tiny-llama", messages=loop, tools=[TIME], max_tokens=64
    )
    assert r.choices[0].message.content == "It is noon."
    prompt = tok.decode(worker.received[-1].prompt_token_ids, skip_special_tokens=False)
    (nine,) = set(re.findall(r'"id": "(\w+)"', prompt))
    assert len(nine) == 9 and f'"call_id": "{nine}"' in prompt
