"""The paged KV cache: its memory (`KVCacheSpec`, `KVCache`: one tensor per worker, laid out
block-major) and the accounting of its blocks (`BlockManager`: reference counts, hash-chained
prefix caching, LRU eviction).

Layout: `data[num_blocks, num_layers, 2 (k|v), block_size, num_kv_heads, head_dim]`.
A block is contiguous across all layers, so moving a request's KV to another worker takes one
memory descriptor per block (NIXL cost grows with descriptor count, not bytes), and per-layer
views `data[:, layer, 0]` are strided views with no copy. A token's slot is
`block_id * block_size + offset`.

FP8 KV (`kv_dtype="fp8_e4m3"`): `data` holds float8_e4m3fn and `scales[num_blocks, num_layers,
2, block_size, num_kv_heads]` (float32) holds one scale per token and head (amax / 448), so a
block's scales are contiguous as well and travel next to it. Attention dequantizes on read.

Lifecycle of a block: FREE (in the LRU free queue, maybe still holding a cached prefix) ->
IN USE (ref_count >= 1, owned by one or more sequences) -> FREE again on the last release.
A block gets a hash only once every one of its slots holds computed KV (`commit`), and the
hash chains the previous block's hash with this block's token ids, so equal hashes mean equal
prefixes. A free block keeps its hash until it is reused for other tokens, so a later
request with the same prefix can take it back (a prefix-cache hit) without recomputation.

A request's `cache_salt` seeds its chain (engine/kv_events.py): every method that hashes a
request's tokens takes its `salt`, so a salted prompt matches only blocks cached under the same
salt, never another tenant's or the unsalted ones.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.kv_events import hash_block, lookup_blocks, prefix_block_hashes

FP8_MAX = 448.0  # largest finite float8_e4m3fn
KV_DTYPES = ("auto", "fp8_e4m3")


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    """Everything that fixes the byte layout of a block; peers must agree on all of it."""

    model: str  # architecture name, e.g. "LlamaForCausalLM"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # model compute dtype
    kv_dtype: str = "auto"
    layout: str = "block,layer,kv,slot,head,dim"
    # Tensor parallelism: this rank holds global KV heads [kv_head_start, + num_kv_heads) of
    # the model's `total_kv_heads` (0: as many as it holds), one of `tp_size` ranks. With more
    # ranks than KV heads, ranks hold copies of the same head.
    total_kv_heads: int = 0
    kv_head_start: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.total_kv_heads == 0:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.kv_head_start <= self.total_kv_heads - self.num_kv_heads:
            raise ValueError(
                f"KV heads [{self.kv_head_start}, +{self.num_kv_heads}) are outside the "
                f"model's {self.total_kv_heads}"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")

    @property
    def cache_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.kv_dtype == "fp8_e4m3" else self.dtype

    @property
    def has_scales(self) -> bool:
        return self.kv_dtype == "fp8_e4m3"

    @property
    def block_numel(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        return self.block_numel * torch.empty((), dtype=self.cache_dtype).element_size()

    @property
    def scale_block_bytes(self) -> int:
        if not self.has_scales:
            return 0
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * 4

    def compat_fields(self) -> dict[str, str]:
        """The fields a transfer peer must match, as strings (for hashing and error messages):
        the model's, not this rank's share (`num_kv_heads` is the model's total), so pools of
        different TP sizes are compatible; `head_layout` says which heads each side holds."""
        return {
            "model": self.model,
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_dtype": self.kv_dtype,
            "block_size": str(self.block_size),
            "layout": self.layout,
            "num_layers": str(self.num_layers),
            "num_kv_heads": str(self.total_kv_heads),
            "head_dim": str(self.head_dim),
        }

    def head_layout(self) -> str:
        """This rank's share, for messages: "tp 2, rank heads [2, 4) of 4"."""
        end = self.kv_head_start + self.num_kv_heads
        start, total = self.kv_head_start, self.total_kv_heads
        return f"tp {self.tp_size}, rank heads [{start}, {end}) of {total}"

    def compat_hash(self) -> str:
        text = "|".join(f"{k}={v}" for k, v in sorted(self.compat_fields().items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu"):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        shape = (num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.data = torch.zeros(shape, dtype=spec.cache_dtype, device=self.device)
        self.scales = (
            torch.ones(shape[:-1], dtype=torch.float32, device=self.device)
            if spec.has_scales
            else None
        )
        # Built once: a decode step asks for every layer's views several times.
        self._views = [self._make_views(layer) for layer in range(spec.num_layers)]

    @staticmethod
    def bytes_per_block(spec: KVCacheSpec) -> int:
        return spec.block_bytes + spec.scale_block_bytes

    def copy_block(self, src: int, dst: int) -> None:
        """Block `dst` becomes a copy of block `src` (every layer, K and V, and FP8 scales)."""
        self.data[dst].copy_(self.data[src])
        if self.scales is not None:
            self.scales[dst].copy_(self.scales[src])

    def layer_views(self, layer: int):
        """(k, v, k_scale, v_scale) for one layer; k/v are [num_blocks, block_size, heads, dim]."""
        return self._views[layer]

    def _make_views(self, layer: int):
        k = self.data[:, layer, 0]
        v = self.data[:, layer, 1]
        if self.scales is None:
            return k, v, None, None
        return k, v, self.scales[:, layer, 0], self.scales[:, layer, 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v ([tokens, kv_heads, head_dim]) at `slots` ([tokens], int64)."""
        bs = self.spec.block_size
        self.write_at(layer, slots // bs, slots % bs, k, v)

    def write_at(
        self,
        layer: int,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """`write` with the slots already split into block ids and in-block offsets (a step
        writes the same slots in every layer, so a backend splits them once)."""
        kc, vc, ks, vs = self.layer_views(layer)
        if self.scales is None:
            kc[blocks, offsets] = k.to(kc.dtype)
            vc[blocks, offsets] = v.to(vc.dtype)
            return
        for cache, scale, x in ((kc, ks, k), (vc, vs, v)):
            xf = x.float()
            s = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
            cache[blocks, offsets] = (xf / s.unsqueeze(-1)).to(torch.float8_e4m3fn)
            scale[blocks, offsets] = s

    def gather(
        self, layer: int, block_table: torch.Tensor, out_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V for the blocks in `block_table` (any shape of block ids), dequantized.

        Returns tensors of shape [*block_table.shape, block_size, kv_heads, head_dim].
        """
        kc, vc, ks, vs = self.layer_views(layer)
        # index_select copies whole blocks (contiguous runs); advanced indexing (kc[table])
        # walks element by element and is 2-3x slower on CPU.
        flat = block_table.reshape(-1)
        shape = (*block_table.shape, *kc.shape[1:])
        k = kc.index_select(0, flat).view(shape)
        v = vc.index_select(0, flat).view(shape)
        if self.scales is None:
            return k.to(out_dtype), v.to(out_dtype)
        k = (k.float() * ks.index_select(0, flat).view(shape[:-1]).unsqueeze(-1)).to(out_dtype)
        v = (v.float() * vs.index_select(0, flat).view(shape[:-1]).unsqueeze(-1)).to(out_dtype)
        return k, v


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


# Events for a listener that mirrors this cache (the worker's KV event publisher, see
# engine/kv_events.py): a block hash entered ("stored") or left ("removed") the prefix cache.
STORED, REMOVED = "stored", "removed"
DEVICE_TIER, HOST_TIER = "device", "host"


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
        # Optional listener: event_sink(kind, block_hash, tier), called as the cache changes.
        self.event_sink: Callable[[str, int, str], None] | None = None
        # Called as (block_id, hash, token_ids) when a cached block is evicted, before it is
        # reused: the host tier copies it out (engine/kv_host_cache.py).
        self.on_evict: Callable[[int, int, tuple[int, ...]], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix lookup -------------------------------------------------------------------
    def _prefix_hashes(
        self, token_ids: list[int], max_blocks: int, salt: str | None = None
    ) -> list[tuple[int, tuple]]:
        bs = self.block_size
        hashes = prefix_block_hashes(token_ids, bs, max_blocks, salt)
        return [(h, tuple(token_ids[b * bs : (b + 1) * bs])) for b, h in enumerate(hashes)]

    def _lookup(
        self, token_ids: list[int], max_blocks: int | None = None, salt: str | None = None
    ) -> list[int]:
        """Block ids of the longest cached prefix of a request salted `salt`. By default the
        last prompt token is never served from cache: its logits are needed, so at least one
        token is always computed."""
        if not self.enable_prefix_caching:
            return []
        if max_blocks is None:
            max_blocks = lookup_blocks(len(token_ids), self.block_size)
        hits = []
        for h, chunk in self._prefix_hashes(token_ids, max_blocks, salt):
            bid = self._cached.get(h)
            if bid is None or self.blocks[bid].token_ids != chunk:
                break
            hits.append(bid)
        return hits

    def cached_hashes(self) -> list[int]:
        """Every block hash the prefix cache holds now (a listener's resync)."""
        return list(self._cached)

    def cached_prefix_tokens(self, token_ids: list[int], salt: str | None = None) -> int:
        """How many leading tokens of `token_ids` the prefix cache holds (whole blocks)."""
        return len(self._lookup(token_ids, salt=salt)) * self.block_size

    def can_allocate(
        self, num_tokens: int, token_ids: list[int] | None = None, salt: str | None = None
    ) -> bool:
        hits = self._lookup(token_ids, salt=salt) if token_ids is not None else []
        # A hit on a free block takes it out of the free queue, so it costs a free block too.
        reused_in_use = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return self.blocks_needed(num_tokens) - reused_in_use <= self.num_free_blocks

    # -- blocks lent to a peer or filled from one (kv_transfer/prefix_pull.py) -----------
    def num_cached_blocks(self, token_ids: list[int], salt: str | None = None) -> int:
        """Leading whole blocks of `token_ids` the prefix cache holds (the last one too)."""
        return len(self._lookup(token_ids, len(token_ids) // self.block_size, salt))

    def pin_prefix(
        self, token_ids: list[int], first: int = 0, salt: str | None = None
    ) -> list[int]:
        """A reference on each cached block from block `first` of the longest cached prefix
        of `token_ids` (every whole block counts, the last one too): they cannot be evicted
        while a peer reads them or a request is about to use them. `free` gives them back."""
        hits = self._lookup(token_ids, len(token_ids) // self.block_size, salt)[first:]
        for bid in hits:
            self._take(bid)
        return hits

    def adopt(
        self, block_ids: list[int], token_ids: list[int], first: int, salt: str | None = None
    ) -> int:
        """Blocks a peer's READ just filled (taken with `allocate_blocks`; the caller keeps
        its reference) become prefix-cache blocks `first`.. of `token_ids`, as if computed
        here. A hash the cache already holds keeps its block (this copy stays uncached and
        is reused first once freed). `salt`: the request's that the READ served, so the blocks
        are found only by its salt's lookups. Returns how many were cached."""
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        hashes = prefix_block_hashes(token_ids, bs, first + len(block_ids), salt)
        cached = 0
        for b, bid in enumerate(block_ids, start=first):
            block, h = self.blocks[bid], hashes[b]
            if block.hash is not None or h in self._cached:
                continue
            block.hash, block.token_ids = h, tuple(token_ids[b * bs : (b + 1) * bs])
            self._cached[h] = bid
            cached += 1
            if self.event_sink is not None:
                self.event_sink(STORED, h, DEVICE_TIER)
        return cached

    # -- allocation ----------------------------------------------------------------------
    def _take_free(self) -> int:
        bid, _ = self._free.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None and self._cached.get(block.hash) == bid:
            del self._cached[block.hash]  # evict the cached prefix it held
            # The device copy's removal is told first, then the host tier's demotion
            # ("stored" host, from on_evict): a listener replaying the events in order sees
            # the block leave one tier and enter the other (router/kv_index.py).
            if self.event_sink is not None:
                self.event_sink(REMOVED, block.hash, DEVICE_TIER)
            if self.on_evict is not None:
                self.on_evict(bid, block.hash, block.token_ids)
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return bid

    def _take(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self._free[bid]
        block.ref_count += 1

    def allocate(
        self,
        token_ids: list[int],
        use_cache: bool = True,
        count: bool = True,
        salt: str | None = None,
    ) -> tuple[list[int], int]:
        """Blocks for `token_ids`: cached prefix blocks first, fresh ones after. `use_cache`
        False takes no cached block (a request that needs every prompt position computed).
        `count` False leaves the hit counters alone (they measure compute saved; a decode
        worker reusing blocks for a peer's prompt saves a transfer, not compute). `salt`: the
        request's cache salt (only its own salt's blocks are hits).

        Returns (block_table, num_cached_tokens). Raises MemoryError if they do not fit.
        """
        if not self.can_allocate(len(token_ids), token_ids if use_cache else None, salt):
            raise MemoryError(f"not enough free KV blocks for {len(token_ids)} tokens")
        hits = self._lookup(token_ids, salt=salt) if use_cache else []
        for bid in hits:
            self._take(bid)
        table = hits + [
            self._take_free() for _ in range(self.blocks_needed(len(token_ids)) - len(hits))
        ]
        cached = len(hits) * self.block_size
        if count:
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
        self,
        block_table: list[int],
        token_ids: list[int],
        num_computed: int,
        start: int = 0,
        salt: str | None = None,
    ) -> int:
        """Register the hashes of blocks whose KV is now fully computed, from block `start`
        on; returns the number of committed blocks (the caller's next `start`). `salt` seeds
        the chain's first block; later blocks chain from their predecessor's (salted) hash."""
        full = num_computed // self.block_size
        if not self.enable_prefix_caching:
            return full
        prev = self.blocks[block_table[start - 1]].hash if start > 0 else None
        for i in range(start, full):
            block = self.blocks[block_table[i]]
            if block.hash is None:
                chunk = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
                block.hash = hash_block(prev, chunk, salt)
                block.token_ids = chunk
                if self._cached.setdefault(block.hash, block.block_id) == block.block_id:
                    if self.event_sink is not None:
                        self.event_sink(STORED, block.hash, DEVICE_TIER)
            prev = block.hash
        return max(full, start)
