"""One worker's prefix cache, as the simulator models it: an LRU of prompt block hash ids.

A prompt's leading blocks whose ids are in the cache are hits: their tokens are not computed
again. The cache holds `kv_capacity_tokens / BLOCK_TOKENS` blocks (the worker's whole KV
cache, as an engine's prefix cache reuses every free block). Lifecycle: the router `peek`s
at every candidate worker (prefix affinity), then the chosen worker `use`s the prompt: hits
are counted and every block of the prompt becomes the most recently used. Blocks are entered
when the request is routed, not when its prefill ends: a later request with the same prefix
is queued behind it in FCFS order, so the prefix is computed before it runs.
"""

from __future__ import annotations

from collections import OrderedDict

from cluster.simulator.traces import BLOCK_TOKENS


class PrefixCache:
    __slots__ = ("capacity", "_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def peek(self, hash_ids: tuple[int, ...]) -> int:
        """Leading blocks of the prompt that are cached (nothing moves)."""
        hits = 0
        for h in hash_ids:
            if h not in self._blocks:
                break
            hits += 1
        return hits

    def use(self, hash_ids: tuple[int, ...]) -> int:
        """Count the prompt's hits, then make all its blocks the most recently used."""
        hits = self.peek(hash_ids)
        blocks = self._blocks
        for h in hash_ids:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
        return hits

    def __len__(self) -> int:
        return len(self._blocks)


def cached_tokens(hit_blocks: int, prompt_len: int) -> int:
    """Prompt tokens a hit of `hit_blocks` leading blocks saves. The last prompt token is
    always computed (its logits give the first output token), as in vLLM."""
    return max(0, min(hit_blocks * BLOCK_TOKENS, prompt_len - 1))
