"""Tool calling on a model whose chat template has no tool-call format (`detect_tool_format`
found none): the tools are described in a system message, the model is asked for the Hermes
format (`<tool_call>{"name", "arguments"}</tool_call>` blocks, which router/tools.py parses),
and the conversation's earlier calls and results are written into the messages in that same
format, since such a template drops `tool_calls` and may not know a `tool` role.

So `tool_choice` "auto" (OpenAI's default when tools are given) works on any model: the model
may answer in prose or call; what it writes in the declared format comes back as `tool_calls`.
Forced calls ("required", a named function) need none of this: the grammar makes the call.
"""

from __future__ import annotations

import json

FORMAT = "hermes"  # the parser of what the prompt below asks for
_PROMPT = (
    "You can call functions to help with the request. They are described by these JSON "
    "schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call functions, answer with only one block per call, each exactly like this:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n'
    "</tool_call>\n"
    "Function results come back between <tool_response></tool_response>. When no function "
    "is needed, answer normally."
)


def tools_prompt(tools: list[dict]) -> str:
    return _PROMPT.format(tools="\n".join(json.dumps(t["function"]) for t in tools))


def _call_text(call: dict) -> str:
    fn = call["function"]
    args = fn.get("arguments", {})
    if isinstance(args, str):  # as the client sent it: JSON text
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return f"<tool_call>\n{json.dumps({'name': fn['name'], 'arguments': args})}\n</tool_call>"


def _as_plain(message: dict) -> dict:
    """One message without `tool_calls` or the `tool` role."""
    if message["role"] == "tool":
        return {
            "role": "user",
            "content": f"<tool_response>\n{message['content']}\n</tool_response>",
        }
    out = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
    calls = message.get("tool_calls")
    if calls:
        text = "\n".join(_call_text(c) for c in calls)
        out["content"] = f"{message.get('content') or ''}\n{text}".strip()
    return out


def messages_with_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` (as the chat template reads them) with the tools described in the system
    message and earlier calls and results written out; consecutive user turns that a tool
    result produced are joined (templates that require alternating roles refuse two)."""
    out: list[dict] = []
    for message in messages:
        plain = _as_plain(message)
        merge = out and out[-1]["role"] == "user" and plain["role"] == "user"
        if merge and (message["role"] == "tool" or out[-1].get("_tool")):
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{plain['content']}"}
            continue
        out.append({**plain, "_tool": True} if message["role"] == "tool" else plain)
    out = [{k: v for k, v in m.items() if k != "_tool"} for m in out]
    prompt = tools_prompt(tools)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out
