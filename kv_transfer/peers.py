"""Which peers an agent may exchange KV with: those whose KV layout matches its own (`Compat`)
and, given the registry's current name -> instance id map, only the incarnations it lists
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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kv_transfer.errors import (
    PeerNotAllowedError,
    StalePeerError,
    UnknownPeerError,
    describe_differences,
    differing_fields,
)
from kv_transfer.messages import PROTOCOL_VERSION


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
