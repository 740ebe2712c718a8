"""The vocabulary of the KV hand-off: what the parties say to each other on the wire (the
messages, and the checks of who may exchange them), then what the agent tells its worker loop
(each request's transfer state, the events `poll()` hands over, the counters).

Wire messages (msgpack via the codec in `engine.protocol`). Hand-off (prefill worker -> decode
worker, on the workers' own ZMQ sockets): `KVReady`. Side channel (receiver's DEALER -> sender's
ROUTER, one connection per agent pair):

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
Every frame is size-limited and every message an `engine.protocol.Frame`: its fields' types
and bounds are declared on them (and rules across fields in `check()`), so a bad frame becomes
`engine.protocol.WireError`, never a crash or a half-built object.

Peers: an agent exchanges KV only with those whose KV layout matches its own (`Compat`) and,
given the registry's current name -> instance id map, only the incarnations it lists
(`PeerPolicy`). Both ends of a handshake run both checks.

Layouts: the receiver checks the sender's registry metadata before dialing (`connect`), and the
sender checks the `Hello` again before answering, so a refused pair never exchanges NIXL
metadata. Both name the same fields in the same words ("block_size: 32 here, 16 on peer"), seen
from the side that reads the message.

Allowed map lifecycle: `KVTransferAgent.set_allowed_peers(map)` builds one immutable
`PeerPolicy` and hands it to the receiver and the sender parts; each swaps it in under its own
lock and drops what the new map no longer allows (so the check and the drop are atomic for the
side-channel thread). `PeerPolicy()` (no map) allows any peer: the default, for standalone use
and benchmarks.

Allowed-map rules, the same on both ends of a handshake:

- allowed: the peer's name maps to exactly its instance id;
- unknown: its name is not in the map (`UnknownPeerError`);
- stale: its name maps to another instance id, so it is an old incarnation (a restarted worker
  keeps its name and gets a new agent instance id; `StalePeerError`);
- replaced: the map names a newer instance for a name than the one that pinned a lease. Ray
  restarts an actor only after its process died, so no READ of the old instance can still land
  and the sender may free what it pinned at once.

The agent's reports (never on the wire). Sender side: `Released` -> the worker frees those
blocks. Receiver side: `ReadDone` -> the sequence joins the batch; `ReadFailed` -> the worker
frees its blocks and fails or recomputes. An event is emitted only once nothing can touch the
blocks any more (no READ in flight). A request's transfer state (`TransferState`,
`TransferStatus`) is an ordered enum that only moves forward:

    PENDING -> TRANSFERRING -> DONE
       \\            \\
        +------------+--> FAILED (sticky, carries the reason)

The order FAILED < PENDING < TRANSFERRING < DONE lets callers compare states ("at least
TRANSFERRING") the way SGLang's KVPoll does; FAILED sorts lowest because a failed transfer has
achieved the least. DONE and FAILED are terminal.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Annotated, Literal

from msgspec import Meta
from msgspec.structs import asdict

from engine.protocol import (
    MAX_CACHE_SALT,
    MAX_IDS,
    MAX_N,
    Count,
    Endpoint,
    Frame,
    Name,
    PromptIds,
    RequestId,
    SamplingParams,
    TokenId,
    message,
)
from kv_transfer.errors import (
    PeerNotAllowedError,
    StalePeerError,
    UnknownPeerError,
    describe_differences,
    differing_fields,
)

# --- The wire: the hand-off and side-channel messages, and the checks of who may send them --------

PROTOCOL_VERSION = 1
MAX_SIDE_FRAME_BYTES = 1 << 20  # side-channel frames (Hello carries ~0.5-4 KB of NIXL metadata)
MAX_NOTIF_BYTES = 1024
MAX_KVREADY_BYTES = 32 << 20  # a 1M-token prompt plus its block ids fits
MAX_RIDS_PER_RENEW = 4096
RENEW_STATUSES = ("ok", "done", "expired", "aborted", "unknown")

Version = Annotated[int, Meta(ge=0, le=1 << 16)]
Short = Annotated[str, Meta(min_length=1, max_length=64)]  # instance ids, compat field names
Hash = Annotated[str, Meta(min_length=1, max_length=128)]
CompatFields = Annotated[dict[Short, Annotated[str, Meta(max_length=256)]], Meta(max_length=64)]
MemType = Literal["DRAM", "VRAM"]
Message = Annotated[str, Meta(max_length=4096)]
Seq = Annotated[int, Meta(ge=0, le=1 << 62)]
Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]  # no inf, NaN
RequestIds = Annotated[list[RequestId], Meta(max_length=MAX_RIDS_PER_RENEW)]
Choices = Annotated[list[tuple[Count, TokenId]], Meta(min_length=1, max_length=MAX_N)]


@message("kvx.agent")
class AgentMetadata(Frame):
    """What a peer needs to reach an agent: published in the registry and inside `KVReady`."""

    name: Name
    instance_id: Short  # fresh per agent object: a restarted worker with the same name differs
    endpoint: Annotated[str, Meta(max_length=256, pattern="^(tcp|ipc)://")]  # the side channel
    protocol_version: Version
    compat_hash: Hash
    compat_fields: CompatFields
    num_blocks: Annotated[int, Meta(ge=1, le=1 << 31)]
    mem_type: MemType

    @classmethod
    def coerce(cls, md: AgentMetadata | dict) -> AgentMetadata:
        """Accept the dict form (from the registry) and validate it like a decoded frame."""
        if isinstance(md, cls):
            return md
        if not isinstance(md, dict):
            raise TypeError(f"agent metadata must be a map, got {type(md).__name__}")
        unknown = set(md) - set(cls.__struct_fields__)
        if unknown:
            raise ValueError(f"agent metadata has unknown fields {sorted(map(repr, unknown))}")
        return cls(**md)

    def to_dict(self) -> dict:
        return asdict(self)


@message("kvx.kv_ready")
class KVReady(Frame):
    """Prefill worker -> decode worker: the prompt's KV sits in `block_ids` on `sender`, held
    until `lease_deadline` (unix seconds); the first token has already gone to `reply_to`."""

    request_id: RequestId
    prompt_token_ids: PromptIds
    sampling: SamplingParams
    first_token: TokenId
    reply_to: Endpoint
    prefill_worker_id: Name
    sender: AgentMetadata
    block_ids: Annotated[list[TokenId], Meta(max_length=MAX_IDS)]
    num_tokens: Annotated[int, Meta(ge=1)]  # tokens whose KV the blocks hold
    lease_deadline: Finite
    # n > 1: [choice, first token] of every choice still running (the first is first_token's).
    choices: Choices | None = None

    def check(self) -> None:
        if self.num_tokens > len(self.prompt_token_ids) + 1:
            raise ValueError(f"num_tokens {self.num_tokens} is over the prompt's length + 1")
        if len(set(self.block_ids)) != len(self.block_ids):
            raise ValueError("block_ids must not repeat a block id")
        block_size = int(self.sender.compat_fields.get("block_size", "0") or 0)
        if block_size > 0 and len(self.block_ids) != -(-self.num_tokens // block_size):
            raise ValueError(
                f"{len(self.block_ids)} block ids cannot hold exactly {self.num_tokens} tokens "
                f"in blocks of {block_size}"
            )
        if self.block_ids and max(self.block_ids) >= self.sender.num_blocks:
            raise ValueError(f"block_ids must be below the sender's {self.sender.num_blocks}")
        if self.choices is not None:
            chosen = [c for c, _ in self.choices]
            if len(chosen) > self.sampling.n or max(chosen) >= self.sampling.n:
                raise ValueError(f"choices must be at most {self.sampling.n}, each below it")
            if len(set(chosen)) != len(chosen) or self.choices[0][1] != self.first_token:
                raise ValueError("choices must not repeat one and must start with first_token's")


@message("kvx.prefix_pull")
class PrefixPull(Frame):
    """Prefill worker -> a worker whose prefix cache holds leading blocks of a prompt it is
    about to compute: hold your cached blocks from block `first_block` of `prompt_token_ids`
    (whole blocks only) for agent `reader` to READ; answer with a `PrefixOffer` at
    `reply_to`. `cache_salt`: the reader's request's (engine/kv_events.py); the holder pins
    only blocks cached under it, so a pull never serves one tenant another's prefix."""

    pull_id: RequestId
    prompt_token_ids: PromptIds
    first_block: Count
    reader: Name
    reply_to: Endpoint
    # Last and optional: a frame from a peer that predates salts decodes as unsalted.
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT)] | None = None


@message("kvx.prefix_offer")
class PrefixOffer(Frame):
    """The answer to a `PrefixPull`: blocks `block_ids` (prompt blocks `first_block`.. in
    order, possibly fewer than asked) held on `sender` until `lease_deadline`; or no blocks
    and `error` saying why."""

    pull_id: RequestId
    sender: AgentMetadata
    block_ids: Annotated[list[TokenId], Meta(max_length=MAX_IDS)] = []
    lease_deadline: Finite = 0.0
    error: Message = ""

    def check(self) -> None:
        if len(set(self.block_ids)) != len(self.block_ids):
            raise ValueError("block_ids must not repeat a block id")
        if self.block_ids and max(self.block_ids) >= self.sender.num_blocks:
            raise ValueError(f"block_ids must be below the sender's {self.sender.num_blocks}")


@message("kvx.hello")
class Hello(Frame):
    protocol_version: Version
    name: Name
    instance_id: Short
    compat_hash: Hash
    compat_fields: CompatFields
    endpoint: Annotated[str, Meta(max_length=256)] = ""


MAX_TP = 64


class RankRegion(Frame):
    """Another rank of a tensor-parallel sender: its own NIXL agent and KV memory (the same
    block ids as rank 0, its own heads: `tp_layout.HeadLayout` says which)."""

    rank: Annotated[int, Meta(ge=1, lt=MAX_TP)]
    nixl_metadata: Annotated[bytes, Meta(min_length=1, max_length=512 * 1024)]
    data_base: Annotated[int, Meta(ge=1)]
    scales_base: Count = 0
    device_id: Count = 0


@message("kvx.hello_reply")
class HelloReply(Frame):
    """The sender's answer: a refusal naming the differing fields, or what a READ needs."""

    ok: bool
    name: Name
    instance_id: Short
    error: Message = ""
    differing_fields: Annotated[list[Short], Meta(max_length=64)] = []
    nixl_metadata: Annotated[bytes, Meta(max_length=512 * 1024)] = b""
    mem_type: MemType = "DRAM"
    device_id: Count = 0
    num_blocks: Count = 0
    data_base: Count = 0  # address of block 0; block i starts at data_base + i * block_bytes
    block_bytes: Count = 0
    scales_base: Count = 0  # FP8 KV: address of block 0's scales
    scale_block_bytes: Count = 0
    # Tensor parallelism: the sender is rank 0 of `tp_size` ranks; `ranks` are the others.
    tp_size: Annotated[int, Meta(ge=1, le=MAX_TP)] = 1
    ranks: Annotated[list[RankRegion], Meta(max_length=MAX_TP - 1)] = []

    def check(self) -> None:
        ready = self.nixl_metadata and self.num_blocks and self.block_bytes and self.data_base
        if self.ok and not ready:
            raise ValueError("an accepting HelloReply needs metadata, blocks and a base address")
        if [r.rank for r in self.ranks] != list(range(1, self.tp_size)) and self.ok:
            raise ValueError(f"a tp {self.tp_size} sender must list ranks 1..{self.tp_size - 1}")


@message("kvx.renew")
class Renew(Frame):
    """Pin and extend the leases of `request_ids` (may be empty: a pure heartbeat)."""

    seq: Seq
    request_ids: RequestIds


@message("kvx.renew_reply")
class RenewReply(Frame):
    """Per request: "ok" (held, for `remaining_s` more), "done" (already read and released),
    "expired", "aborted" or "unknown". Parallel lists keep the frame flat."""

    seq: Seq
    request_ids: RequestIds
    statuses: list[Literal[RENEW_STATUSES]]
    remaining_s: list[Finite]

    def check(self) -> None:
        if not len(self.request_ids) == len(self.statuses) == len(self.remaining_s):
            raise ValueError("request_ids, statuses and remaining_s must be of equal length")


@message("kvx.abort")
class Abort(Frame):
    request_id: RequestId
    reason: Annotated[str, Meta(max_length=1024)] = ""


@message("kvx.error")
class ErrorReply(Frame):
    message: Message


@message("kvx.read_complete")
class ReadComplete(Frame):
    """Payload of the NIXL notification sent when a request's last READ lands."""

    request_id: RequestId


@dataclass(slots=True, frozen=True)
class Compat:
    """This agent's protocol version, `KVCacheSpec.compat_fields()` and their hash."""

    fields: dict[str, str] = field(default_factory=dict)
    hash: str = ""

    def mismatch(
        self, version: int, chash: str, fields: dict[str, str], *, for_peer: bool = False
    ) -> tuple[list[str], str]:
        """The fields that differ from a peer's, and a message naming both values.

        `for_peer`: the message goes back to the peer, so "here" means the peer's value.
        """
        diff = differing_fields(self.fields, fields)
        if version != PROTOCOL_VERSION:
            diff.insert(0, "protocol_version")
        if not diff and chash != self.hash:
            diff = ["compat_hash"]
        if not diff:
            return [], ""
        mine = {**self.fields, "protocol_version": str(PROTOCOL_VERSION), "compat_hash": self.hash}
        theirs = {**fields, "protocol_version": str(version), "compat_hash": chash}
        here, there = (theirs, mine) if for_peer else (mine, theirs)
        return diff, describe_differences(diff, here, there)


MAX_ALLOWED_PEERS = 100_000


@dataclass(slots=True, frozen=True)
class PeerPolicy:
    """An immutable allow-list: name -> instance id, or None for "any peer"."""

    allowed: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if self.allowed is None:
            return
        if not isinstance(self.allowed, Mapping) or len(self.allowed) > MAX_ALLOWED_PEERS:
            raise TypeError(
                f"allowed peers must be a map of at most {MAX_ALLOWED_PEERS} name -> instance id"
            )
        for name, instance in self.allowed.items():
            if not isinstance(name, str) or not name or len(name) > 256:
                raise ValueError(f"allowed peer name must be a non-empty string, got {name!r:.80}")
            if not isinstance(instance, str) or not instance or len(instance) > 64:
                raise ValueError(
                    f"instance id of allowed peer {name!r} must be a non-empty string of at "
                    f"most 64 chars, got {instance!r:.80}"
                )
        # A private copy: the caller's dict may change later, from another thread.
        object.__setattr__(self, "allowed", MappingProxyType(dict(self.allowed)))

    def refusal(self, owner: str, name: str, instance_id: str) -> PeerNotAllowedError | None:
        """Why `owner` must not exchange KV with (name, instance_id), or None if it may."""
        if self.allowed is None:
            return None
        current = self.allowed.get(name)
        if current == instance_id:
            return None
        if current is None:
            return UnknownPeerError(
                name,
                instance_id,
                f"{name!r} (instance {instance_id}) is not an allowed peer of {owner!r}: "
                "the registry does not list it",
            )
        return StalePeerError(
            name,
            instance_id,
            f"instance {instance_id} of {name!r} is an old incarnation (the registry has "
            f"instance {current}); {owner!r} exchanges no KV with it",
        )

    def replaced(self, name: str, instance_id: str) -> bool:
        """Whether the map names another, newer instance for `name` (its old one is dead)."""
        if self.allowed is None:
            return False
        current = self.allowed.get(name)
        return current is not None and current != instance_id

    def allows(self, name: str, instance_id: str) -> bool:
        return self.allowed is None or self.allowed.get(name) == instance_id


# --- The agent's reports to its worker loop: transfer state, poll()'s events, counters ------------


class TransferState(enum.IntEnum):
    FAILED = 0
    PENDING = 1
    TRANSFERRING = 2
    DONE = 3

    @property
    def terminal(self) -> bool:
        return self in (TransferState.FAILED, TransferState.DONE)


class InvalidTransition(ValueError):
    """A state change that would move a transfer backwards or out of a terminal state."""


@dataclass(slots=True)
class TransferStatus:
    state: TransferState = TransferState.PENDING
    reason: str | None = None  # set once, when the state becomes FAILED

    def __post_init__(self) -> None:
        self.state = TransferState(self.state)
        if self.state is TransferState.FAILED and not self.reason:
            raise ValueError("a FAILED status needs a reason")

    def advance(self, new: TransferState) -> None:
        """Move forward to `new` (PENDING -> TRANSFERRING -> DONE); use fail() for FAILED."""
        new = TransferState(new)
        if new is TransferState.FAILED:
            raise InvalidTransition("use fail(reason) to mark a transfer FAILED")
        if self.state.terminal or new <= self.state:
            raise InvalidTransition(f"cannot move from {self.state.name} to {new.name}")
        self.state = new

    def fail(self, reason: str) -> bool:
        """Mark FAILED with `reason`; returns False (and keeps the first reason) if already FAILED.

        A DONE transfer cannot fail: its blocks are already the receiver's.
        """
        if not reason:
            raise ValueError("a failure needs a reason")
        if self.state is TransferState.FAILED:
            return False
        if self.state is TransferState.DONE:
            raise InvalidTransition(f"cannot fail a DONE transfer ({reason})")
        self.state = TransferState.FAILED
        self.reason = reason
        return True


# peer_restarted: the reader that pinned the lease was replaced by a new incarnation of the
# same name (its process is dead, so no READ of it can land): freed at once, not at expiry.
RELEASE_REASONS = ("read_done", "lease_expired", "aborted", "peer_failed", "peer_restarted")


@dataclass(slots=True, frozen=True)
class Released:
    request_id: str
    block_ids: tuple[int, ...]
    reason: str  # one of RELEASE_REASONS

    def __post_init__(self) -> None:
        if self.reason not in RELEASE_REASONS:
            raise ValueError(f"reason must be one of {RELEASE_REASONS}, got {self.reason!r}")


@dataclass(slots=True, frozen=True)
class ReadDone:
    request_id: str
    local_block_ids: tuple[int, ...]
    num_bytes: int
    seconds: float  # from the start to the last byte landed
    # From the start to the sender's lease confirmation: the blocks are usable only after
    # both, so a confirmation later than `seconds` is the side channel's share of the wait.
    confirmed_s: float = 0.0


@dataclass(slots=True, frozen=True)
class ReadFailed:
    request_id: str
    local_block_ids: tuple[int, ...]
    reason: str


TransferEvent = Released | ReadDone | ReadFailed


@dataclass(slots=True)
class TransferStats:
    """Plain counters for /metrics (tandem_kv_transfer_*)."""

    bytes_read: int = 0  # receiver: bytes pulled by completed READs (data + FP8 scales)
    seconds: float = 0.0  # receiver: wall time of those READs, first post to landing
    transfers: int = 0  # receiver: requests that reached DONE
    failures: int = 0  # both: requests that ended FAILED / released because a peer failed
    expired_leases: int = 0  # sender: leases that ran out
    aborted: int = 0  # both: requests aborted by either side
    bytes_served: int = 0  # sender: bytes of blocks released after a completed READ
    serve_seconds: float = 0.0  # sender: reader's first renew (else the hold) to READ completion
    rejected_frames: int = 0  # side-channel frames refused as malformed / oversized
    ignored_notifs: int = 0  # late or unknown NIXL notifications that were dropped
    handshakes: int = 0
    refused_peers: int = 0  # both: handshakes refused because the peer is not allowed
    restarted_leases: int = 0  # sender: pinned leases freed at once, their reader restarted

    @property
    def gbps(self) -> float:
        """Achieved receive bandwidth in GB/s (1e9 bytes) over all completed READs."""
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __add__(self, other: TransferStats) -> TransferStats:
        """The counters of two parts of one agent (sender, receiver, side channel) summed."""
        return TransferStats(
            **{k: getattr(self, k) + getattr(other, k) for k in self.__dataclass_fields__}
        )

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["gbps"] = self.gbps
        return d
