"""Typed errors of the transfer layer (a refused handshake, a peer outside the registry's allowed
set, a failed transfer), the compatibility field comparison their messages are built from, and
the quiet cleanup step."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class KVTransferError(Exception):
    """Base class of every error this package raises on purpose."""


class HandshakeError(KVTransferError):
    """Two agents cannot exchange KV: the peer is unreachable or its layout differs.

    `fields` names the compatibility fields that differ (empty when the peer did not answer),
    so the message says what to change: "block_size: 16 here, 32 on peer".
    """

    def __init__(self, peer: str, message: str, fields: tuple[str, ...] = ()):
        self.peer = peer
        self.fields = tuple(fields)
        super().__init__(f"handshake with {peer!r} refused: {message}")


class PeerNotAllowedError(HandshakeError):
    """A peer outside the registry's allowed set (`KVTransferAgent.set_allowed_peers`): KV is
    never exchanged with it. Not a misconfiguration like a layout mismatch: the peer is gone or
    not yet known, so a worker may recompute. The message names the peer and its instance and
    nothing about any request, so it can be logged or returned as is."""

    def __init__(self, peer: str, instance_id: str, message: str, fields: tuple[str, ...]):
        self.instance_id = instance_id
        self.reason = message  # without the "handshake ... refused" prefix: for a HelloReply
        super().__init__(peer, message, fields)


class UnknownPeerError(PeerNotAllowedError):
    """The peer's name is not in the allowed set."""

    def __init__(self, peer: str, instance_id: str, message: str):
        super().__init__(peer, instance_id, message, ("name",))


class StalePeerError(PeerNotAllowedError):
    """The peer's name is allowed but under another instance: this one is an old incarnation
    (a restarted worker keeps its name and gets a new instance id)."""

    def __init__(self, peer: str, instance_id: str, message: str):
        super().__init__(peer, instance_id, message, ("instance_id",))


class TransferError(KVTransferError):
    """A request's KV transfer cannot be started or has failed."""

    def __init__(self, request_id: str, message: str):
        self.request_id = request_id
        self.message = message
        super().__init__(f"KV transfer of request {request_id!r} failed: {message}")


def differing_fields(mine: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """Names of the compatibility fields whose values differ (or exist on one side only)."""
    return sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))


def describe_differences(fields: list[str], mine: dict[str, str], theirs: dict[str, str]) -> str:
    return "; ".join(
        f"{k}: {mine.get(k, '<missing>')} here, {theirs.get(k, '<missing>')} on peer"
        for k in fields
    )


def quietly(step: Callable[[], Any]) -> None:
    """Run one cleanup step (closing, releasing): a failure is logged at debug level and the
    cleanup goes on, since one stuck resource must not leak all the others."""
    try:
        step()
    except Exception as e:  # noqa: BLE001 - NIXL and ZMQ raise their own error classes
        log.debug("cleanup step failed: %s", e)
