"""The body of `POST /v1/responses` (OpenAI's Responses API) as pydantic v2 models.

Same rules as router/protocol.py (strict types, `Limits` as the validation context, the first
error chosen by `errors.api_error`): unknown top-level fields are kept and named back in
`X-Tandem-Ignored-Fields`; the OpenAI fields tandem cannot serve (`RESPONSES_REFUSED`:
reasoning, background mode, stored prompts, conversations, ...) are a 400 naming them unless
left at their default; built-in tools (web_search, file_search, ...) and input items other than
messages, `function_call` and `function_call_output` are a 400 naming their place.

`ResponsesRequest.items()` gives the input as normalized item dicts (what a stored response
keeps, router/response_store.py); router/responses_api.py turns them into chat messages and
the request into a chat completions body, so a Responses request runs exactly as a chat one.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    Tag,
    WithJsonSchema,
    model_validator,
)

from router.protocol import (
    TOOL_NAME,
    FunctionParameters,
    JsonSchemaText,
    ModelName,
    StrictModel,
    Temperature,
    fail,
    flag,
    one_of,
)

RESPONSES_REFUSED = {
    "reasoning": "reasoning options are not supported by these models",
    "background": "background mode is not supported",
    "conversation": "conversations are not supported; use previous_response_id",
    "prompt": "stored prompt templates are not supported",
    "include": "no extra output data can be included",
    "truncation": "only 'disabled' is supported (a prompt over the window is a 400)",
    "max_tool_calls": "not supported",
    "top_logprobs": "log-probabilities are not supported on /v1/responses",
}
# The values a refused field may hold: its defaults.
_REFUSED_DEFAULTS: dict[str, list[Any]] = {
    "background": [None, False],
    "include": [None, []],
    "truncation": [None, "disabled"],
    "top_logprobs": [None, 0],
}
BUILTIN_TOOLS = (
    "web_search", "web_search_preview", "web_search_2025_08_26",
    "web_search_preview_2025_03_11", "file_search", "computer_use_preview", "computer_use",
    "code_interpreter", "image_generation", "mcp", "local_shell", "shell", "custom",
    "apply_patch",
)  # fmt: skip
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _refused(name: str) -> Any:
    defaults = _REFUSED_DEFAULTS.get(name, [None, {}])

    def check(value: Any) -> Any:
        if not any(value == d and type(value) is type(d) for d in defaults):
            raise fail(f"'{name}': {RESPONSES_REFUSED[name]}", whole=True)
        return value

    why = f"refused with a 400 unless left at its default: {RESPONSES_REFUSED[name]}"
    schema = {"enum": defaults, "deprecated": True, "description": why}
    return Annotated[Any, PlainValidator(check), WithJsonSchema(schema)]


# ------------------------------------------------------------------ input items


class TextContent(StrictModel):
    """A text part of a message: input_text (user, system, developer) or output_text (an
    assistant message sent back, with its annotations and logprobs, which are not used)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


MessageContent = one_of(
    "a string or a list of input_text / output_text parts",
    string=str,
    array=list[TextContent],
)


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: MessageContent
    id: str | None = flag("an output item's id, sent back: not used")
    status: str | None = flag("an output item's status, sent back: not used")

    def normalized(self) -> dict[str, Any]:
        content = self.content
        text = content if isinstance(content, str) else "\n".join(p.text for p in content)
        return {"type": "message", "role": self.role, "content": text}


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    # JSON text as the model wrote it; a call cut at max_output_tokens is sent back cut.
    arguments: str = Field(description="the arguments as JSON text (not checked)")
    id: str | None = flag("the output item's id: not used")
    status: str | None = flag("the output item's status: not used")

    def normalized(self) -> dict[str, Any]:
        keys = ("call_id", "name", "arguments")
        return {"type": "function_call", **{k: getattr(self, k) for k in keys}}


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: one_of("a string or a list of input_text parts", string=str, array=list[TextContent])
    id: str | None = flag("the item's id: not used")
    status: str | None = flag("the item's status: not used")

    def normalized(self) -> dict[str, Any]:
        out = self.output
        text = out if isinstance(out, str) else "\n".join(p.text for p in out)
        return {"type": "function_call_output", "call_id": self.call_id, "output": text}


class ReasoningText(StrictModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(StrictModel):
    """A reasoning model's thinking, sent back as it was answered (an agent loop replays its
    output items): it reaches the chat template on the assistant turn that follows."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] = []
    encrypted_content: None = flag("thinking another service encrypted cannot be read here")
    id: str | None = flag("the output item's id: not used")
    status: str | None = flag("the output item's status: not used")

    def normalized(self) -> dict[str, Any]:
        parts = self.content if self.content else self.summary
        return {"type": "reasoning", "text": "\n".join(p.text for p in parts)}


def _item_type(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type", "message" if "role" in value else None)
    return f"<{kind}>" if kind in ITEM_TYPES else None  # <...>: left out of error paths


InputItem = Annotated[
    Annotated[MessageItem, Tag("<message>")]
    | Annotated[FunctionCallItem, Tag("<function_call>")]
    | Annotated[FunctionCallOutputItem, Tag("<function_call_output>")]
    | Annotated[ReasoningItem, Tag("<reasoning>")],
    Discriminator(
        _item_type,
        custom_error_type="invalid_value",
        custom_error_message=(
            "must be a message (role and content), a function_call, a function_call_output "
            "or a reasoning item (other item types are not supported)"
        ),
    ),
]
Input = one_of(
    "a string or a list of input items",
    string=Annotated[str, Field(min_length=1)],
    array=Annotated[list[InputItem], Field(min_length=1)],
)


# ------------------------------------------------------------------ tools and text format


class FunctionTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["function"]
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    parameters: FunctionParameters | None = None
    strict: bool | None = None

    def as_chat(self) -> dict[str, Any]:
        """The chat completions tool (`{"type", "function": {...}}`) this one is."""
        fn = self.model_dump(exclude_unset=True, exclude={"type"}, mode="json")
        return {"type": "function", "function": fn}


def _tool(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(kind, str) and kind != "function":
        raise fail(
            f"is the built-in tool {kind!r}, which is not supported; only 'function' tools are"
        )
    return value


def _unique(tools: list[FunctionTool]) -> list[FunctionTool]:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise fail(f"tools[{i}].name {tool.name!r} is defined twice", whole=True, param="tools")
        seen.add(tool.name)
    return tools


Tools = list[Annotated[FunctionTool, BeforeValidator(_tool)]]


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


ResponsesToolChoice = one_of(
    "'none', 'auto', 'required' or a function object (type 'function', name)",
    string=Literal["none", "auto", "required"],
    object=NamedFunctionChoice,
)


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = flag("json_schema: the schema's name")
    schema_: JsonSchemaText | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _holds_its_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise fail("json_schema needs 'schema' (and 'name')")
        return self

    def as_response_format(self) -> dict[str, Any]:
        """The chat completions `response_format` this format is."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name or "response", "schema": self.schema_, "strict": self.strict}
        return {"type": "json_schema", "json_schema": spec}


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = flag("only the default, 'medium'")


# ------------------------------------------------------------------ the request


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: ModelName = None
    input: Input = Field(description="a string (one user message) or a list of input items")
    instructions: str | None = flag("a system message before the input (not carried over)")
    previous_response_id: str | None = flag("continue a stored response's conversation")
    max_output_tokens: Annotated[int, Field(ge=1)] | None = flag("tokens to generate")
    temperature: Temperature | None = flag("0 is greedy; default from generation_config.json")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = flag("nucleus sampling mass")
    tools: Tools | None = Field(None, description="function tools (built-in tools: a 400)")
    tool_choice: ResponsesToolChoice | None = flag("default 'auto' with tools")
    parallel_tool_calls: bool | None = flag("false: at most one function call")
    text: TextConfig | None = flag("text.format: plain text, json_object or json_schema")
    stream: bool | None = flag("answer as server-sent Responses events")
    stream_options: dict[str, Any] | None = flag("accepted, not used")
    store: bool | None = flag("keep the response for previous_response_id (default true)")
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = flag("echoed back")
    user: str | None = flag("OpenAI's end-user id: accepted, not used")
    safety_identifier: str | None = flag("accepted, not used")
    prompt_cache_key: str | None = flag("accepted, not used")
    service_tier: str | None = flag("accepted, not used")
    reasoning: _refused("reasoning") = None
    background: _refused("background") = None
    conversation: _refused("conversation") = None
    prompt: _refused("prompt") = None
    include: _refused("include") = None
    truncation: _refused("truncation") = None
    max_tool_calls: _refused("max_tool_calls") = None
    top_logprobs: _refused("top_logprobs") = None
    # Accepted without effect: named back in X-Tandem-Ignored-Fields when set.
    NOT_USED: ClassVar[tuple[str, ...]] = (
        "stream_options", "user", "safety_identifier", "prompt_cache_key", "service_tier"
    )  # fmt: skip

    @model_validator(mode="after")
    def _tool_rules(self) -> ResponsesRequest:
        if self.tools:
            _unique(self.tools)
        choice = self.tool_choice
        if not self.tools and choice not in (None, "none", "auto"):
            raise fail("'tool_choice' needs 'tools'", whole=True, param="tool_choice")
        if isinstance(choice, NamedFunctionChoice):
            if choice.name not in {t.name for t in self.tools or ()}:
                message = f"tool_choice.name {choice.name!r} is not one of the tools"
                raise fail(message, whole=True, param="tool_choice")
        return self

    def items(self) -> list[dict[str, Any]]:
        """The input as normalized items (a string input: one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.normalized() for item in self.input]

    def chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        if isinstance(choice, NamedFunctionChoice):
            return {"type": "function", "function": {"name": choice.name}}
        return choice
