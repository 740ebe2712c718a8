"""The router's global KV index: block hash -> {worker: tier}, mirrored from the workers' KV
events (engine/kv_events.py). Pure state, no sockets: `router/kv_listener.py` feeds it.

Per worker it keeps the incarnation and the sequence number of the last batch applied. A batch
is applied only in order (`seq` = last + 1); anything else asks for a resync (`apply` returns
True): a gap (batches lost, or a heartbeat whose seq is past ours), an unknown incarnation (a
restarted worker, or a router that started after the worker), a worker never synced. While a
resync is in flight its batches are buffered (bounded), and replayed after the snapshot from
the snapshot's seq on. A worker that leaves the directory is `forget`-ten. The index holds at
most `max_entries` (hash, worker) pairs: past that, new ones are not indexed (routing then sees
fewer hits, never wrong ones) and `num_overflow` counts them.

Scoring (`hit_tokens`): the leading prompt blocks a worker holds, in any tier, each weighted by
its tier (`TIER_WEIGHT`: a host block must be copied back before use). A block held in both
tiers (promoted back, its host copy kept) counts once, at the faster tier; when one copy
leaves, the other is what the worker holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.kv_events import KVEventBatch, KVSnapshot, lookup_blocks, prefix_block_hashes

TIER_WEIGHT = {"device": 1.0, "host": 0.5}
MAX_BUFFERED_BATCHES = 256
EXPECT_TTL_S = 5.0  # how long a routed prompt's blocks count as held before its events
MAX_EXPECTED = 1 << 16  # expected blocks per worker (beyond: the oldest are dropped)


@dataclass(slots=True)
class _Worker:
    incarnation: str = ""
    seq: int = -1
    block_size: int = 0
    synced: bool = False
    held: dict[int, str] = field(default_factory=dict)  # hash -> fastest tier holding it
    both: set[int] = field(default_factory=set)  # hashes held in both tiers
    buffered: list[KVEventBatch] = field(default_factory=list)
    expected: dict[int, float] = field(default_factory=dict)  # hash -> expiry (`expect`)


class KVIndex:
    def __init__(self, max_entries: int = 1 << 22) -> None:
        self.max_entries = max_entries
        self._blocks: dict[int, dict[str, str]] = {}
        self._workers: dict[str, _Worker] = {}
        self.num_entries = 0
        self.num_overflow = 0
        self.num_events = 0
        self.clock = time.monotonic

    # -- feeding ---------------------------------------------------------------------------
    def apply(self, batch: KVEventBatch) -> bool:
        """Apply one batch; True when the worker must be resynced (the batch was buffered)."""
        w = self._workers.setdefault(batch.worker_id, _Worker())
        self.num_events += len(batch.events)
        if not w.synced or batch.incarnation != w.incarnation:
            self._buffer(w, batch)
            return True
        if batch.seq <= w.seq:
            return False  # a heartbeat, or a batch the snapshot already holds
        if batch.seq == w.seq + 1 and batch.events:
            self._apply_events(batch.worker_id, w, batch)
            return False
        w.synced = False  # a gap: lost batches
        self._buffer(w, batch)
        return True

    def _buffer(self, w: _Worker, batch: KVEventBatch) -> None:
        if len(w.buffered) >= MAX_BUFFERED_BATCHES:
            w.buffered.clear()  # the snapshot will cover them; replay starts after it
        w.buffered.append(batch)

    def load_snapshot(self, snap: KVSnapshot) -> bool:
        """Replace a worker's entries by its snapshot, then replay the batches buffered since;
        True when a gap remains among them (resync again)."""
        self._drop_entries(snap.worker_id)
        w = self._workers.setdefault(snap.worker_id, _Worker())
        w.incarnation, w.seq, w.block_size, w.synced = (
            snap.incarnation,
            snap.seq,
            snap.block_size,
            True,
        )
        for tier, hashes in snap.tiers.items():
            for h in hashes:
                self._add(snap.worker_id, w, h, tier)
        buffered, w.buffered = w.buffered, []
        for batch in sorted(buffered, key=lambda b: b.seq):
            if batch.incarnation != w.incarnation or batch.seq <= w.seq:
                continue
            if batch.seq != w.seq + 1:
                w.synced = False
                return True
            self._apply_events(snap.worker_id, w, batch)
        return False

    def forget(self, worker_id: str) -> None:
        self._drop_entries(worker_id)
        self._workers.pop(worker_id, None)

    def _apply_events(self, wid: str, w: _Worker, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if ev.kind == "stored":
                self._add(wid, w, ev.block_hash, ev.tier)
            else:
                self._remove(wid, w, ev.block_hash, ev.tier)
        w.seq = batch.seq

    def _add(self, wid: str, w: _Worker, h: int, tier: str) -> None:
        w.expected.pop(h, None)
        if h in w.held:
            if tier != w.held[h]:  # held in the other tier too: the faster one counts
                w.both.add(h)
                if TIER_WEIGHT[tier] > TIER_WEIGHT[w.held[h]]:
                    w.held[h] = self._blocks[h][wid] = tier
            return
        if self.num_entries >= self.max_entries:
            self.num_overflow += 1
            return
        w.held[h] = tier
        self._blocks.setdefault(h, {})[wid] = tier
        self.num_entries += 1

    def _remove(self, wid: str, w: _Worker, h: int, tier: str) -> None:
        w.expected.pop(h, None)
        if h in w.both:  # one of two copies left: the other tier is what remains
            w.both.discard(h)
            if w.held[h] == tier:
                (other,) = (t for t in TIER_WEIGHT if t != tier)
                w.held[h] = self._blocks[h][wid] = other
            return
        if w.held.get(h) != tier:
            return  # not indexed (overflow)
        del w.held[h]
        holders = self._blocks[h]
        del holders[wid]
        if not holders:
            del self._blocks[h]
        self.num_entries -= 1

    def _drop_entries(self, wid: str) -> None:
        w = self._workers.get(wid)
        if w is None:
            return
        for h in w.held:
            holders = self._blocks[h]
            del holders[wid]
            if not holders:
                del self._blocks[h]
        self.num_entries -= len(w.held)
        w.held.clear()
        w.both.clear()
        w.expected.clear()

    def expect(self, worker_id: str, hashes: list[int], ttl_s: float = EXPECT_TTL_S) -> None:
        """The router just sent a prompt with these block hashes to `worker_id`: count them
        as held there (on device) until its events tell, or `ttl_s` passes. Prompts sharing a
        prefix that arrive before the first one's blocks are stored then go where that prefix
        is being computed (Dynamo's approximate KV routing does the same with TTLs), and the
        engine's in-batch prefix sharing computes it once."""
        w = self._workers.get(worker_id)
        if w is None or not w.synced or not hashes:
            return
        now = self.clock()
        if len(w.expected) + len(hashes) > MAX_EXPECTED:
            w.expected = {h: t for h, t in w.expected.items() if t > now}
            while len(w.expected) + len(hashes) > MAX_EXPECTED and w.expected:
                del w.expected[next(iter(w.expected))]  # oldest first (insertion order)
        until = now + ttl_s
        for h in hashes[:MAX_EXPECTED]:
            if h not in w.held:
                w.expected.pop(h, None)  # re-inserted: insertion order stays expiry order
                w.expected[h] = until

    # -- reading ---------------------------------------------------------------------------
    def workers(self) -> list[str]:
        return list(self._workers)

    def is_synced(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and w.synced

    def held(self, worker_id: str) -> dict[int, str]:
        """A copy of the worker's indexed hashes (hash -> tier)."""
        w = self._workers.get(worker_id)
        return dict(w.held) if w is not None else {}

    def holders(self, block_hash: int) -> dict[str, str]:
        return dict(self._blocks.get(block_hash, {}))

    def block_size(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return w.block_size if w is not None and w.synced else 0

    def hit_tokens(
        self,
        worker_id: str,
        hashes: list[int],
        block_size: int,
        tiers: tuple[str, ...] = (),
        expected: bool = True,
    ) -> tuple[int, float]:
        """(prompt tokens the worker holds as a leading run of `hashes`, the same weighted by
        tier); `tiers`: only blocks in those count; `expected`: blocks of prompts just routed
        there count too, as device blocks (`expect`). Nothing for a worker not synced or
        synced with another block size."""
        w = self._workers.get(worker_id)
        if w is None or not w.synced or w.block_size != block_size:
            return 0, 0.0
        blocks, weighted = 0, 0.0
        now = self.clock() if expected and w.expected else None
        for h in hashes:
            tier = w.held.get(h)
            if tier is None and now is not None and w.expected.get(h, 0.0) > now:
                tier = "device"
            if tier is None or (tiers and tier not in tiers):
                break
            blocks += 1
            weighted += TIER_WEIGHT[tier]
        return blocks * block_size, weighted * block_size


class PromptHashes:
    """A prompt's block hashes per block size, computed once per route (workers may differ);
    salted with the request's cache_salt, as the workers hash its blocks."""

    def __init__(self, prompt_ids: list[int], salt: str | None = None) -> None:
        self.prompt_ids = prompt_ids
        self.salt = salt
        self._by_size: dict[int, list[int]] = {}

    def get(self, block_size: int) -> list[int]:
        hashes = self._by_size.get(block_size)
        if hashes is None:
            n = lookup_blocks(len(self.prompt_ids), block_size)
            hashes = prefix_block_hashes(self.prompt_ids, block_size, n, self.salt)
            self._by_size[block_size] = hashes
        return hashes
