"""Routing policies: which decode worker, which prefill worker, local or remote prefill.

Pure functions over a `LoadView` (the router's mutable copy of the workers' load reports), so
they can be unit tested without sockets.

- Decode choice: prefer workers that have free KV blocks for the prompt, then the lowest cost
  `kv_usage + (running + 2 * waiting) / batch_norm` (waiting requests weigh double: they are
  queued because the worker is out of blocks or batch slots).
- Prefill choice: least queued prefill tokens, with prefix affinity: the first
  `prefix_tokens` prompt tokens pick a preferred worker by rendezvous hashing (stable while
  the pool changes), and that worker wins while its queue is within `slack_tokens` of the
  least loaded one, so requests sharing a system prompt land where it is cached.
- Disaggregation: prompts shorter than `disagg_threshold`, or any prompt when there are no
  prefill workers (colocated mode), are prefilled on the decode worker itself.

After a dispatch, `LoadView.note_dispatch` bumps the chosen workers' counters optimistically;
the next directory snapshot replaces the view.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from engine.roles import DECODING_ROLES, PREFILL
from router.directory import WorkerInfo

LOCAL = "local"
REMOTE = "remote"


@dataclass(slots=True)
class WorkerState:
    """Mutable load numbers of one worker (copied from its WorkerLoad)."""

    info: WorkerInfo
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    block_size: int

    @classmethod
    def from_info(cls, info: WorkerInfo, default_block_size: int) -> WorkerState:
        load = info.load
        block_size = (
            load.extra.get("block_size", default_block_size) if load.extra else (default_block_size)
        )
        if not isinstance(block_size, int) or block_size < 1:
            block_size = default_block_size
        return cls(
            info=info,
            free_blocks=max(0, int(load.num_free_blocks)),
            total_blocks=max(0, int(load.num_total_blocks)),
            running=max(0, int(load.num_running)),
            waiting=max(0, int(load.num_waiting)),
            queued_prefill_tokens=max(0, int(load.queued_prefill_tokens)),
            block_size=block_size,
        )

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass(slots=True)
class RoutePlan:
    """Where one request goes: `prefill` is None on the local path."""

    path: str  # LOCAL | REMOTE
    decode: WorkerInfo
    prefill: WorkerInfo | None = None


class NoWorkersError(RuntimeError):
    """No decode-capable worker is registered (the router answers 503)."""


class LoadView:
    """The router's current picture of the pool; replaced on every directory snapshot."""

    def __init__(self, workers: list[WorkerInfo], default_block_size: int = 16) -> None:
        self.states = {w.worker_id: WorkerState.from_info(w, default_block_size) for w in workers}

    @property
    def decode_workers(self) -> list[WorkerState]:
        return [s for s in self.states.values() if s.info.role in DECODING_ROLES]

    @property
    def prefill_workers(self) -> list[WorkerState]:
        return [s for s in self.states.values() if s.info.role == PREFILL]

    def note_dispatch(self, plan: RoutePlan, prompt_len: int) -> None:
        dec = self.states.get(plan.decode.worker_id)
        if dec is not None:
            dec.free_blocks = max(0, dec.free_blocks - dec.blocks_for(prompt_len))
            dec.running += 1
            if plan.path == LOCAL:
                dec.queued_prefill_tokens += prompt_len
        if plan.prefill is not None and (pre := self.states.get(plan.prefill.worker_id)):
            pre.queued_prefill_tokens += prompt_len
            pre.waiting += 1


def decode_cost(state: WorkerState, prompt_len: int, batch_norm: int) -> tuple[bool, float, str]:
    """Sort key (lower is better): no room for the prompt last, then usage + batch pressure."""
    no_room = state.free_blocks < state.blocks_for(prompt_len)
    usage = 1.0 - state.free_blocks / state.total_blocks if state.total_blocks > 0 else 1.0
    pressure = (state.running + 2 * state.waiting) / batch_norm
    return (no_room, usage + pressure, state.worker_id)


def choose_decode(
    candidates: list[WorkerState], prompt_len: int, batch_norm: int = 32
) -> WorkerState:
    if not candidates:
        raise NoWorkersError("no decode workers are available")
    return min(candidates, key=lambda s: decode_cost(s, prompt_len, batch_norm))


def prefix_key(prompt_ids: list[int], prefix_tokens: int) -> bytes | None:
    """Hash of the first `prefix_tokens` ids; None for prompts too short to share a prefix."""
    if len(prompt_ids) < prefix_tokens:
        return None
    packed = struct.pack(f"<{prefix_tokens}I", *prompt_ids[:prefix_tokens])
    return hashlib.blake2b(packed, digest_size=16).digest()


def _rendezvous_score(key: bytes, worker_id: str) -> bytes:
    return hashlib.blake2b(key + worker_id.encode(), digest_size=8).digest()


def choose_prefill(
    candidates: list[WorkerState],
    prompt_ids: list[int],
    prefix_tokens: int = 64,
    slack_tokens: int = 2048,
) -> WorkerState:
    if not candidates:
        raise NoWorkersError("no prefill workers are available")

    def load(s: WorkerState) -> tuple[int, int, str]:
        return (s.queued_prefill_tokens, s.waiting, s.worker_id)

    least = min(candidates, key=load)
    key = prefix_key(prompt_ids, prefix_tokens)
    if key is None:
        return least
    preferred = max(candidates, key=lambda s: _rendezvous_score(key, s.worker_id))
    if preferred.queued_prefill_tokens <= least.queued_prefill_tokens + slack_tokens:
        return preferred
    return least


def decide_path(prompt_len: int, disagg_threshold: int, num_prefill_workers: int) -> str:
    if num_prefill_workers == 0 or prompt_len < disagg_threshold:
        return LOCAL
    return REMOTE


def plan_route(
    view: LoadView,
    prompt_ids: list[int],
    *,
    disagg_threshold: int,
    prefix_tokens: int = 64,
    slack_tokens: int = 2048,
    batch_norm: int = 32,
) -> RoutePlan:
    """Pick the decode worker, then decide local vs remote prefill and pick the prefill worker."""
    decode = choose_decode(view.decode_workers, len(prompt_ids), batch_norm)
    prefills = view.prefill_workers
    path = decide_path(len(prompt_ids), disagg_threshold, len(prefills))
    if path == LOCAL:
        return RoutePlan(LOCAL, decode.info)
    prefill = choose_prefill(prefills, prompt_ids, prefix_tokens, slack_tokens)
    return RoutePlan(REMOTE, decode.info, prefill.info)
