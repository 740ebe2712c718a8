"""The bodies of the router's HTTP API as pydantic v2 models: the one definition of what a
request may hold, validated straight from its bytes, and the source of /openapi.json. The
completions body and its prompt forms are in router/completion_protocol.py.

A body's bytes (`router.openai_api.read_body`: read with a deadline, size and lone-surrogate
checks) -> `Model.model_validate_json(raw, context=Limits)` (strict: a bool is not an int, a
string not a number; every bound here, the sampling ones from engine.protocol; token ids within
the vocabulary) -> router/openai_api.py makes a `ParsedRequest` (tokenizer, chat template,
context window, structured-output compile). A `ValidationError` becomes one 4xx by
`api_error`, the first error in this order (several mistakes are always told the same):
1. the body is not JSON, or not a JSON object (400 `invalid_json`);
2. `model` names another model (404 `model_not_found`);
3. an unknown top-level field where unknown fields are refused (/tokenize, /detokenize);
4. the fields in declaration order (inside a field: its items in order, then its own checks);
5. the rules across fields (the model validators, in the order written);
6. the checks that need the tokenizer or the engine (router/openai_api.py).

Unknown fields of the generation routes are kept (`extra="allow"`) and named back in
`X-Tandem-Ignored-Fields` (nested ones by their path, `stream_options.x`); OpenAI fields tandem
does not serve are refused by name (`REFUSED`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    PrivateAttr,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine.protocol import (
    LOGIT_BIAS_RANGE,
    MAX_BAD_WORDS,
    MAX_CACHE_SALT,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_N,
    PENALTY_RANGE,
    REPETITION_PENALTY_MAX,
    SEED_RANGE,
    TEMPERATURE_MAX,
)
from router.openai_fields import MAX_REQUEST_ID, REFUSED, REQUEST_ID_PATTERN
from router.tools import tool_choice_constraint, validate_tools

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names


@dataclass(frozen=True, slots=True)
class Limits:
    """The served model, as validation sees it (the `context` of every validate call)."""

    served_model_name: str
    vocab_size: int
    max_model_len: int
    aliases: tuple[str, ...] = ()  # other names a request may use (the model's path)


def fail(predicate: str, code: str = "invalid_value", **ctx: Any) -> PydanticCustomError:
    """A validation error; `predicate` follows the field's path (`whole=True`: it is the whole
    message), `code` becomes the error body's code, `param` / `status` override."""
    return PydanticCustomError(code, "{predicate}", {"predicate": predicate, **ctx})


def _limits(info: ValidationInfo) -> Limits | None:
    return info.context if isinstance(info.context, Limits) else None


def vocab_of(info: ValidationInfo) -> int:
    limits = _limits(info)
    return limits.vocab_size if limits else 1 << 62


# ------------------------------------------------------------------ field types

_JSON_TYPES = {str: "<string>", list: "<array>", dict: "<object>", int: "<integer>"}


def one_of(what: str, **branches: Any) -> Any:
    """A union picked by the value's JSON type (string, array, object, integer), so an error
    names one branch; a value of another type `must be {what}`. Tags are `<type>`, which
    `api_error` leaves out of paths."""
    members = tuple(Annotated[t, Tag(f"<{k}>")] for k, t in branches.items())
    pick = Discriminator(
        lambda v: _JSON_TYPES.get(type(v)),
        custom_error_type="invalid_value",
        custom_error_message=f"must be {what}",
    )
    return Annotated[Union[members], pick]  # noqa: UP007 - a runtime tuple of members


def _token_id(value: int, info: ValidationInfo) -> int:
    vocab = vocab_of(info)
    if not 0 <= value < vocab:
        message = f"holds token id {value}, outside the vocabulary [0, {vocab})"
        raise fail(message, "invalid_token_id")
    return value


TokenId = Annotated[int, AfterValidator(_token_id), Field(json_schema_extra={"minimum": 0})]
Text = Annotated[str, Field(min_length=1)]
Count = Annotated[int, Field(ge=0)]


def _loads(value: Any, what: str | None = "is not valid JSON") -> Any:
    """JSON text -> its value; other values as they are (`what` None: non-JSON text too)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, huge ints, depth
        if what is None:
            return value
        raise fail(f"{what}: {e}") from e


def _schema_text(value: dict | str) -> str:
    """A JSON schema (an object, or its JSON text) -> its JSON text."""
    value = _loads(value)
    if not isinstance(value, dict | bool):
        raise fail("must be a JSON schema object")
    return json.dumps(value)


JsonSchemaText = Annotated[
    one_of("a JSON schema object or its JSON text", object=dict[str, Any], string=str),
    AfterValidator(_schema_text),
]


_DEFAULTS: dict[str, list[Any]] = {
    "spaces_between_special_tokens": [True, None],
    "use_beam_search": [False, None],
}


def refused(name: str) -> Any:
    """A field tandem refuses unless it is left at its default."""
    defaults = _DEFAULTS.get(name, [None, "", []])

    def check(value: Any) -> Any:
        if not any(value == d and type(value) is type(d) for d in defaults):
            raise fail(f"'{name}': {REFUSED[name]}", whole=True)
        return value

    why = f"refused with a 400 unless left at its default: {REFUSED[name]}"
    schema = {"enum": defaults, "deprecated": True, "description": why}
    return Annotated[Any, PlainValidator(check), WithJsonSchema(schema)]


def _served_model(value: str | None, info: ValidationInfo) -> str | None:
    limits = _limits(info)
    if limits is not None and value not in (None, limits.served_model_name, *limits.aliases):
        served = limits.served_model_name
        message = f"The model `{value}` does not exist; this server serves `{served}`."
        raise fail(message, "model_not_found", whole=True, status=404)
    return value


ModelName = Annotated[
    str | None,
    AfterValidator(_served_model),
    Field(description="the served model (GET /v1/models); another name is a 404"),
]


def flag(description: str) -> Any:
    return Field(None, description=description)


# ------------------------------------------------------------------ parts of requests


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Open(BaseModel):  # unknown keys are kept: passed on with the object, or named back
    model_config = ConfigDict(strict=True, extra="allow")


class TextPart(_Open):  # only text parts are supported
    type: Literal["text"]
    text: str


class CalledFunction(_Open):
    name: str
    arguments: Annotated[
        one_of("JSON text or an object", string=str, object=dict[str, Any]),
        AfterValidator(lambda v: _loads(v, None)),  # a call cut at max_tokens comes back cut
        Field(examples=['{"city": "Paris"}', {"city": "Paris"}]),
    ] = "{}"


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] | None = None
    function: CalledFunction


Content = one_of("a string or a list of text parts", string=str, array=list[TextPart])


class AudioRef(_Open):
    id: str


class ChatMessage(StrictModel):
    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: Content | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = Field(None, description="an assistant's refusal sent back: not used")
    audio: AudioRef | None = Field(None, description="an assistant's audio sent back: not used")
    annotations: list[dict[str, Any]] | None = Field(None, description="accepted, not used")
    function_call: CalledFunction | None = Field(None, description="legacy tool call: used")
    # A reasoning model's thinking sent back (vLLM's name, and DeepSeek's): to the template.
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it (tool-call arguments as objects)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        for name in ("name", "tool_call_id"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        thinking = self.reasoning if self.reasoning is not None else self.reasoning_content
        if thinking is not None:  # templates read either name (Qwen3's: reasoning_content)
            out["reasoning"] = out["reasoning_content"] = thinking
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_unset=True) for c in self.tool_calls]
        elif self.role == "assistant" and self.function_call is not None:  # pre-tools shape
            out["tool_calls"] = [{"type": "function", "function": self.function_call.model_dump()}]
        return out


class FunctionParameters(_Open):
    """A JSON schema of the arguments (an object schema)."""

    type: Literal["object"] = "object"


class FunctionDefinition(_Open):
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    parameters: FunctionParameters | None = None
    strict: bool | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = one_of(
    "a string or an object",
    string=Literal["none", "auto", "required"],
    object=NamedToolChoice,
)


class StreamOptions(_Open):
    include_usage: bool | None = flag("a last chunk with the usage")
    continuous_usage_stats: bool | None = flag("vLLM: with include_usage, usage on every chunk")


class JsonSchemaSpec(_Open):
    name: str | None = None
    schema_: JsonSchemaText = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _holds_its_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise fail("json_schema needs {'json_schema': {'name', 'schema'}}")
        return self

    def spec(self) -> tuple[str, str] | None:
        if self.type == "json_schema":
            return ("json_schema", self.json_schema.schema_)  # type: ignore[union-attr]
        return ("json_object", "") if self.type == "json_object" else None


_GUIDED_EXAMPLES = {
    "json": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
             '{"type": "string", "maxLength": 8}'],
    "regex": ["[a-z]{1,8}", "(yes|no)"], "choice": [["yes", "no"], ["a", "b"]],
    "grammar": ['start: "yes" | "no"'],
}  # fmt: skip
GuidedJson = Annotated[JsonSchemaText | None, Field(examples=_GUIDED_EXAMPLES["json"])]
GuidedRegex = Annotated[Text | None, Field(examples=_GUIDED_EXAMPLES["regex"])]
GuidedChoice = Annotated[
    Annotated[list[str], Field(min_length=1)] | None, Field(examples=_GUIDED_EXAMPLES["choice"])
]
GuidedGrammar = Annotated[Text | None, Field(examples=_GUIDED_EXAMPLES["grammar"])]


class StructuredOutputs(_Open):
    """vLLM's form of guided_*: when set, the top-level guided_* are not read."""

    json_: GuidedJson = Field(None, alias="json")
    regex: GuidedRegex = None
    choice: GuidedChoice = None
    grammar: GuidedGrammar = None
    json_object: bool | None = flag("true: any JSON object (as response_format json_object)")
    structural_tag: refused("structural_tag") = None


# ------------------------------------------------------------------ request bodies


def _bad_word(word: str) -> str:
    if not word.strip():  # vLLM tokenizes the word without its leading spaces
        raise fail("must hold a character other than white space")
    return word


MAX_BAD_WORD_TEXTS = MAX_BAD_WORDS // 2  # each text may become two token sequences
BadWord = Annotated[str, AfterValidator(_bad_word), Field(min_length=1)]
Temperature = Annotated[float, Field(ge=0, le=TEMPERATURE_MAX, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1], allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]


def _bias_key(key: str, info: ValidationInfo) -> str:
    if int(key) >= (vocab := vocab_of(info)):
        raise fail(f"logit_bias token id {key} is outside the vocabulary [0, {vocab})", whole=True)
    return key


LogitBias = Annotated[
    dict[Annotated[str, Field(pattern="^[0-9]+$"), AfterValidator(_bias_key)], Bias],
    Field(max_length=MAX_LOGIT_BIAS_ENTRIES),
]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


def requires(field: str, flag: str) -> dict:
    """JSON schema: `field` set (not null) only together with `flag: true`."""
    return {
        "if": {"required": [field], "properties": {field: {"not": {"type": "null"}}}},
        "then": {"required": [flag], "properties": {flag: {"const": True}}},
    }


class GenerationRequest(_Open):
    """The fields both generation routes take, and the rules across them."""

    model: ModelName = None
    spaces_between_special_tokens: refused("spaces_between_special_tokens") = None
    temperature: Temperature | None = flag("0 is greedy; default from generation_config.json")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = flag("nucleus sampling mass")
    n: Annotated[int, Field(ge=1, le=MAX_N)] = Field(1, description="choices per prompt")
    stream: bool | None = flag("answer as server-sent events ending in `data: [DONE]`")
    stream_options: StreamOptions | None = flag("only with stream: true")
    stop: one_of("a string or a list of strings", string=Text, array=list[Text]) | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = Field(None, examples=[{"15": 5.0, "42": -100}, {}])
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    user: Any = Field(None, description="OpenAI's end-user id: accepted, not used")
    NOT_USED: ClassVar[tuple[str, ...]] = ("user",)  # named back in X-Tandem-Ignored-Fields
    top_k: Annotated[int, Field(ge=-1)] | None = flag("-1 or 0: off")
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=REPETITION_PENALTY_MAX)] | None = None
    min_tokens: Count | None = flag("EOS and stop token ids are masked until this many tokens")
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    add_special_tokens: bool | None = None
    response_format: ResponseFormat | None = Field(
        None,
        examples=[
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
        ],
    )
    guided_json: GuidedJson = None
    guided_regex: GuidedRegex = None
    guided_choice: GuidedChoice = None
    guided_grammar: GuidedGrammar = None
    structured_outputs: StructuredOutputs | None = Field(
        None, examples=[{"choice": ["yes", "no"]}, {"regex": "[0-9]{2}"}]
    )
    prompt_logprobs: Logprobs | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = flag(
        "vLLM: only these tokens may be generated"
    )
    bad_words: Annotated[list[BadWord], Field(max_length=MAX_BAD_WORD_TEXTS)] | None = flag(
        "vLLM: words never generated (as the answer's own tokens, with and without a space)"
    )
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = flag(
        "vLLM: only the prompt's last k tokens are used; -1: as many as the context holds"
    )
    return_tokens_as_token_ids: bool | None = flag("vLLM: logprobs name tokens `token_id:<id>`")
    return_token_ids: bool | None = flag("vLLM: the prompt's and each answer's token ids too")
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT)] | None = flag(
        "vLLM: the prompt's cached blocks are shared only with requests of the same salt"
    )
    priority: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = flag(
        "vLLM: lower runs first, with --scheduling-policy priority (else only 0)"
    )
    request_id: (
        Annotated[str, Field(min_length=1, max_length=MAX_REQUEST_ID, pattern=REQUEST_ID_PATTERN)]
        | None
    ) = flag("vLLM: the answer's id is `<prefix>-<request_id>`; X-Request-Id wins")
    use_beam_search: refused("use_beam_search") = None
    logits_processors: refused("logits_processors") = None
    # (param, (kind, spec)): the one structured-output constraint, set by _across_fields.
    _structured: tuple[str, tuple[str, str]] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _across_fields(self, info: ValidationInfo) -> GenerationRequest:
        if self.stream_options is not None and not self.stream:
            message = "stream_options is only allowed when stream is true"
            raise fail(message, whole=True, param="stream_options")
        limits = _limits(info)
        if limits is not None and (self.min_tokens or 0) > limits.max_model_len:
            message = f"'min_tokens' must be an integer in [0, {limits.max_model_len}]"
            raise fail(message, whole=True, param="min_tokens")
        keep = self.truncate_prompt_tokens
        if keep == 0 or (limits is not None and (keep or 0) > limits.max_model_len):
            window = f", at most the context window ({limits.max_model_len})" if limits else ""
            message = f"'truncate_prompt_tokens' must be -1 or at least 1{window}, got {keep}"
            raise fail(message, whole=True, param="truncate_prompt_tokens")
        specs = self._structured_specs()
        if len(specs) > 1:
            names = [p for p, _ in specs]
            message = f"only one structured output constraint per request, got {names}"
            raise fail(message, whole=True, param=names[1])
        self._structured = specs[0] if specs else None
        return self

    def _structured_specs(self) -> list[tuple[str, tuple[str, str]]]:
        spec = self.response_format.spec() if self.response_format else None
        specs = [("response_format", spec)] if spec else []
        so = self.structured_outputs
        guided = (so.json_, so.regex, so.choice, so.grammar) if so else (
            self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar
        )  # fmt: skip
        for name, kind, value in zip(_GUIDED_EXAMPLES, _GUIDED_KINDS, guided, strict=True):
            if value is not None:
                param = "structured_outputs" if so else f"guided_{name}"
                specs.append((param, (kind, json.dumps(value) if kind == "choice" else value)))
        if so and so.json_object:
            specs.append(("structured_outputs", ("json_object", "")))
        return specs


_GUIDED_KINDS = ("json_schema", "regex", "choice", "grammar")


def _non_empty(messages: list[ChatMessage]) -> list[ChatMessage]:
    if not messages:
        raise fail("must not be empty", "empty_prompt")
    return messages


Messages = Annotated[
    list[ChatMessage], AfterValidator(_non_empty), Field(json_schema_extra={"minItems": 1})
]


def _template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    # A template from the request would run a client's Jinja in the router (vLLM refuses it
    # too unless told to trust request templates).
    if "chat_template" in kwargs or "tokenize" in kwargs:
        raise fail("may not set 'chat_template' or 'tokenize'")
    return kwargs


_WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
_BOTH = {"continue_final_message": {"const": True}, "add_generation_prompt": {"const": True}}


class ChatCompletionRequest(GenerationRequest):
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                requires("stream_options", "stream"),
                requires("top_logprobs", "logprobs"),
                {"not": {"required": list(_BOTH), "properties": _BOTH}},
            ]
        }
    )

    messages: Messages
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = flag("wins over max_tokens")
    logprobs: bool | None = flag("log-probabilities of the generated tokens")
    top_logprobs: Logprobs | None = flag("alternatives per token; needs logprobs")
    tools: list[Tool] | None = Field(None, examples=[[{"type": "function", "function": {
        "name": "get_weather", "parameters": _WEATHER}}]])  # fmt: skip
    tool_choice: ToolChoice | None = Field(None, examples=["none", "auto", None])
    parallel_tool_calls: bool | None = flag("false: at most one tool call (grammar and parser)")
    add_generation_prompt: bool | None = flag("end with the assistant turn's opening")
    continue_final_message: bool | None = flag("continue the last (assistant) message")
    echo: bool | None = flag("start the answer with the last assistant message's content")
    chat_template_kwargs: Annotated[dict[str, Any], AfterValidator(_template_kwargs)] | None = (
        Field(None, examples=[{}, {"enable_thinking": False}])
    )
    documents: list[dict[str, str]] | None = flag("vLLM: passed to the chat template (RAG)")
    chat_template: refused("chat_template") = None
    functions: refused("functions") = None
    function_call: refused("function_call") = None
    # The tools as plain dicts for the template, and the choice ("auto" when tools come alone).
    _tools: list[dict] | None = PrivateAttr(None)
    _tool_choice: Any = PrivateAttr(None)

    @model_validator(mode="after")
    def _chat_rules(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise fail("'top_logprobs' needs 'logprobs': true", whole=True, param="top_logprobs")
        self._check_tools()
        cont = bool(self.continue_final_message)
        if cont and self.add_generation_prompt:
            message = "continue_final_message and add_generation_prompt cannot both be true"
            raise fail(message, whole=True, param="continue_final_message")
        if cont and self.messages[-1].role != "assistant":
            message = "continue_final_message needs the last message to be the assistant's"
            raise fail(message, whole=True, param="continue_final_message")
        return self

    def _check_tools(self) -> None:
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none", "auto"):
                raise fail("'tool_choice' needs 'tools'", whole=True, param="tool_choice")
            return
        tools = [t.model_dump(exclude_unset=True) for t in self.tools]
        choice = "auto" if choice is None else choice
        choice = choice.model_dump() if isinstance(choice, BaseModel) else choice
        try:
            validate_tools(tools, choice)  # names unique, a named choice is one of them
            forced = tool_choice_constraint(tools, choice, self.parallel_tool_calls is not False)
        except ValueError as e:
            param = "tool_choice" if "tool_choice" in str(e) else "tools"
            raise fail(str(e), whole=True, param=param) from e
        if forced is not None and self._structured is not None:
            message = "a forced tool_choice cannot be combined with another structured output"
            raise fail(message + " constraint", whole=True, param="tool_choice")
        if forced is not None:
            self._structured = ("tools", forced)
        self._tools, self._tool_choice = tools, choice
