"""Moving KV between pools of different tensor-parallel sizes: which KV heads each rank holds,
which slices a reading rank takes from which sending rank, and the NIXL rows that address a
head slice of a block.

Heads: a rank of a TP-`tp` group over a model with `total` KV heads holds `total // tp` of them
from `rank * (total // tp)`; with more ranks than heads each rank holds a copy of one head,
rank r the head `r // (tp // total)` (engine.models.parallel.Shard, the same rule).

Reads: a reading rank needs its own heads; each comes from one sending rank that holds it (a
replicated head from one holder only, spread over the holders by the reader's rank), and runs
of consecutive heads from the same sender become one `HeadSlice`.

Rows: `engine.kv_cache` stores a block as `[layers, 2 (k|v), block_size, heads, head_dim]`, so
a rank's whole block is one contiguous range but a head slice of it is `layers * 2 *
block_size` ranges of `n * head_dim` elements, one per (layer, k|v, slot); FP8 scales
(`[layers, 2, block_size, heads]` per block) the same with one float32 per head. A READ
between equal layouts keeps one row per block (`nixl.BlockRegion`); only a slice needs these
rows (`slice_rows`, vectorized: the per-block count is `units_per_block`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True, frozen=True)
class HeadLayout:
    """`tp` ranks over a model with `total` KV heads."""

    total: int
    tp: int

    def __post_init__(self) -> None:
        if self.total < 1 or self.tp < 1:
            raise ValueError(f"a head layout needs heads and ranks, got {self}")
        big, small = max(self.total, self.tp), min(self.total, self.tp)
        if big % small:
            raise ValueError(f"{self.tp} ranks cannot split {self.total} KV heads evenly")

    @property
    def per_rank(self) -> int:
        return max(1, self.total // self.tp)

    def start(self, rank: int) -> int:
        if not 0 <= rank < self.tp:
            raise ValueError(f"rank {rank} outside tp {self.tp}")
        if self.tp <= self.total:
            return rank * self.per_rank
        return rank // (self.tp // self.total)

    def holders(self, head: int) -> list[int]:
        """The ranks that hold global KV head `head` (several when replicated)."""
        return [r for r in range(self.tp) if self.start(r) <= head < self.start(r) + self.per_rank]

    def describe(self) -> str:
        return f"{self.total} KV heads over tp {self.tp} ({self.per_rank} per rank)"


@dataclass(slots=True, frozen=True)
class HeadSlice:
    """Heads [src_off, src_off + n) of sending rank `src_rank` land at [dst_off, dst_off + n)
    of the reading rank (offsets are rank-local head indices)."""

    src_rank: int
    src_off: int
    dst_off: int
    n: int


def plan_reads(src: HeadLayout, dst: HeadLayout, dst_rank: int) -> list[HeadSlice]:
    """What reading rank `dst_rank` of `dst` takes from the ranks of `src`, each head once."""
    if src.total != dst.total:
        raise ValueError(f"sender has {src.describe()}, reader {dst.describe()}")
    lo = dst.start(dst_rank)
    out: list[HeadSlice] = []
    for off in range(dst.per_rank):
        head = lo + off
        holders = src.holders(head)
        rank = holders[dst_rank % len(holders)]
        src_off = head - src.start(rank)
        last = out[-1] if out else None
        if last and last.src_rank == rank and last.src_off + last.n == src_off:
            out[-1] = HeadSlice(rank, last.src_off, last.dst_off, last.n + 1)
        else:
            out.append(HeadSlice(rank, src_off, off, 1))
    return out


@dataclass(slots=True, frozen=True)
class BlockShape:
    """The byte shape of one rank's block: `units` (layers * 2 * block_size) runs of `heads`
    entries of `entry_bytes` each (head_dim * element size for data, 4 for FP8 scales)."""

    units: int
    heads: int
    entry_bytes: int

    @property
    def block_bytes(self) -> int:
        return self.units * self.heads * self.entry_bytes


def units_per_block(num_layers: int, block_size: int) -> int:
    return num_layers * 2 * block_size


def slice_rows(
    base: int,
    shape: BlockShape,
    block_ids: list[int],
    head_off: int,
    n: int,
    device_id: int,
    whole: bool = False,
) -> np.ndarray:
    """NIXL rows (address, length, device) of heads [head_off, +n) of `block_ids`, in block
    then unit order, so a reader's and a sender's rows pair up one to one. `whole` (both
    sides' blocks are exactly these heads): one row per block."""
    if not 0 <= head_off <= shape.heads - n or n < 1:
        raise ValueError(f"heads [{head_off}, +{n}) outside a block of {shape.heads}")
    blocks = np.asarray(block_ids, dtype=np.uint64) * np.uint64(shape.block_bytes)
    if whole:
        starts, length = blocks, shape.block_bytes
    else:
        unit = np.arange(shape.units, dtype=np.uint64) * np.uint64(shape.heads * shape.entry_bytes)
        starts = (blocks[:, None] + unit[None, :]).reshape(-1)
        starts += np.uint64(head_off * shape.entry_bytes)
        length = n * shape.entry_bytes
    rows = np.empty((starts.size, 3), dtype=np.uint64)
    rows[:, 0] = starts + np.uint64(base)
    rows[:, 1] = length
    rows[:, 2] = device_id
    return rows


@dataclass(slots=True, frozen=True)
class Source:
    """Where one rank's blocks are: its NIXL agent name and base addresses."""

    name: str
    data_base: int
    scales_base: int
    device_id: int


@dataclass(slots=True, frozen=True)
class SlicePlan:
    """A reading rank's READs from a sender of another layout: per block range, one READ per
    slice, rank 0's last (its READ carries the completion notification, and is posted only
    once every other slice landed)."""

    slices: tuple[HeadSlice, ...]
    sources: dict[int, Source]  # sending rank -> its memory
    local: Source
    src: BlockShape
    dst: BlockShape
    src_scales: BlockShape | None = None  # FP8 KV: the scales, split the same way
    dst_scales: BlockShape | None = None

    def rows(self, s: HeadSlice, remote_ids, local_ids) -> tuple[np.ndarray, np.ndarray]:
        """(our rows, the sender's rows) of slice `s` of these blocks, data then scales."""
        whole = s.n == self.src.heads == self.dst.heads
        src, me = self.sources[s.src_rank], self.local
        mine = [slice_rows(me.data_base, self.dst, local_ids, s.dst_off, s.n, me.device_id, whole)]
        theirs = [
            slice_rows(src.data_base, self.src, remote_ids, s.src_off, s.n, src.device_id, whole)
        ]
        if self.src_scales is not None and self.dst_scales is not None:
            mine.append(
                slice_rows(
                    me.scales_base, self.dst_scales, local_ids, s.dst_off, s.n, me.device_id, whole
                )
            )
            theirs.append(
                slice_rows(
                    src.scales_base,
                    self.src_scales,
                    remote_ids,
                    s.src_off,
                    s.n,
                    src.device_id,
                    whole,
                )  # fmt: skip
            )
        return np.concatenate(mine), np.concatenate(theirs)

    def rows_per_block(self) -> int:
        """Descriptors one block costs on each side (the count NIXL's cost grows with)."""
        n = sum(
            1 if s.n == self.src.heads == self.dst.heads else self.src.units for s in self.slices
        )
        return n * (2 if self.src_scales is not None else 1)
