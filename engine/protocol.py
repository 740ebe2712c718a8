"""The frames between the router and the workers, and the codec every tandem socket speaks.

Two parts, the codec first (the frame types are built on it):

1. The codec: typed, versioned msgpack frames for every socket in tandem, msgspec Structs,
   never pickle. A message type is a `Frame` (a msgspec Struct: slots, unknown fields refused)
   registered under a short tag with `@message("tag")`. Its annotations are its schema: types
   (strict: a bool is never an int, a str never a number), bounds and lengths
   (`Annotated[int, Meta(ge=0)]`), nested Frames. Rules across fields are the class's `check()`.
   A frame is the msgpack map `{"v": WIRE_VERSION, "t": tag, "d": <the Struct as a map>}`.

   Decoding a frame (`decode`): (1) its size, before a byte is unpacked; (2) the envelope, with
   exactly the keys v, t, d (`d` left packed); the version; the tag; `expect`; (3) `d`, by the
   tag's cached typed Decoder: types and constraints at every depth, and each Struct's
   `check()` as it is built. Whatever is wrong is a `WireError`, never another exception type.

   A value is checked once per process. Built in Python, `Frame.__post_init__` validates it
   against the same annotations (`msgspec.convert`, which also makes declared tuples tuples)
   and runs `check()`; decoded, the decoder did the first part and `__post_init__` only runs
   `check()`. Other modules' frames (engine/kv_events.py, kv_transfer/messages.py, ...) are
   `Frame`s registered here too.

2. The router <-> worker messages. Request path: the router sends `PrefillRequest` to a
   prefill worker (disaggregated) or `GenerateRequest` to a decode worker (local prefill).
   Every worker streams `TokenMessage`s to the router's `reply_to` endpoint; each carries the
   request id and the output index of its first token so the router can merge the first token
   (from prefill) with the rest (from decode). A `TokenMessage` is also what the engine's step
   returns (`engine.outputs.TokenOutput` is this class): the engine server fills in the worker
   fields and sends that same record. `AbortRequest` goes to whichever worker may hold the
   request. The KV hand-off messages between prefill and decode workers live in `kv_transfer`.

   `SamplingParams` (per-request sampling settings) and every bound on them are defined here
   too (the router imports these). Lifecycle: the router builds one from an OpenAI request
   (checked once, in `__post_init__`), it travels inside a request frame (`_Request.sampling`)
   and the worker's decoder checks it against the same field annotations (the codec above:
   checked once there too, not again after decoding); the sampler then trusts it. Defaults are
   the identity: a request that sets nothing pays for no logits processing (engine/sampler.py's
   logits processors only touch rows with `needs_processing`).

No torch here: the router imports this module.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

# --- The codec: Frame, @message, encode/decode, trusted, size limits -------------------------

WIRE_VERSION = 2  # 2: msgspec Structs (typed fields); 1 was dataclasses checked by hand
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024

T = TypeVar("T")
_REGISTRY: dict[str, type[Frame]] = {}
_TAGS: dict[type, str] = {}
_DECODERS: dict[type, msgspec.msgpack.Decoder] = {}
_ENCODER = msgspec.msgpack.Encoder()
# Set while msgspec builds Structs whose fields it has validated (decode, and the convert in
# `Frame.__post_init__`), so their `__post_init__` does not validate them again.
_decoding = threading.local()


class WireError(ValueError):
    """A frame that cannot be accepted: too large, not msgpack, unknown type, bad fields."""


class Frame(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Base of every wire message and of the Structs nested in them (SamplingParams).

    Fields left at their defaults are not sent (`omit_defaults`): a field added with a default
    (a new request setting) leaves the frames that do not use it readable by a peer that
    predates it, so a rolling upgrade keeps serving; a frame that uses it is refused there as
    an unknown field, by name."""

    def __post_init__(self) -> None:
        if getattr(_decoding, "on", False):
            self.check()
            return
        _decoding.on = True
        try:  # the copy is built (and `check`ed) by msgspec from our fields, as if decoded
            checked = msgspec.convert(msgspec.structs.asdict(self), type(self))
        except msgspec.ValidationError as e:
            raise ValueError(f"{type(self).__name__}: {e}") from None
        finally:
            _decoding.on = False
        for name in self.__struct_fields__:
            msgspec.structs.force_setattr(self, name, getattr(checked, name))

    def check(self) -> None:
        """Rules across fields (raise ValueError); the fields themselves are already valid."""


def trusted(cls: type[T], *args: Any, **kwargs: Any) -> T:
    """`cls(*args, **kwargs)` with only its `check()`: for records a process builds from values
    it made itself and holds as valid (the engine's per-token `TokenMessage`s, a hot path: the
    full check costs ~15x the construction). Never for values from a client or a socket."""
    was = getattr(_decoding, "on", False)
    _decoding.on = True
    try:
        return cls(*args, **kwargs)
    finally:
        _decoding.on = was


class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    v: int
    t: str
    d: msgspec.Raw


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)


def message(tag: str):
    """Register a Frame subclass as a wire message under `tag`."""

    def wrap(cls: type[T]) -> type[T]:
        if not issubclass(cls, Frame):
            raise TypeError(f"{cls.__name__} must be an engine.protocol.Frame")
        if tag in _REGISTRY and _REGISTRY[tag] is not cls:
            raise TypeError(f"wire tag {tag!r} already used by {_REGISTRY[tag].__name__}")
        _REGISTRY[tag] = cls
        _TAGS[cls] = tag
        return cls

    return wrap


def encode(msg: Any, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    tag = _TAGS.get(type(msg))
    if tag is None:
        raise TypeError(f"{type(msg).__name__} is not a registered wire message")
    frame = _ENCODER.encode({"v": WIRE_VERSION, "t": tag, "d": msg})
    if len(frame) > max_bytes:
        raise WireError(f"{type(msg).__name__} frame is {len(frame)} bytes, over {max_bytes}")
    return frame


def decode(frame: bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES, expect: type | None = None):
    """Decode one frame; raise WireError on anything malformed or unexpected."""
    if len(frame) > max_bytes:
        raise WireError(f"frame of {len(frame)} bytes is over the {max_bytes}-byte limit")
    was = getattr(_decoding, "on", False)
    _decoding.on = True
    try:
        outer = _ENVELOPE.decode(frame)
        if outer.v != WIRE_VERSION:
            raise WireError(f"wire version {outer.v} is not supported (this is {WIRE_VERSION})")
        cls = _REGISTRY.get(outer.t)
        if cls is None:
            raise WireError(f"unknown message type {outer.t!r:.80}")
        if expect is not None and not issubclass(cls, expect):
            raise WireError(f"expected {expect.__name__}, got {cls.__name__}")
        decoder = _DECODERS.get(cls)
        if decoder is None:
            decoder = _DECODERS[cls] = msgspec.msgpack.Decoder(cls)
        return decoder.decode(outer.d)
    except WireError:
        raise
    except Exception as e:  # noqa: BLE001 - msgspec's errors, RecursionError (deep nesting), ...
        raise WireError(f"malformed frame: {e}"[:500]) from e
    finally:
        _decoding.on = was


# --- The router <-> worker frames and SamplingParams (built on the codec above) ------------

MAX_N = 128  # choices per request
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs (completions' logprobs is 5; vLLM allows 20)
TEMPERATURE_MAX = 1e6
TOP_K_DISABLED = -1
REPETITION_PENALTY_MAX = 1e6  # (0, max]: 1 is off
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS_ENTRIES = 300
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_IDS = 1 << 20  # token or block ids in one message: a 1M-token prompt fits
# bad_words_token_ids: at most this many words of at most this many tokens each. The sampler
# compares every word with the output's tail in Python at every step of the request, so the caps
# bound that work (and the frame: 256k ids at most); a longer list is a job for allowed_token_ids.
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_TOKENS = 256
SCHEDULING_POLICIES = ("fcfs", "priority")  # an engine's queue order (engine/scheduler.py)
MAX_CACHE_SALT = 1024  # characters; vLLM suggests 43 (256 random bits in base64)

TokenId = Annotated[int, Meta(ge=0, lt=2**31)]
Penalty = Annotated[float, Meta(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])]
LogprobCount = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
LogitBias = tuple[TokenId, Annotated[float, Meta(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]]
BadWord = Annotated[tuple[TokenId, ...], Meta(min_length=1, max_length=MAX_BAD_WORD_TOKENS)]


class SamplingParams(Frame, frozen=True):
    max_tokens: Annotated[int, Meta(ge=1)] = 16
    temperature: Annotated[float, Meta(ge=0.0, le=TEMPERATURE_MAX)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=TOP_K_DISABLED)] = TOP_K_DISABLED  # 0 is refused in check()
    seed: Annotated[int, Meta(ge=SEED_RANGE[0])] | None = None  # the top: check() (over int64)
    stop_token_ids: tuple[TokenId, ...] = ()
    ignore_eos: bool = False
    # Choices sampled from one prompt: the prompt is computed once and its KV blocks shared.
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    # Top log-probabilities returned per sampled token (0: the sampled token's only); None off.
    logprobs: LogprobCount | None = None
    # The same for every prompt position (echo / log-likelihood); None off.
    prompt_logprobs: LogprobCount | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0  # EOS and stop_token_ids masked until this many
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=REPETITION_PENALTY_MAX)] = 1.0
    # (token id, bias added to its logit) pairs; a pair list, since msgpack maps need str keys.
    logit_bias: Annotated[tuple[LogitBias, ...], Meta(max_length=MAX_LOGIT_BIAS_ENTRIES)] = ()
    # Only these tokens can be sampled (every other logit -inf); () allows all (vLLM v1).
    allowed_token_ids: Annotated[tuple[TokenId, ...], Meta(max_length=MAX_IDS)] = ()
    # Token-id sequences never to generate: a word's last token is masked whenever the output
    # (not the prompt) ends with the rest of it (vLLM v1). Caps: MAX_BAD_WORDS words of
    # 1..MAX_BAD_WORD_TOKENS tokens.
    bad_words_token_ids: Annotated[tuple[BadWord, ...], Meta(max_length=MAX_BAD_WORDS)] = ()
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    # (kind, spec): ("json_schema", schema JSON text), ("json_object", ""), ("regex", pattern),
    # ("choice", JSON list of strings), ("grammar", Lark grammar). See engine/structured/.
    structured: tuple[Literal[STRUCTURED_KINDS], str] | None = None
    # vLLM's cache_salt: the request's prefix-cache blocks hash apart from other salts' (the
    # block hash, engine/kv_events.py). Not a sampling setting, but it must reach every engine
    # that hashes this request's blocks (prefill, decode after the hand-off, a prefix pull), and
    # this is the per-request record every one of those frames carries.
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    # vLLM's priority (lower runs first) under the priority scheduling policy; like cache_salt,
    # a request setting every engine that queues the request reads (engine/scheduler.py).
    priority: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] = 0

    def check(self) -> None:
        if self.top_k == 0:
            raise ValueError(f"top_k must be {TOP_K_DISABLED} (disabled) or >= 1, got 0")
        if self.seed is not None and self.seed > SEED_RANGE[1]:
            raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")

    @property
    def greedy(self) -> bool:
        # As vLLM: a temperature this small is greedy (dividing logits by 1e-300 overflows).
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def needs_processing(self) -> bool:
        """Whether any logits processor changes this request's logits (engine hot path)."""
        return bool(
            self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.allowed_token_ids
            or self.bad_words_token_ids
        )


Name = Annotated[str, Meta(min_length=1, max_length=256)]  # request and worker ids
RequestId = Name
Endpoint = Annotated[str, Meta(min_length=1, max_length=256, pattern="://")]  # a ZMQ endpoint
TokenIds = Annotated[list[TokenId], Meta(max_length=MAX_IDS)]
PromptIds = Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_IDS)]
Count = Annotated[int, Meta(ge=0)]
# (logprob, rank (1: the most likely), [(token id, logprob), ...top]): engine.sampler's entry.
TopLogprobs = Annotated[list[tuple[TokenId, float]], Meta(max_length=MAX_LOGPROBS)]
LogprobEntry = tuple[float, Annotated[int, Meta(ge=1)], TopLogprobs]


class _Request(Frame):
    """Fields every request to a worker carries."""

    request_id: RequestId
    prompt_token_ids: PromptIds
    sampling: SamplingParams
    reply_to: Endpoint  # ZMQ endpoint of the router's token sink


class PrefixSource(Frame):
    """Another worker whose prefix cache holds the prompt's first `tokens` tokens (whole
    blocks), as the router's KV index saw it: the prefill worker may READ them from there
    instead of computing them (kv_transfer/prefix_pull.py)."""

    worker_id: Name
    endpoint: Endpoint  # its request socket, where a PrefixPull goes
    tokens: Annotated[int, Meta(ge=1, le=MAX_IDS)]


@message("generate")
class GenerateRequest(_Request):
    """Whole request for one worker: prefill and decode both run there (local prefill)."""

    prefix_from: PrefixSource | None = None  # a decode worker of a split pool only


@message("prefill")
class PrefillRequest(_Request):
    """Prefill on a prefill worker, then hand the KV to `decode_worker_id`."""

    decode_worker_id: Name
    decode_endpoint: Endpoint  # where the prefill worker sends the KV hand-off
    prefix_from: PrefixSource | None = None


@message("tokens")
class TokenMessage(Frame):
    """New tokens of one choice of one request from one engine step.

    `index` is the position in the output of `token_ids[0]`; the router reorders by it because
    the first token (from prefill) and the rest (from decode) arrive on different sockets.
    `logprobs` (when asked) holds one entry per token; `prompt_logprobs` comes with the first
    token (index 0) of choice 0 when asked (its first entry is None: nothing predicts it).
    """

    # The engine fills these (positionally, in this order), the engine server the rest.
    request_id: RequestId
    index: Count
    token_ids: TokenIds
    finish_reason: Literal["stop", "length", "abort", "error"] | None = None
    choice: Count = 0  # which of the request's n choices
    logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: list[LogprobEntry | None] | None = None
    num_cached_tokens: Count = 0  # prefix-cache hits at admission
    error: str | None = None
    worker_id: str = ""
    prefill_worker_id: str = ""  # set on the first token: where the prefill ran
    # From a decode worker, no tokens: "I took this request over from its prefill worker"
    # (its KV hand-off is queued here; a lost prefill worker is now this worker's business).
    handoff: bool = False

    def check(self) -> None:
        if self.handoff and (self.token_ids or self.finish_reason is not None):
            raise ValueError("a handoff message carries no tokens and no finish_reason")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError("logprobs must hold one entry per token")


@message("abort")
class AbortRequest(Frame):
    request_id: RequestId
    reason: str = "client disconnected"


@message("shutdown")
class Shutdown(Frame):
    reason: str = ""


@dataclass(slots=True)
class WorkerLoad:
    """A worker's load as the router's policies see it (reported through the controller)."""

    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int
    extra: dict = field(default_factory=dict)
