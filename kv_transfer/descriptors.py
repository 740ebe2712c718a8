"""Block descriptors: how a list of block ids becomes NIXL (address, length, device) rows.

`engine.kv_cache` keeps a block contiguous across all layers, K and V, so block `i` is the
single byte range `[base + i * block_bytes, base + (i + 1) * block_bytes)` and (for FP8 KV)
its scales are the single range `[scales_base + i * scale_block_bytes, ...)`. A region's
descriptor list therefore has one row per block, and the FP8 scales rows follow the data rows:

    index i               -> data of block i              (i < num_blocks)
    index num_blocks + i  -> scales of block i            (FP8 KV only)

A request's transfer is then `indices(block_ids)` on both sides; NIXL merges runs of adjacent
rows, so contiguous block ids cost one descriptor per run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kv_transfer.errors import TransferError


@dataclass(slots=True, frozen=True)
class BlockRegion:
    """One agent's KV memory as a transfer sees it (local, or a peer's from its HelloReply)."""

    mem_type: str  # "DRAM" | "VRAM"
    device_id: int
    num_blocks: int
    data_base: int
    block_bytes: int
    scales_base: int = 0
    scale_block_bytes: int = 0

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_bytes < 1 or self.data_base <= 0:
            raise ValueError("a block region needs blocks, a block size and a base address")
        if self.scale_block_bytes and self.scales_base <= 0:
            raise ValueError("a region with scales needs their base address")

    @property
    def has_scales(self) -> bool:
        return self.scale_block_bytes > 0

    @property
    def bytes_per_block(self) -> int:
        return self.block_bytes + self.scale_block_bytes

    def descriptors(self) -> np.ndarray:
        """All rows of this region, an N x 3 uint64 array (address, length, device id)."""
        rows = [_rows(self.data_base, self.block_bytes, self.num_blocks, self.device_id)]
        if self.has_scales:
            rows.append(
                _rows(self.scales_base, self.scale_block_bytes, self.num_blocks, self.device_id)
            )
        return np.concatenate(rows)

    def indices(self, block_ids: list[int] | tuple[int, ...]) -> np.ndarray:
        """Descriptor indices that cover `block_ids` (data, then scales), as int32."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise ValueError(f"block ids must be in [0, {self.num_blocks})")
        if self.has_scales:
            ids = np.concatenate([ids, ids + self.num_blocks])
        return ids.astype(np.int32)


def _rows(base: int, length: int, count: int, device_id: int) -> np.ndarray:
    rows = np.empty((count, 3), dtype=np.uint64)
    rows[:, 0] = base + np.arange(count, dtype=np.uint64) * np.uint64(length)
    rows[:, 1] = length
    rows[:, 2] = device_id
    return rows


def chunk(block_ids: list[int], blocks_per_chunk: int) -> list[list[int]]:
    """Split a request's blocks into READs of at most `blocks_per_chunk` blocks, in order."""
    step = max(1, blocks_per_chunk)
    return [list(block_ids[i : i + step]) for i in range(0, len(block_ids), step)]


def check_block_ids(request_id: str, ids: Any, num_blocks: int) -> tuple[int, ...]:
    """Validate a caller's request id and block ids (ints in range, no repeats), or raise
    TransferError naming the request; the same rules hold for held and read blocks."""
    if not isinstance(request_id, str) or not request_id or len(request_id) > 256:
        raise TransferError(str(request_id)[:256], "request_id must be a non-empty string")
    if not isinstance(ids, list | tuple) or not ids:
        raise TransferError(request_id, "block ids must be a non-empty list")
    if any(isinstance(b, bool) or not isinstance(b, int | np.integer) for b in ids):
        raise TransferError(request_id, "block ids must be ints")
    out = tuple(int(b) for b in ids)
    if min(out) < 0 or max(out) >= num_blocks:
        raise TransferError(request_id, f"block ids must be in [0, {num_blocks})")
    if len(set(out)) != len(out):
        raise TransferError(request_id, "block ids must not repeat")
    return out
