"""The KV memory of a tensor-parallel sender's other ranks: each registers its own cache with its
own NIXL agent, so a reader can READ the heads that rank holds.

Rank 0's `KVTransferAgent(..., tp_group=engine.tp)` calls `rank_regions`, which runs
`rank_hook` on ranks 1..N-1 through `engine.distributed.TPGroup.run_hook` (JSON over the
group's broadcast and store, no pickle). Each rank answers with its agent's NIXL metadata and
base addresses; rank 0 puts them in its `HelloReply` (`messages.RankRegion`). Leases, the side
channel and every decision stay with rank 0: the other ranks' memory only has to be
registered and readable. A small thread per rank takes NIXL notifications, which progresses
UCX for transports that need the target to (TCP); on shared memory a READ needs no help.
The rank's agent lives as long as its process (it dies with its group).
"""

from __future__ import annotations

import base64
import threading
import time

from kv_transfer.messages import RankRegion

PROGRESS_S = 0.005
_ENDPOINTS: dict[str, object] = {}  # this rank process's agents, kept alive


def agent_name(name: str, rank: int) -> str:
    """Rank `rank`'s NIXL agent name: unique per rank, derived from rank 0's."""
    return name if rank == 0 else f"{name}.tp{rank}"


def endpoint(name: str, rank: int):
    """This rank process's NixlEndpoint for rank 0's agent `name` (registered by `rank_hook`)."""
    nixl = _ENDPOINTS.get(agent_name(name, rank))
    if nixl is None:
        raise ValueError(f"rank {rank} has no NIXL agent for {name!r}: not registered")
    return nixl


def rank_hook(cache, rank: int, arg: dict) -> dict:
    """On rank `rank`: register `cache` with a NIXL agent of its own; answer what a reader
    needs (JSON-able)."""
    from kv_transfer.nixl import NixlEndpoint

    name = agent_name(str(arg["name"]), rank)
    old = _ENDPOINTS.pop(name, None)
    if old is not None:
        old.close()
    nixl = NixlEndpoint(name, cache, bool(arg.get("progress_thread", False)))
    _ENDPOINTS[name] = nixl
    threading.Thread(target=_progress, args=(nixl, name), daemon=True).start()
    r = nixl.region
    return {
        "rank": rank,
        "nixl_metadata": base64.b64encode(nixl.metadata).decode(),
        "data_base": r.data_base,
        "scales_base": r.scales_base,
        "device_id": r.device_id,
    }


def _progress(nixl, name: str) -> None:
    while _ENDPOINTS.get(name) is nixl:
        nixl.take_notifs(wait=True)
        time.sleep(PROGRESS_S)


def rank_regions(tp_group, name: str, progress_thread: bool = False) -> list[RankRegion]:
    """Ranks 1..N-1 of `tp_group` (engine.distributed.TPGroup) registered for transfer."""
    answers = tp_group.run_hook(
        "kv_transfer.tp_rank", {"name": name, "progress_thread": progress_thread}
    )
    return [
        RankRegion(
            rank=a["rank"],
            nixl_metadata=base64.b64decode(a["nixl_metadata"]),
            data_base=a["data_base"],
            scales_base=a["scales_base"],
            device_id=a["device_id"],
        )
        for a in answers
    ]
