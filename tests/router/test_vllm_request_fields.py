"""vLLM's request fields as the parser turns them into an engine request: `documents` reach the
chat template, `truncate_prompt_tokens` keeps the rendered or tokenized prompt's last tokens
(and lets a text longer than the window through), `bad_words` become vLLM's token sequences,
`allowed_token_ids` and the output flags are carried. The served answers are in
tests/interop/test_vllm_sampling_fields.py."""

from __future__ import annotations

import json

import pytest

from router.errors import APIError
from router.openai_api import RequestParser

READS_DOCUMENTS = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% for d in documents or [] %}[doc] {{ d.title }}: {{ d.text }}\n{% endfor %}"
)
WINDOW = 64


@pytest.fixture(scope="module")
def tokenizer():
    from tools.make_model import build_tokenizer

    tok = build_tokenizer(1024, 1024)
    tok.chat_template = READS_DOCUMENTS
    return tok


@pytest.fixture(scope="module")
def parser(tokenizer):
    return RequestParser(tokenizer, "m", WINDOW, len(tokenizer))


def _chat(parser, **fields):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    return parser.parse_chat(json.dumps(body).encode())


def test_documents_reach_a_template_that_reads_them(parser, tokenizer):
    docs = [{"title": "Paris", "text": "sunny"}]
    parsed = _chat(parser, documents=docs)
    assert "[doc] Paris: sunny" in tokenizer.decode(parsed.prompt_ids)
    assert parsed.ignored_fields == []
    assert "[doc]" not in tokenizer.decode(_chat(parser).prompt_ids)


def test_truncation_keeps_the_rendered_prompts_last_tokens(parser):
    whole = _chat(parser, messages=[{"role": "user", "content": "a b c d e f g h"}])
    cut = _chat(
        parser, messages=[{"role": "user", "content": "a b c d e f g h"}], truncate_prompt_tokens=5
    )
    assert cut.prompt_ids == whole.prompt_ids[-5:] and len(whole.prompt_ids) > 5
    assert _chat(parser, truncate_prompt_tokens=-1).prompt_ids == _chat(parser).prompt_ids


def test_truncation_serves_a_text_far_longer_than_the_window(parser, tokenizer):
    text = "the weather is fine today " * 400  # past the untokenized length shortcut
    body = {"prompt": text, "max_tokens": 4}
    with pytest.raises(APIError, match="far longer"):  # refused untokenized
        parser.parse_completion(json.dumps(body).encode())
    # -1: a window's worth, which leaves no room for an answer (vLLM refuses it too).
    with pytest.raises(APIError, match=f"the prompt has {WINDOW} tokens"):
        parser.parse_completion(json.dumps(body | {"truncate_prompt_tokens": -1}).encode())
    parsed = parser.parse_completion(json.dumps(body | {"truncate_prompt_tokens": 20}).encode())
    want = tokenizer(text)["input_ids"][-20:]
    assert parsed.prompt_ids == want and parsed.sampling.max_tokens == 4


def test_bad_words_become_vllms_token_sequences(parser, tokenizer):
    def ids(text):
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

    parsed = parser.parse_completion(
        json.dumps({"prompt": "x", "bad_words": ["weather", "  fine day"]}).encode()
    )
    want = [ids("weather")]
    if ids(" weather")[0] != want[0][0] and len(ids(" weather")) == len(want[0]):
        want.append(ids(" weather"))
    want.append(ids("fine day"))  # leading spaces are stripped first, as vLLM does
    if ids(" fine day")[0] != ids("fine day")[0] and len(ids(" fine day")) == len(want[-1]):
        want.append(ids(" fine day"))
    assert parsed.sampling.bad_words_token_ids == tuple(want)
    assert parsed.sampling.needs_processing


def test_allowed_ids_and_output_flags_are_carried(parser):
    body = {
        "prompt": "x",
        "allowed_token_ids": [7, 9, 7],
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "priority": 0,
    }
    parsed = parser.parse_completion(json.dumps(body).encode())
    assert parsed.sampling.allowed_token_ids == (7, 9, 7)
    assert parsed.return_token_ids and parsed.tokens_as_ids
    assert parsed.ignored_fields == []
    plain = parser.parse_completion(b'{"prompt": "x"}')
    assert not (plain.return_token_ids or plain.tokens_as_ids or plain.sampling.needs_processing)


def test_priority_needs_the_priority_policy(tokenizer):
    by_priority = RequestParser(
        tokenizer, "m", WINDOW, len(tokenizer), scheduling_policy="priority"
    )
    body = {"prompt": "x", "max_tokens": 2, "priority": -3}
    assert by_priority.parse_completion(json.dumps(body).encode()).sampling.priority == -3
    fcfs = RequestParser(tokenizer, "m", WINDOW, len(tokenizer))
    with pytest.raises(APIError, match="--scheduling-policy priority") as e:
        fcfs.parse_completion(json.dumps(body).encode())
    assert (e.value.status, e.value.param) == (400, "priority")
    assert fcfs.parse_completion(json.dumps(body | {"priority": 0}).encode()).sampling.priority == 0


def test_the_router_config_sets_the_parsers_policy(make_tiny_model):
    from router.config import RouterConfig
    from router.server import load_model_info, request_parser

    config = RouterConfig(model_path=str(make_tiny_model("llama")), scheduling_policy="priority")
    assert request_parser(config, load_model_info(config)).by_priority
