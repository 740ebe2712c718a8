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

import numpy as np
import zmq

from engine.protocol import WireError, decode, encode
from kv_transfer.errors import HandshakeError, PeerNotAllowedError
from kv_transfer.messages import AgentMetadata, Hello, HelloReply
from kv_transfer.nixl import BlockRegion, NixlEndpoint
from kv_transfer.tp_layout import (
    BlockShape,
    HeadLayout,
    SlicePlan,
    Source,
    plan_reads,
    units_per_block,
)
from kv_transfer.tp_rank import agent_name

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


def peer_region(
    name: str, reply: HelloReply, local: BlockRegion, same_layout: bool = True
) -> BlockRegion:
    """The sender's region, carried by the reply under BlockRegion's own field names (its
    blocks must be ours in size when `same_layout`; otherwise `slice_plan` checked them)."""
    region = BlockRegion(**{k: getattr(reply, k) for k in BlockRegion.__dataclass_fields__})
    if same_layout and (region.block_bytes, region.scale_block_bytes) != (
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


def slice_plan(
    name: str, reply: HelloReply, spec, local: BlockRegion, rank: int = 0
) -> SlicePlan | None:
    """How reading rank `rank` of ours reads from a sender of another tensor-parallel layout
    (None: both TP 1, one row per block). `spec` is that rank's KVCacheSpec; the total heads,
    head size, dtype and block size already matched (compat fields). A layout whose blocks
    are not the size its head share implies is refused naming both layouts. Rank 0's READ
    from the sender's rank 0 goes last: it carries the completion notification."""
    if reply.tp_size == spec.tp_size == 1:
        return None
    src = HeadLayout(spec.total_kv_heads, reply.tp_size)
    dst = HeadLayout(spec.total_kv_heads, spec.tp_size)
    slices = sorted(plan_reads(src, dst, rank), key=lambda s: s.src_rank == 0)
    if rank == 0 and slices[-1].src_rank != 0:
        raise HandshakeError(name, f"rank 0 of {src.describe()} holds none of our heads")
    units = units_per_block(spec.num_layers, spec.block_size)
    entry = spec.block_bytes // (units * spec.num_kv_heads)
    shapes = [BlockShape(units, src.per_rank, entry), BlockShape(units, dst.per_rank, entry)]
    if spec.has_scales:
        shapes += [BlockShape(units, src.per_rank, 4), BlockShape(units, dst.per_rank, 4)]
    got = (reply.block_bytes, reply.scale_block_bytes)
    want = (shapes[0].block_bytes, shapes[2].block_bytes if spec.has_scales else 0)
    if got != want:
        raise HandshakeError(
            name,
            f"sender: {src.describe()}, blocks of {got[0]} bytes (+{got[1]} scales), where "
            f"that layout needs {want[0]} (+{want[1]}); here: {dst.describe()}, "
            f"{spec.head_layout()}",
            ("block_bytes",),
        )
    sources = {0: Source(name, reply.data_base, reply.scales_base, reply.device_id)}
    for r in reply.ranks:
        sources[r.rank] = Source(agent_name(name, r.rank), r.data_base, r.scales_base, r.device_id)
    me = Source("", local.data_base, local.scales_base, local.device_id)
    return SlicePlan(tuple(slices), sources, me, *shapes)


def peer_rank_metadata(reply: HelloReply, plan: SlicePlan) -> dict[str, bytes]:
    """NIXL metadata of the sender's other ranks this plan reads from, by agent name."""
    used = {s.src_rank for s in plan.slices} - {0}
    return {plan.sources[r.rank].name: r.nixl_metadata for r in reply.ranks if r.rank in used}


def open_peer(nixl: NixlEndpoint, name: str, reply: HelloReply, warmup: bool, timeout_s: float):
    """After an accepting reply: check the layouts, load the sender's NIXL metadata (and that
    of its other ranks we read from), prep its block list and warm each pair up. Returns
    (region, prepped list, SlicePlan or None, the rank agents loaded); undoes it all on a
    failure."""
    plan = slice_plan(name, reply, nixl.spec, nixl.region)
    region = peer_region(name, reply, nixl.region, plan is None)
    added, dlist, ranks = None, None, []
    try:
        added = nixl.add_peer(reply.nixl_metadata)
        if added != name:
            raise HandshakeError(name, f"its NIXL metadata names {added!r}")
        dlist = nixl.prep_peer(name, region)
        if warmup and plan is None:
            warm_up(nixl, name, dlist, timeout_s)
        for rank_name, metadata in (
            {} if plan is None else peer_rank_metadata(reply, plan)
        ).items():
            got = nixl.add_peer(metadata)
            ranks.append(got)
            if got != rank_name:
                raise HandshakeError(name, f"its rank's NIXL metadata names {got!r}")
        if warmup and plan is not None:  # blocks of another size: one row of each rank's
            for src in [plan.sources[0]] + [s for s in plan.sources.values() if s.name in ranks]:
                row = np.array([[src.data_base, plan.src.entry_bytes, src.device_id]], np.uint64)
                state = nixl.warm_up_rows(src.name, row, timeout_s)
                if state != "DONE":
                    raise HandshakeError(name, f"warm-up READ of {src.name} ended {state}")
    except BaseException:
        if added is not None:
            nixl.forget_peer(added, dlist)
        for rank_name in ranks:
            nixl.forget_peer(rank_name, None)
        raise
    return region, dlist, plan, ranks
