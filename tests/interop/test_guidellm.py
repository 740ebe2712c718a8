"""guidellm 0.8 (`guidellm run`, its own processes) against the package's live `tandem serve`, on
each of its OpenAI request formats: chat completions, completions and the Responses API.

guidellm sends what benchmark users send: synthetic prompts of an exact token count, streams
with `stream_options: {include_usage, continuous_usage_stats}` (vLLM's), `ignore_eos` and a
token limit for a fixed answer length, and reads the counts from the server's usage. Every
request must succeed with exactly the answer length asked for, the prompt counted as guidellm
built it, and the answer streamed token by token. Its multi-turn conversations (each turn sends
the history back, after a prefix all conversations share) must find the history in the prefix
cache: `usage.prompt_tokens_details.cached_tokens`, which guidellm records per request. Its
tool-calling conversations (a first turn with `tool_choice: "required"` and no token limit, a
second that sends the call and a tool result back) must run: the random model's call is cut at
the context window, and the cut call comes back in the history. Every KV block comes back
afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REQUESTS, STREAMS = 12, 4
PROMPT_TOKENS, OUTPUT_TOKENS = 32, 8  # 32 > the package's disagg threshold: the remote path
FORMATS = ["/v1/chat/completions", "/v1/completions", "/v1/responses"]


BLOCK = 16  # the engine's KV block: the prefix cache reuses whole blocks
MULTITURN = f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}," \
    "turns=3,prefix_tokens=16,prefix_count=1"  # fmt: skip


def _guidellm(url: str, model: str, request_format: str, out: str, data: str = "") -> dict:
    cmd = [
        sys.executable, "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={url},request_format={request_format}",
        "--profile", f"kind=concurrent,streams={STREAMS}",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", data or f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                          f"output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=huggingface_auto,model={model}",
        "--output", f"kind=json,path={out}",
        "--disable-console",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        (benchmark,) = json.load(f)["benchmarks"]
    return benchmark["requests"]


@pytest.fixture(scope="module", params=FORMATS, ids=["chat", "completions", "responses"])
def run(request, server, interop_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("guidellm") / "report.json"
    return request.param, _guidellm(server.url, str(interop_model), request.param, str(out))


def test_every_request_succeeds(run):
    _, requests = run
    assert len(requests["successful"]) == REQUESTS, requests["errored"][:1]
    assert requests["errored"] == [] and requests["incomplete"] == []


def test_answers_have_the_asked_length_and_stream(run):
    _, requests = run
    for r in requests["successful"]:
        assert r["output_metrics"]["text_tokens"] == OUTPUT_TOKENS, r["output"]
        # The answer came as a stream of pieces, not in one (a piece may hold two tokens
        # when a character's bytes span them).
        assert r["info"]["timings"]["token_iterations"] >= OUTPUT_TOKENS // 2, r["info"]


def test_prompts_are_counted_as_guidellm_built_them(run):
    request_format, requests = run
    counts = {r["input_metrics"]["text_tokens"] for r in requests["successful"]}
    if request_format == "/v1/completions":
        assert counts == {PROMPT_TOKENS}
    else:  # the chat template's tokens on top, the same for every prompt
        (count,) = counts
        assert count > PROMPT_TOKENS


@pytest.fixture(scope="module")
def multiturn(server, interop_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("guidellm-multiturn") / "report.json"
    fmt = "/v1/chat/completions"
    return _guidellm(server.url, str(interop_model), fmt, str(out), MULTITURN)["successful"]


def test_multiturn_history_comes_from_the_prefix_cache(multiturn):
    assert len(multiturn) == REQUESTS
    by_conversation: dict[str, dict[int, dict]] = {}
    for r in multiturn:
        by_conversation.setdefault(r["info"]["conversation_id"], {})[r["info"]["turn_index"]] = r
    later = 0
    for turns in by_conversation.values():
        for k in sorted(turns)[1:]:
            if k - 1 not in turns:
                continue
            before, now = turns[k - 1], turns[k]
            history = before["input_metrics"]["text_tokens"]  # sent again, in front
            assert now["input_metrics"]["text_tokens"] > history
            assert now["input_metrics"]["cached_tokens"] >= history // BLOCK * BLOCK, now
            later += 1
    assert later >= REQUESTS // 3, by_conversation.keys()  # turns 2 and 3 of most


@pytest.fixture(scope="module")
def tool_turns(server, interop_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("guidellm-tools") / "report.json"
    data = f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}," \
        "turns=2,tool_call_turns=[0]"  # fmt: skip
    return _guidellm(server.url, str(interop_model), "/v1/chat/completions", str(out), data)


def test_tool_call_turns_run_and_the_calls_come_back(tool_turns):
    assert tool_turns["errored"] == [] and tool_turns["incomplete"] == []
    by_turn: dict[int, list] = {}
    for r in tool_turns["successful"]:
        by_turn.setdefault(r["info"]["turn_index"], []).append(r)
    assert by_turn.get(0) and by_turn.get(1), by_turn.keys()
    for r in by_turn[0]:
        assert [c["function"]["name"] for c in r["tool_calls"]], r["output"]  # a call, forced


def test_every_kv_block_returned(run, multiturn, tool_turns, server):
    server.wait_all_blocks_free()
