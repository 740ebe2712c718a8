"""The host-memory KV tier (`--kv-host-cache-gb`): blocks the device prefix cache evicts are
copied to a host pool, found again by the same block hash chain, and copied back into fresh
device blocks when a later prompt continues a device hit with them.

Demotion: `BlockManager` calls `on_evict(block_id, hash, token_ids)` when it reuses a free block
that still holds a cached prefix, before anything can write the block. The block's every byte
(K and V of every layer, and the FP8 scales when the cache has them) goes to a host slot. The
pool is an LRU by hash with a fixed number of slots (`capacity_bytes // bytes per block`); a
hash already in it is only refreshed (equal hashes mean equal KV).

Salts: the pool keeps the device's hashes, which are salted by the request's `cache_salt`
(engine/kv_events.py), and a lookup here chains under the asking request's salt, so a demoted
block comes back only to requests of the salt it was computed for.

Promotion (`allocate`): after the device prefix match the chain goes on in the host pool; the
host hits are reserved (an eviction this same allocation causes cannot reuse their slots), the
device allocation runs, and each hit is copied into the fresh block at its position. Those
tokens count as cached, exactly once (`num_cached_tokens` = device + host hits). A promoted
block is not registered in the device prefix cache here: the caller commits it after the step
that computed-or-promoted it, like a block the step computed, so nothing can match it (nor a
prefill connector hand it to a NIXL READ, which happens after a step) before its copy.

CUDA: the pool is pinned memory and copies run on a side stream. A demotion waits for the
compute stream (the block's last writer) and the compute stream waits for it at once (the next
write to that block may come before the next step: a fork's copy). A promotion records an event
that `wait()` makes the compute stream wait on before the step that reads it, so the copy
overlaps the scheduler's host work. Every pool copy is on the one side stream, so a slot is never
overwritten while a promotion still reads it. CPU: plain synchronous copies.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from engine.kv_cache import HOST_TIER, REMOVED, STORED, BlockManager, KVCache, hash_block


class HostKVCache:
    def __init__(self, cache: KVCache, bm: BlockManager, capacity_bytes: int):
        self.cache, self.bm = cache, bm
        self.block_bytes = KVCache.bytes_per_block(cache.spec)
        self.num_slots = max(0, int(capacity_bytes) // self.block_bytes)
        cuda = cache.device.type == "cuda"
        shape = (self.num_slots, *cache.data.shape[1:])
        self.data = torch.empty(shape, dtype=cache.data.dtype, pin_memory=cuda)
        self.scales = None
        if cache.scales is not None:
            shape = (self.num_slots, *cache.scales.shape[1:])
            self.scales = torch.empty(shape, dtype=torch.float32, pin_memory=cuda)
        self.stream = torch.cuda.Stream(cache.device) if cuda else None
        self._pending: list[torch.cuda.Event] = []
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash -> slot, oldest first
        self._tokens: list[tuple[int, ...]] = [()] * self.num_slots
        self._free = self._all_slots()
        self._reserved: set[int] = set()  # hashes a running allocation is about to promote
        self.hit_blocks = self.query_blocks = self.hit_tokens = 0
        self.demotions = self.promotions = self.dropped = 0
        self.bytes_demoted = self.bytes_promoted = 0
        bm.on_evict = self.demote

    # -- the pool ------------------------------------------------------------------------
    def _all_slots(self) -> list[int]:
        # Popped from the end: slots go out in descending order. BlockManager evicts a
        # sequence's tail first, so its blocks land in ascending slots in chain order and a
        # later promotion into fresh (ascending) device blocks is one copy (_runs).
        return list(range(self.num_slots))

    def clear(self) -> None:
        """Drop every block the pool holds (told to the event sink as removed)."""
        for h in self._lru:
            self._event(REMOVED, h)
        self._lru.clear()
        self._free = self._all_slots()

    @property
    def num_used(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def _slot_for_new(self) -> int | None:
        if self._free:
            return self._free.pop()
        for h in self._lru:  # oldest first; reserved hashes are about to be read
            if h not in self._reserved:
                self._event(REMOVED, h)
                return self._lru.pop(h)
        return None

    def _event(self, kind: str, block_hash: int) -> None:
        """Tell the block manager's listener (the worker's KV events) about the host tier."""
        if self.bm.event_sink is not None:
            self.bm.event_sink(kind, block_hash, HOST_TIER)

    def cached_hashes(self) -> list[int]:
        """Every block hash the pool holds now (a KV-event listener's resync)."""
        return list(self._lru)

    def demote(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Copy a device block that is being evicted into the pool (BlockManager.on_evict)."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return
        slot = self._slot_for_new()
        if slot is None:
            self.dropped += 1
            return
        self._copy([(slot, block_id)], to_host=True)
        self._lru[block_hash] = slot
        self._tokens[slot] = token_ids
        self._event(STORED, block_hash)
        self.demotions += 1
        self.bytes_demoted += self.block_bytes

    def _copy(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        """Blocks' bytes and scales, (destination, source) index pairs, host <- device when
        `to_host`; ordered against the compute stream (module doc). Runs of consecutive
        indices on both sides go as one copy, and the stream work is issued once for all: on
        an H100, 512 promotions one block at a time were bound by the host's issue rate (26 GB/s
        against 55 for one pinned copy) and hid little of the compute they should overlap."""
        if not pairs:
            return
        pool, dev = (self.data, self.scales), (self.cache.data, self.cache.scales)
        (dst, dst_scales), (src, src_scales) = (pool, dev) if to_host else (dev, pool)
        runs = _runs(pairs)
        if self.stream is None:
            _copy_runs(runs, dst, src, dst_scales, src_scales, blocking=True)
            return
        compute = torch.cuda.current_stream(self.cache.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            _copy_runs(runs, dst, src, dst_scales, src_scales, blocking=False)
            event = torch.cuda.Event()
            event.record(self.stream)
        if to_host:
            compute.wait_event(event)  # the block may be written before the next step
        else:
            self._pending.append(event)

    def wait(self) -> None:
        """Before a step: the compute stream waits for every promotion copied so far."""
        if self._pending:
            compute = torch.cuda.current_stream(self.cache.device)
            for event in self._pending:
                compute.wait_event(event)
            self._pending.clear()

    def synchronize(self) -> None:
        """Host-side: every copy issued so far is done (tests, reading the pool)."""
        if self.stream is not None:
            self.stream.synchronize()

    # -- admission -----------------------------------------------------------------------
    def _match(
        self,
        token_ids: list[int],
        device_blocks: int,
        limit: int | None = None,
        salt: str | None = None,
    ) -> list[int]:
        """Host slots of the chain's blocks (salted `salt`) after the first `device_blocks`
        (device hits), up to block `limit`; by default the last prompt token is never served
        from cache, as on the device."""
        bs, slots, prev = self.bm.block_size, [], None
        limit = (len(token_ids) - 1) // bs if limit is None else limit
        for i in range(limit):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            prev = hash_block(prev, chunk, salt)
            if i < device_blocks:
                continue
            slot = self._lru.get(prev)
            if slot is None or self._tokens[slot] != chunk:
                break
            self._lru.move_to_end(prev)
            self._reserved.add(prev)
            slots.append(slot)
        if limit > device_blocks:
            self.query_blocks += limit - device_blocks
        return slots

    def allocate(
        self,
        token_ids: list[int],
        use_cache: bool = True,
        count: bool = True,
        salt: str | None = None,
    ) -> tuple[list[int], int, int]:
        """`BlockManager.allocate` continued into the pool: (block table, cached tokens on
        either tier, cached tokens of the device alone — the blocks already committed). Both
        tiers match under the request's cache `salt`."""
        if not use_cache or not self.bm.enable_prefix_caching:
            table, cached = self.bm.allocate(token_ids, use_cache, count, salt)
            return table, cached, cached
        device_blocks = self.bm.cached_prefix_tokens(token_ids, salt) // self.bm.block_size
        slots = self._match(token_ids, device_blocks, salt=salt)
        try:
            table, cached = self.bm.allocate(token_ids, use_cache, count, salt)
        finally:
            self._reserved.clear()
        fresh = table[device_blocks : device_blocks + len(slots)]
        self._copy(list(zip(fresh, slots, strict=True)), to_host=False)
        self.hit_blocks += len(slots)
        self.promotions += len(slots)
        self.bytes_promoted += len(slots) * self.block_bytes
        hit = len(slots) * self.bm.block_size
        if count:  # compute saved (BlockManager.allocate's rule for its own counters)
            self.hit_tokens += hit
        return table, cached + hit, cached

    def promote_for_peer(
        self, token_ids: list[int], device_blocks: int, salt: str | None = None
    ) -> list[int]:
        """The host pool as the source of a transfer (kv_transfer/prefix_pull.py): copy the
        chain's whole blocks after the first `device_blocks` from host memory into fresh device
        blocks now, register them in the device prefix cache and return them, referenced for
        the caller (who frees them), so a peer's NIXL READ can be served from them. Waits for
        the copies: a READ does not follow the compute stream. `salt`: the reader's request's,
        for the match and the blocks' registration alike."""
        bs = self.bm.block_size
        slots = self._match(token_ids, device_blocks, len(token_ids) // bs, salt)
        try:
            slots = slots[: self.bm.num_free_blocks]
            blocks = self.bm.allocate_blocks(len(slots))
        finally:
            self._reserved.clear()
        self._copy(list(zip(blocks, slots, strict=True)), to_host=False)
        self.synchronize()
        self.promotions += len(slots)
        self.bytes_promoted += len(slots) * self.block_bytes
        self.bm.adopt(blocks, token_ids, device_blocks, salt)
        return blocks

    def stats(self) -> dict:
        return {
            "host_hit_tokens": self.hit_tokens,
            "host_hit_blocks": self.hit_blocks,
            "host_miss_blocks": self.query_blocks - self.hit_blocks,
            "host_demotions": self.demotions,
            "host_promotions": self.promotions,
            "host_dropped": self.dropped,
            "host_bytes_demoted": self.bytes_demoted,
            "host_bytes_promoted": self.bytes_promoted,
            "host_used_blocks": self.num_used,
            "host_total_blocks": self.num_slots,
        }


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(dst start, src start, length) for each run of pairs consecutive on both sides."""
    runs: list[list[int]] = []
    for d, s in pairs:
        if runs and d == runs[-1][0] + runs[-1][2] and s == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([d, s, 1])
    return [tuple(r) for r in runs]


def _copy_runs(runs, dst, src, dst_scales, src_scales, blocking: bool) -> None:
    for d, s, n in runs:
        dst[d : d + n].copy_(src[s : s + n], non_blocking=not blocking)
        if src_scales is not None:
            dst_scales[d : d + n].copy_(src_scales[s : s + n], non_blocking=not blocking)
