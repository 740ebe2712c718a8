"""A real model through both pools: `tandem serve` on SmolLM2-135M-Instruct's GGUF file (1
prefill + 1 decode, fp32) answers chat requests with exactly the text transformers' greedy
decoding gives on the same file; short questions take the local-prefill path, questions about
a passage the prefill worker and a NIXL hand-off (proved from the decode pool's counters), and
every KV block comes back. On the same server, lm-evaluation-harness scores a small local
multiple-choice task above chance, with transformers' choices and log-likelihoods, and the
agent clients (langchain-openai, instructor, litellm, the openai client's Responses API, the
Agents SDK; tests/interop/agent_clients.py) complete and parse what they asked for."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import torch
from e2e.e2e_helpers import TransferCheck

from cluster.demo import PASSAGES, SHORT_QUESTIONS
from engine.gguf_file import converted_metadata

from . import agent_clients as ac
from .lm_eval_client import encode_pair, evaluate
from .reference import Reference

MC = "tandem_interop_mc"  # six everyday questions, 3-4 choices each
THRESHOLD = 64  # the chat template alone is ~30 tokens; a passage makes 100+
MAX_TOKENS = 24


def _conversations() -> list[list[dict]]:
    short = [[{"role": "user", "content": q}] for q in SHORT_QUESTIONS[:3]]
    long_ = [[{"role": "user", "content": f"{p}\n\n{q}"}] for p, q in PASSAGES[:3]]
    return short + long_


def _greedy_answer(reference: Reference, messages: list[dict]) -> tuple[str, int]:
    """transformers' greedy answer (fp32, stopping at EOS like the server) and the prompt's
    length. `generate` with its KV cache: `Reference.greedy` recomputes the whole sequence
    each step (it keeps every step's raw log-probs), 3x slower for answers this long."""
    ids = reference.chat_ids(messages)
    with torch.no_grad():
        out = reference.model.generate(
            torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False
        )
    return reference.text(out[0, len(ids) :].tolist()), len(ids)


async def _chat_all(url: str, conversations: list[list[dict]]) -> list[tuple[str, str, int]]:
    """(text, X-Tandem-Path, prompt tokens) per conversation; odd ones streamed."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=180)
    model = (await client.models.list()).data[0].id

    async def one(i: int, messages: list[dict]):
        kwargs = dict(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        if i % 2 == 0:
            raw = await client.chat.completions.with_raw_response.create(**kwargs)
            r = raw.parse()
            return r.choices[0].message.content, raw.headers["x-tandem-path"], r.usage.prompt_tokens
        text, usage = "", None
        async with client.chat.completions.with_streaming_response.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        ) as resp:
            path = resp.headers["x-tandem-path"]
            async for chunk in await resp.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                usage = chunk.usage or usage
        return text, path, usage.prompt_tokens

    try:
        return await asyncio.gather(*(one(i, m) for i, m in enumerate(conversations)))
    finally:
        await client.close()


@pytest.fixture(scope="module")
def server(start_serve, smollm2_gguf):
    # 256 blocks (4096 tokens) per worker hold every request here and start faster.
    flags = ("--dtype", "float32", "--prefill", "1", "--decode", "1", "--num-kv-blocks", "256")
    flags += ("--disagg-threshold", str(THRESHOLD))
    # The paths asserted below follow the prompt-length rule (affinity routing): kv-events
    # would prefill a conversation locally once the decode worker holds its earlier turns.
    flags += ("--routing", "affinity")
    with start_serve(smollm2_gguf, *flags) as sp:
        yield sp


@pytest.fixture(scope="module")
def reference(smollm2_hf) -> Reference:
    return Reference(*smollm2_hf)


def test_smollm2_gguf_both_pools_match_transformers(server, smollm2_gguf, reference):
    status, body = server.get("/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"
    conversations = _conversations()
    check = TransferCheck(server, smollm2_gguf)
    results = asyncio.run(_chat_all(server.url, conversations))
    remote = []
    for messages, (text, path, prompt_tokens) in zip(conversations, results, strict=True):
        expected, length = _greedy_answer(reference, messages)
        assert text == expected, (messages[-1]["content"][-60:], text, expected)
        assert prompt_tokens == length
        assert path == ("remote" if length >= THRESHOLD else "local"), (length, path)
        if path == "remote":
            remote.append(length)
    assert len(remote) == 3, remote
    check.verify(remote)
    server.wait_all_blocks_free()


def test_lm_eval_multiple_choice_above_chance_with_transformers_choices(
    server, smollm2_gguf, reference, tmp_path_factory
):
    """lm-evaluation-harness (local-completions, token-id requests) on a small local
    multiple-choice task: the real model scores above chance, and every question's choice and
    every log-likelihood equal transformers' on the same file."""
    status, body = server.get("/v1/models")
    model_name = json.loads(body)["data"][0]["id"]
    # lm-eval loads a tokenizer folder: the GGUF's, as tandem converted it.
    tokenizer = str(converted_metadata(str(smollm2_gguf)))
    result = evaluate(server.url, model_name, tokenizer, [MC], tmp_path_factory.mktemp("ds"))
    samples = result["samples"][MC]
    chance = sum(1 / len(s["doc"]["choices"]) for s in samples) / len(samples)
    assert result["results"][MC]["acc,none"] > chance + 0.25, (result["results"][MC], chance)
    for sample in samples:
        got = [resp[0][0] for resp in sample["resps"]]
        pairs = [encode_pair(reference.tokenizer, *arg) for arg in sample["arguments"]]
        want = [reference.continuation(ctx, cont)[0] for ctx, cont in pairs]
        for g, w in zip(got, want, strict=True):
            assert abs(g - w) < 1e-4, (sample["doc"]["question"], got, want)
        assert max(range(len(got)), key=got.__getitem__) == max(
            range(len(want)), key=want.__getitem__
        ), sample["doc"]["question"]
    server.wait_all_blocks_free()


@pytest.fixture(scope="module")
def model_name(server) -> str:
    return json.loads(server.get("/v1/models")[1])["data"][0]["id"]


def test_langchain_tool_loop_without_tool_choice(server, model_name):
    """`bind_tools` with no tool_choice (OpenAI's auto) on a template without a tool format:
    the first turn and the loop's next turn (its own call and the tool's result sent back as
    langchain serializes them) both complete."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    llm = ac.langchain_model(server.url, model_name)
    question = "What is the weather in Paris?"
    final = ac.langchain_tool_loop(llm, [HumanMessage(question)])[-1]
    assert isinstance(final, AIMessage) and final.content and not final.tool_calls
    call = {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1"}
    history = [HumanMessage(question), AIMessage("", tool_calls=[call]),
               ToolMessage(ac.weather("Paris"), tool_call_id="call_1")]  # fmt: skip
    final = ac.langchain_tool_loop(llm, history)[-1]
    assert final.response_metadata["finish_reason"] in ("stop", "length")
    assert isinstance(final.content, str) and final.content


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_langchain_structured_output(server, model_name, method):
    llm = ac.langchain_model(server.url, model_name)
    schema = ac.City if method != "json_mode" else ac.City.model_json_schema()
    got = llm.with_structured_output(schema, method=method).invoke(ac.CITY_QUESTION)
    city = ac.City.model_validate(got)  # json_mode parses to a dict: the keys must be there
    assert city.name and city.country, got


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_response_model(server, model_name, mode):
    client = ac.instructor_client(server.url, mode)
    city = client.chat.completions.create(
        model=model_name, response_model=ac.City, max_tokens=64, temperature=0, max_retries=0,
        messages=[{"role": "user", "content": ac.CITY_QUESTION}],
    )  # fmt: skip
    assert isinstance(city, ac.City) and city.name and city.country


def test_instructor_create_iterable(server, model_name):
    client = ac.instructor_client(server.url, "TOOLS")
    cities = client.chat.completions.create_iterable(
        model=model_name, response_model=ac.City, max_tokens=96, temperature=0, max_retries=0,
        messages=[{"role": "user", "content": "List two capital cities with their countries."}],
    )  # fmt: skip
    assert all(isinstance(c, ac.City) for c in list(cities))


def test_instructor_parallel_tools(server, model_name):
    """PARALLEL_TOOLS sends tools with tool_choice "auto" after an earlier turn of parallel
    calls. The server must answer it (it was a 400 on templates without a tool format);
    whatever calls come back parse into the response models. Whether this 135M model calls at
    all is its own choice: it answers in prose, which instructor reports as "no tool calls"."""
    from collections.abc import Iterable

    from instructor.core.exceptions import InstructorRetryException

    client = ac.instructor_client(server.url, "PARALLEL_TOOLS")
    answers = []
    client.on("completion:response", answers.append)
    messages = ac.one_shot_history() + [
        {"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}
    ]
    try:
        items = list(client.chat.completions.create(
            model=model_name, response_model=Iterable[ac.Weather | ac.LocalTime],
            messages=messages, max_tokens=64, temperature=0, max_retries=0,
        ))  # fmt: skip
    except InstructorRetryException as e:
        assert "No tool calls" in str(e), e
        items = []
    (answer,) = answers
    assert answer.choices[0].finish_reason in ("stop", "tool_calls"), answer
    calls = answer.choices[0].message.tool_calls or []
    assert len(items) == len(calls)
    assert all(isinstance(i, ac.Weather | ac.LocalTime) for i in items)


def test_litellm_tools(server, model_name):
    out = ac.litellm_tool_call(
        server.url, model_name, [{"role": "user", "content": "What is the weather in Paris?"}]
    )
    message = out.choices[0].message
    assert out.choices[0].finish_reason in ("stop", "tool_calls", "length")
    assert message.content or message.tool_calls
    for call in message.tool_calls or []:
        assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)


def test_responses_api_plain_streamed_and_a_function_tool_round_trip(server, model_name):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    ask = dict(model=model_name, input="What is the capital of France?", temperature=0,
               max_output_tokens=24)  # fmt: skip
    plain = client.responses.create(**ask)
    assert plain.status == "completed" and plain.output_text and plain.usage.input_tokens > 0
    events = list(client.responses.create(**ask, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == plain.output_text
    tools = [ac.responses_tool(ac.WEATHER_TOOL)]
    first = client.responses.create(
        model=model_name, input="What is the weather in Paris?", tools=tools,
        tool_choice="required", max_output_tokens=48, temperature=0,
    )  # fmt: skip
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    result = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": ac.weather("Paris"),
    }
    second = client.responses.create(
        model=model_name, previous_response_id=first.id, input=[result], tools=tools,
        max_output_tokens=32, temperature=0,
    )  # fmt: skip
    assert second.status == "completed" and second.output_text
    client.close()


def test_agents_sdk_with_a_function_tool(server, model_name):
    result = ac.agents_sdk_run(server.url, model_name, "What is the weather in Paris?")
    assert isinstance(result.final_output, str) and result.final_output
    server.wait_all_blocks_free()
