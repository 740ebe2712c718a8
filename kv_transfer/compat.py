"""Whether two agents' KV layouts match: the check both ends of a handshake run.

The receiver checks the sender's registry metadata before dialing (`connect`), and the sender
checks the `Hello` again before answering, so a refused pair never exchanges NIXL metadata.
Both name the same fields in the same words ("block_size: 32 here, 16 on peer"), seen from the
side that reads the message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_transfer.errors import describe_differences, differing_fields
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
