"""Messages of the KV hand-off and of the agents' side channel (msgpack via `engine.wire`).

Hand-off (prefill worker -> decode worker, on the workers' own ZMQ sockets): `KVReady`.

Side channel (receiver's DEALER -> sender's ROUTER, one connection per agent pair):

    receiver                         sender
    Hello  ------------------------>         check protocol version + compat fields
           <------------------------ HelloReply (NIXL metadata, region bases) or refusal
    Renew{seq, rids} -------------->         pin + extend each lease (also a heartbeat)
           <------------------------ RenewReply{seq, statuses, remaining_s}
    Abort{rid} -------------------->         receiver will not read rid: free it
           <------------------------ Abort{rid}   sender gave rid up: stop reading
    anything malformed ------------>
           <------------------------ ErrorReply{message}   (the agent keeps serving)

The NIXL notification that ends a READ carries `ReadComplete{rid}`, encoded the same way.
Every frame is size-limited and every field validated in `__post_init__`, so a bad frame
becomes `engine.wire.WireError`, never a crash or a half-built object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.wire import message

PROTOCOL_VERSION = 1
MAX_SIDE_FRAME_BYTES = 1 << 20  # side-channel frames (Hello carries ~0.5-4 KB of NIXL metadata)
MAX_NOTIF_BYTES = 1024
MAX_KVREADY_BYTES = 32 << 20  # a 1M-token prompt plus its block ids fits
MAX_IDS = 1 << 20  # block ids or prompt tokens in one message
MAX_RIDS_PER_RENEW = 4096
RENEW_STATUSES = ("ok", "done", "expired", "aborted", "unknown")


def _check_str(name: str, value: object, max_len: int = 256, empty: bool = False) -> None:
    if not isinstance(value, str) or len(value) > max_len or (not empty and not value):
        raise ValueError(
            f"{name} must be a {'' if empty else 'non-empty '}string of at most "
            f"{max_len} chars, got {value!r:.80}"
        )


def _check_int(name: str, value: object, lo: int = 0, hi: int = 1 << 62) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {value!r:.80}")


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r:.80}")


def _check_ids(name: str, ids: object, unique: bool = False) -> None:
    if not isinstance(ids, list) or len(ids) > MAX_IDS:
        raise ValueError(f"{name} must be a list of at most {MAX_IDS} ints")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 or t >= 1 << 31 for t in ids):
        raise ValueError(f"{name} must hold non-negative ints below 2**31")
    if unique and len(set(ids)) != len(ids):
        raise ValueError(f"{name} must not repeat a block id")


def _check_compat(fields: object) -> None:
    if not isinstance(fields, dict) or len(fields) > 64:
        raise ValueError("compat_fields must be a map of at most 64 entries")
    for k, v in fields.items():
        _check_str("compat field name", k, 64)
        _check_str(f"compat field {k}", v, 256, empty=True)


def _check_choices(choices: object, first_token: int, sampling: SamplingParams) -> None:
    if choices is None:
        return
    if not isinstance(choices, list) or not 1 <= len(choices) <= sampling.n:
        raise ValueError(f"choices must be a list of 1..{sampling.n} [choice, token] pairs")
    for pair in choices:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise ValueError("choices entries must be [choice, first token]")
        _check_int("choice", pair[0], 0, sampling.n - 1)
        _check_int("first token", pair[1], 0, 1 << 31)
    if len({c for c, _ in choices}) != len(choices) or choices[0][1] != first_token:
        raise ValueError("choices must not repeat a choice and must start with first_token's")


@message("kvx.agent")
@dataclass(slots=True)
class AgentMetadata:
    """What a peer needs to reach an agent: published in the registry and inside `KVReady`."""

    name: str
    instance_id: str  # fresh per agent object: a restarted worker with the same name differs
    endpoint: str  # the side channel, tcp://host:port
    protocol_version: int
    compat_hash: str
    compat_fields: dict[str, str]
    num_blocks: int
    mem_type: str  # "DRAM" | "VRAM"

    def __post_init__(self) -> None:
        _check_str("name", self.name)
        _check_str("instance_id", self.instance_id, 64)
        _check_str("endpoint", self.endpoint)
        if not self.endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError(f"endpoint must be tcp:// or ipc://, got {self.endpoint!r}")
        _check_int("protocol_version", self.protocol_version, 0, 1 << 16)
        _check_str("compat_hash", self.compat_hash, 128)
        _check_compat(self.compat_fields)
        _check_int("num_blocks", self.num_blocks, 1, 1 << 31)
        if self.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"mem_type must be DRAM or VRAM, got {self.mem_type!r}")

    @classmethod
    def coerce(cls, md: AgentMetadata | dict) -> AgentMetadata:
        """Accept the dict form (from the registry) and validate it like a decoded frame."""
        if isinstance(md, cls):
            return md
        if not isinstance(md, dict):
            raise TypeError(f"agent metadata must be a map, got {type(md).__name__}")
        unknown = set(md) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"agent metadata has unknown fields {sorted(unknown)}")
        return cls(**md)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@message("kvx.kv_ready")
@dataclass(slots=True)
class KVReady:
    """Prefill worker -> decode worker: the prompt's KV sits in `block_ids` on `sender`, held
    until `lease_deadline` (unix seconds); the first token has already gone to `reply_to`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    first_token: int
    reply_to: str
    prefill_worker_id: str
    sender: AgentMetadata
    block_ids: list[int]
    num_tokens: int  # tokens whose KV the blocks hold
    lease_deadline: float
    # n > 1: [choice, first token] of every choice still running (the first is first_token's).
    choices: list | None = None

    def __post_init__(self) -> None:
        _check_str("request_id", self.request_id)
        _check_ids("prompt_token_ids", self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError("sampling must be SamplingParams")
        _check_int("first_token", self.first_token, 0, 1 << 31)
        _check_str("reply_to", self.reply_to)
        _check_str("prefill_worker_id", self.prefill_worker_id)
        if not isinstance(self.sender, AgentMetadata):
            raise TypeError("sender must be AgentMetadata")
        _check_ids("block_ids", self.block_ids, unique=True)
        _check_int("num_tokens", self.num_tokens, 1, len(self.prompt_token_ids) + 1)
        block_size = int(self.sender.compat_fields.get("block_size", "0") or 0)
        if block_size > 0 and len(self.block_ids) != -(-self.num_tokens // block_size):
            raise ValueError(
                f"{len(self.block_ids)} block ids cannot hold exactly {self.num_tokens} tokens "
                f"in blocks of {block_size}"
            )
        if any(b >= self.sender.num_blocks for b in self.block_ids):
            raise ValueError(f"block_ids must be below the sender's {self.sender.num_blocks}")
        _check_float("lease_deadline", self.lease_deadline)
        _check_choices(self.choices, self.first_token, self.sampling)


@message("kvx.hello")
@dataclass(slots=True)
class Hello:
    protocol_version: int
    name: str
    instance_id: str
    compat_hash: str
    compat_fields: dict[str, str]
    endpoint: str = ""

    def __post_init__(self) -> None:
        _check_int("protocol_version", self.protocol_version, 0, 1 << 16)
        _check_str("name", self.name)
        _check_str("instance_id", self.instance_id, 64)
        _check_str("compat_hash", self.compat_hash, 128)
        _check_compat(self.compat_fields)
        _check_str("endpoint", self.endpoint, empty=True)


@message("kvx.hello_reply")
@dataclass(slots=True)
class HelloReply:
    """The sender's answer: a refusal naming the differing fields, or what a READ needs."""

    ok: bool
    name: str
    instance_id: str
    error: str = ""
    differing_fields: list[str] = field(default_factory=list)
    nixl_metadata: bytes = b""
    mem_type: str = "DRAM"
    device_id: int = 0
    num_blocks: int = 0
    data_base: int = 0  # address of block 0; block i starts at data_base + i * block_bytes
    block_bytes: int = 0
    scales_base: int = 0  # FP8 KV: address of block 0's scales
    scale_block_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.ok, bool):
            raise TypeError("ok must be a bool")
        _check_str("name", self.name)
        _check_str("instance_id", self.instance_id, 64)
        _check_str("error", self.error, 4096, empty=True)
        if not isinstance(self.differing_fields, list) or len(self.differing_fields) > 64:
            raise ValueError("differing_fields must be a list of at most 64 names")
        for f in self.differing_fields:
            _check_str("differing field", f, 64)
        if not isinstance(self.nixl_metadata, bytes) or len(self.nixl_metadata) > 512 * 1024:
            raise ValueError("nixl_metadata must be bytes of at most 512 KiB")
        if self.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"mem_type must be DRAM or VRAM, got {self.mem_type!r}")
        for name in (
            "device_id",
            "num_blocks",
            "data_base",
            "block_bytes",
            "scales_base",
            "scale_block_bytes",
        ):
            _check_int(name, getattr(self, name), 0, 1 << 64)
        if self.ok and (
            not self.nixl_metadata
            or self.num_blocks < 1
            or self.block_bytes < 1
            or self.data_base == 0
        ):
            raise ValueError("an accepting HelloReply needs metadata, blocks and a base address")


@message("kvx.renew")
@dataclass(slots=True)
class Renew:
    """Pin and extend the leases of `request_ids` (may be empty: a pure heartbeat)."""

    seq: int
    request_ids: list[str]

    def __post_init__(self) -> None:
        _check_int("seq", self.seq)
        if not isinstance(self.request_ids, list) or len(self.request_ids) > MAX_RIDS_PER_RENEW:
            raise ValueError(f"request_ids must be a list of at most {MAX_RIDS_PER_RENEW}")
        for rid in self.request_ids:
            _check_str("request_id", rid)


@message("kvx.renew_reply")
@dataclass(slots=True)
class RenewReply:
    """Per request: "ok" (held, for `remaining_s` more), "done" (already read and released),
    "expired", "aborted" or "unknown". Parallel lists keep the frame flat."""

    seq: int
    request_ids: list[str]
    statuses: list[str]
    remaining_s: list[float]

    def __post_init__(self) -> None:
        _check_int("seq", self.seq)
        n = len(self.request_ids) if isinstance(self.request_ids, list) else -1
        if (
            not (0 <= n <= MAX_RIDS_PER_RENEW)
            or not isinstance(self.statuses, list)
            or not (isinstance(self.remaining_s, list))
            or len(self.statuses) != n
            or len(self.remaining_s) != n
        ):
            raise ValueError("request_ids, statuses and remaining_s must be lists of equal length")
        for rid, st, rem in zip(self.request_ids, self.statuses, self.remaining_s, strict=True):
            _check_str("request_id", rid)
            if st not in RENEW_STATUSES:
                raise ValueError(f"status must be one of {RENEW_STATUSES}, got {st!r:.40}")
            _check_float("remaining_s", rem)


@message("kvx.abort")
@dataclass(slots=True)
class Abort:
    request_id: str
    reason: str = ""

    def __post_init__(self) -> None:
        _check_str("request_id", self.request_id)
        _check_str("reason", self.reason, 1024, empty=True)


@message("kvx.error")
@dataclass(slots=True)
class ErrorReply:
    message: str

    def __post_init__(self) -> None:
        _check_str("message", self.message, 4096, empty=True)


@message("kvx.read_complete")
@dataclass(slots=True)
class ReadComplete:
    """Payload of the NIXL notification sent when a request's last READ lands."""

    request_id: str

    def __post_init__(self) -> None:
        _check_str("request_id", self.request_id)
