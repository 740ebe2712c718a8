"""The agent and structured-output clients people put in front of an OpenAI-compatible server,
each driven the way its documentation shows, against a live tandem server: langchain-openai,
instructor, litellm, the openai client's Responses API and the OpenAI Agents SDK.

Each helper returns what the client parsed (or raised), so the tests can say what completed.
No client here may reach the internet: litellm reads its bundled model-cost map, the Agents
SDK's tracing (which exports to OpenAI) is off."""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import BaseModel

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before litellm is imported


class City(BaseModel):
    name: str
    country: str


class Weather(BaseModel):
    city: str


class LocalTime(BaseModel):
    timezone: str


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CITY_QUESTION = (
    "Give the capital city of France and its country as JSON with keys name and country."
)


def weather(city: str) -> str:
    return f"It is sunny and 22 C in {city}."


def langchain_model(url: str, model: str, max_tokens: int = 64):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=url + "/v1", api_key="unused", model=model, temperature=0,
        max_tokens=max_tokens, max_retries=0, timeout=120,
    )  # fmt: skip


def langchain_tool_loop(llm, messages: list, max_turns: int = 3) -> list:
    """The loop `bind_tools` documents: invoke, run each tool call, append its result, invoke
    again, until the model answers without calls. No `tool_choice` anywhere."""
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool

    get_weather = tool(weather, description=WEATHER_TOOL["function"]["description"])
    get_weather.name = "get_weather"
    bound = llm.bind_tools([get_weather])
    for _ in range(max_turns):
        reply = bound.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            result = get_weather.invoke(call["args"])
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
    return messages


def instructor_client(url: str, mode_name: str):
    import instructor
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return instructor.from_openai(client, mode=getattr(instructor.Mode, mode_name))


def litellm_tool_call(url: str, model: str, messages: list[dict]) -> Any:
    import litellm

    return litellm.completion(
        model="openai/" + model, api_base=url + "/v1", api_key="unused", messages=messages,
        tools=[WEATHER_TOOL], max_tokens=48, temperature=0,
    )  # fmt: skip


def responses_tool(fn: dict) -> dict:
    """A chat-completions function tool in the Responses API's flat shape."""
    return {"type": "function", **fn["function"]}


def agents_sdk_run(url: str, model: str, question: str) -> Any:
    """The Agents SDK with its defaults (the Responses API model), one function tool; only the
    client's address and the trace export are set (the SDK refuses an answer cut by a token
    limit, so none is set)."""
    import openai
    from agents import (
        Agent,
        Runner,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    set_default_openai_client(client, use_for_tracing=False)
    get_weather = function_tool(weather, name_override="get_weather")
    agent = Agent(name="Assistant", instructions="You are a helpful assistant. Answer in one short sentence.",
                  tools=[get_weather], model=model)  # fmt: skip
    return Runner.run_sync(agent, question, max_turns=3)


def one_shot_history() -> list[dict]:
    """An earlier turn of an agent loop: two parallel calls, their results, the answer."""
    calls = [("c1", "Weather", {"city": "Rome"}), ("c2", "LocalTime", {"timezone": "America/Lima"})]
    return [
        {"role": "user", "content": "What is the weather in Rome and the time in Lima?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, n, a in calls
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "10:00"},
        {"role": "assistant", "content": "Rome is sunny; it is 10:00 in Lima."},
    ]  # fmt: skip
