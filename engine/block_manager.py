"""Paged KV block allocation with reference counts and hash-chained prefix caching.

Lifecycle of a block: FREE (in the LRU free queue, maybe still holding a cached prefix) ->
IN USE (ref_count >= 1, owned by one or more sequences) -> FREE again on the last release.
A block gets a hash only once every one of its slots holds computed KV (`commit`), and the
hash chains the previous block's hash with this block's token ids, so equal hashes mean equal
prefixes. A free block keeps its hash until it is reused for other tokens, so a later request
with the same prefix can take it back (a prefix-cache hit) without recomputation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


def hash_block(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: blocks freed longest ago are reused first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # hash -> block id
        self.num_prefix_hit_tokens = 0
        self.num_prefix_query_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix lookup -------------------------------------------------------------------
    def _prefix_hashes(self, token_ids: list[int], max_blocks: int) -> list[tuple[int, tuple]]:
        out, prev = [], None
        for b in range(max_blocks):
            chunk = tuple(token_ids[b * self.block_size : (b + 1) * self.block_size])
            prev = hash_block(prev, chunk)
            out.append((prev, chunk))
        return out

    def _lookup(self, token_ids: list[int]) -> list[int]:
        """Block ids of the longest cached prefix. The last prompt token is never served from
        cache: its logits are needed, so at least one token is always computed."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h, chunk in self._prefix_hashes(token_ids, (len(token_ids) - 1) // self.block_size):
            bid = self._cached.get(h)
            if bid is None or self.blocks[bid].token_ids != chunk:
                break
            hits.append(bid)
        return hits

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the prefix cache holds (whole blocks)."""
        return len(self._lookup(token_ids)) * self.block_size

    def can_allocate(self, num_tokens: int, token_ids: list[int] | None = None) -> bool:
        hits = self._lookup(token_ids) if token_ids is not None else []
        # A hit on a free block takes it out of the free queue, so it costs a free block too.
        reused_in_use = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return self.blocks_needed(num_tokens) - reused_in_use <= self.num_free_blocks

    # -- allocation ----------------------------------------------------------------------
    def _take_free(self) -> int:
        bid, _ = self._free.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None and self._cached.get(block.hash) == bid:
            del self._cached[block.hash]  # evict the cached prefix it held
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return bid

    def _take(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self._free[bid]
        block.ref_count += 1

    def allocate(self, token_ids: list[int], use_cache: bool = True) -> tuple[list[int], int]:
        """Blocks for `token_ids`: cached prefix blocks first, fresh ones after. `use_cache`
        False takes no cached block (a request that needs every prompt position computed).

        Returns (block_table, num_cached_tokens). Raises MemoryError if they do not fit.
        """
        if not self.can_allocate(len(token_ids), token_ids if use_cache else None):
            raise MemoryError(f"not enough free KV blocks for {len(token_ids)} tokens")
        hits = self._lookup(token_ids) if use_cache else []
        for bid in hits:
            self._take(bid)
        table = hits + [
            self._take_free() for _ in range(self.blocks_needed(len(token_ids)) - len(hits))
        ]
        cached = len(hits) * self.block_size
        self.num_prefix_hit_tokens += cached
        self.num_prefix_query_tokens += len(token_ids)
        return table, cached

    def allocate_blocks(self, n: int) -> list[int]:
        """n fresh blocks with no prefix reuse (for KV that arrives from a peer)."""
        if n > self.num_free_blocks:
            raise MemoryError(f"need {n} free KV blocks, have {self.num_free_blocks}")
        return [self._take_free() for _ in range(n)]

    def fork(self, block_table: list[int], num_tokens: int) -> tuple[list[int], int | None]:
        """A second owner for the first `num_tokens` tokens of `block_table`: full blocks are
        shared (reference counts); a partly filled last block cannot be (both owners will
        write their own next token into it), so a fresh block is taken for it. Returns (the
        new table, the block to copy the partial one into, or None). MemoryError when no
        block is free for the copy."""
        full = num_tokens // self.block_size
        shared = block_table[:full]
        partial = full < self.blocks_needed(num_tokens)
        if partial and not self._free:
            raise MemoryError("no free KV block to copy a forked sequence's last block into")
        for bid in shared:
            self._take(bid)
        if not partial:
            return list(shared), None
        copy = self._take_free()
        return [*shared, copy], copy

    def can_append(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(block_table) <= self.num_free_blocks

    def append_slots(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place so it covers `num_tokens` tokens."""
        need = self.blocks_needed(num_tokens) - len(block_table)
        if need > self.num_free_blocks:
            raise MemoryError(f"need {need} more KV blocks, have {self.num_free_blocks}")
        block_table.extend(self._take_free() for _ in range(need))

    def free(self, block_table: list[int]) -> None:
        # Reversed, so a sequence's tail blocks are evicted before its shared head blocks.
        for bid in reversed(block_table):
            block = self.blocks[bid]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {bid}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free[bid] = None
                    self._free.move_to_end(bid, last=False)  # uncached: reuse first
                else:
                    self._free[bid] = None
        block_table.clear()

    def commit(
        self, block_table: list[int], token_ids: list[int], num_computed: int, start: int = 0
    ) -> int:
        """Register the hashes of blocks whose KV is now fully computed, from block `start`
        on; returns the number of committed blocks (the caller's next `start`)."""
        full = num_computed // self.block_size
        if not self.enable_prefix_caching:
            return full
        prev = self.blocks[block_table[start - 1]].hash if start > 0 else None
        for i in range(start, full):
            block = self.blocks[block_table[i]]
            if block.hash is None:
                chunk = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
                block.hash = hash_block(prev, chunk)
                block.token_ids = chunk
                self._cached.setdefault(block.hash, block.block_id)
            prev = block.hash
        return max(full, start)
