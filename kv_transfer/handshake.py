"""The receiver's half of the handshake on the wire: one Hello out, one HelloReply back.

Lifecycle (inside `Receiver.connect`, after the registry metadata passed the allowed-peers and
compatibility checks): dial the sender's ROUTER with a fresh DEALER, send our `Hello`, wait up
to handshake_timeout_s for one `HelloReply`, and turn every way it can go wrong into a
`HandshakeError`: no answer, a malformed frame, a refusal (a layout mismatch naming the fields,
or `PeerNotAllowedError` when the sender's allowed map does not list us), or an answer from
another agent or instance than the registry named. The caller owns and closes the socket.
Then `peer_region` reads the sender's block region from the reply and `warm_up` pays UCX's
connection setup with a 1-block READ, both raising `HandshakeError` as well.
"""

from __future__ import annotations

from typing import Any

import zmq

from engine.wire import WireError, decode, encode
from kv_transfer.errors import HandshakeError, PeerNotAllowedError
from kv_transfer.messages import AgentMetadata, Hello, HelloReply
from kv_transfer.nixl import BlockRegion, NixlEndpoint

# differing_fields of a sender's refusal by its allowed map (see messages.PeerPolicy): no
# compatibility field is called that.
NOT_ALLOWED_FIELDS = (["name"], ["instance_id"])


def exchange_hello(
    sock: zmq.Socket, hello: Hello, md: AgentMetadata, timeout_s: float, max_frame_bytes: int
) -> HelloReply:
    """Send `hello` to the sender `md` on `sock`; return its accepting reply or raise."""
    sock.connect(md.endpoint)
    sock.send(encode(hello))
    if not sock.poll(int(timeout_s * 1000)):
        raise HandshakeError(md.name, f"no answer from {md.endpoint} within {timeout_s}s")
    try:
        reply = decode(sock.recv(), max_frame_bytes, expect=HelloReply)
    except WireError as e:
        raise HandshakeError(md.name, f"malformed reply: {e}") from e
    if not reply.ok:
        if reply.differing_fields in NOT_ALLOWED_FIELDS:
            raise PeerNotAllowedError(
                md.name, md.instance_id, reply.error, tuple(reply.differing_fields)
            )
        raise HandshakeError(md.name, reply.error, tuple(reply.differing_fields))
    if reply.name != md.name or reply.instance_id != md.instance_id:
        raise HandshakeError(
            md.name, f"{md.endpoint} is now {reply.name!r} (instance {reply.instance_id})"
        )
    return reply


def peer_region(name: str, reply: HelloReply, local: BlockRegion) -> BlockRegion:
    """The sender's region, carried by the reply under BlockRegion's own field names."""
    region = BlockRegion(**{k: getattr(reply, k) for k in BlockRegion.__dataclass_fields__})
    if (region.block_bytes, region.scale_block_bytes) != (
        local.block_bytes,
        local.scale_block_bytes,
    ):
        raise HandshakeError(name, "block byte sizes differ", ("block_bytes",))
    return region


def warm_up(nixl: NixlEndpoint, name: str, dlist: Any, timeout_s: float) -> None:
    """A 1-block READ of the new peer's block 0 into scratch (UCX's ~0.4 s wire-up now)."""
    try:
        state = nixl.warm_up(dlist, timeout_s)
    except Exception as e:  # NIXL raises its own error classes
        raise HandshakeError(name, f"warm-up READ failed: {e}") from e
    if state != "DONE":
        raise HandshakeError(name, f"warm-up READ ended {state}")
