"""The agent's NIXL endpoint (registered KV memory, prepped descriptor lists, READs, notifs)
and the block descriptors it preps (`BlockRegion`, `check_block_ids`, `chunk`).

Lifecycle: at start-up the cache (data, FP8 scales when present, and a one-block scratch buffer
for the warm-up READ) is registered once and every block's descriptor is prepped, so a request
only turns block ids into indices. Per peer: `add_peer` loads its NIXL metadata and
`prep_peer` preps its descriptor list once (at handshake); `forget_peer` undoes both. Per READ:
`make_read` -> `transfer` (posts it; on CPU UCX copies inside this call) -> `check` until
"DONE" or an error -> `release`. `close` releases the local lists and deregisters the memory.

Every call into NIXL holds this endpoint's lock: the worker thread posts and checks READs while
the side-channel thread takes notifications (which progresses UCX). NIXL's own progress thread
is off by default because it spins: measured ~40-50% of a core per idle agent and a 3x slower
16 MB READ on a 2-core box; the side-channel thread drives progress instead.

Block descriptors: how a list of block ids becomes NIXL (address, length, device) rows.

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

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.kv_cache import KVCache
from kv_transfer.errors import TransferError, quietly


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
    # By distinct type, not per id: a 1024-block READ checked id by id in Python cost about a
    # millisecond of its wall clock on the H200's host (GPU run 6's poll profile).
    if any(t is bool or not issubclass(t, int | np.integer) for t in set(map(type, ids))):
        raise TransferError(request_id, "block ids must be ints")
    out = tuple(map(int, ids))
    if min(out) < 0 or max(out) >= num_blocks:
        raise TransferError(request_id, f"block ids must be in [0, {num_blocks})")
    if len(set(out)) != len(out):
        raise TransferError(request_id, "block ids must not repeat")
    return out


log = logging.getLogger(__name__)

CUDA_IPC_GET_ENV = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
# The largest single READ. In host memory UCX copies inside the post call, so a chunk bounds
# how long one poll() blocks the worker loop; in VRAM a post only enqueues copies, and each
# extra READ costs bandwidth (H100, 2 GiB in 2 MiB blocks: 0.33 of a device copy in 64 MiB
# READs, 0.57 in 512 MiB, 0.65 in one).
HOST_READ_BYTES = 64 << 20
DEVICE_READ_BYTES = 2 << 30


def default_max_read_bytes(device: torch.device) -> int:
    return DEVICE_READ_BYTES if device.type == "cuda" else HOST_READ_BYTES


def allow_cuda_ipc_reads() -> None:
    """Let UCX carry a READ of VRAM from another process on this host over CUDA IPC.

    UCX turns cuda_ipc's get (what a NIXL READ is) off on GPUs without NVLink peers, a single
    GPU included; a READ between two processes then falls back to software emulation through
    host memory: 0.85 GB/s on an H100 against 958 GB/s with it on (benchmarks/README.md, GPU
    section). UCX reads its environment when the backend starts, so this must run before the
    agent is created; an operator's own setting wins."""
    os.environ.setdefault(CUDA_IPC_GET_ENV, "y")


NotifBatch = dict[str, list[bytes]]  # peer agent name -> raw notification payloads


class NixlEndpoint:
    """One NIXL agent over one worker's KV cache; see the module docstring."""

    def __init__(self, name: str, kv_cache: KVCache, progress_thread: bool = False):
        from nixl._api import nixl_agent, nixl_agent_config  # heavy; imported on first use

        for t in (kv_cache.data, kv_cache.scales):
            if t is not None and not t.is_contiguous():
                raise ValueError("the KV cache tensors must be contiguous to be registered")
        self._lock = threading.Lock()
        if kv_cache.device.type == "cuda":
            allow_cuda_ipc_reads()
        self._agent = nixl_agent(
            name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        )
        dev = kv_cache.device
        spec = self.spec = kv_cache.spec
        self.mem_type = "VRAM" if dev.type == "cuda" else "DRAM"
        dev_id = (dev.index or 0) if dev.type == "cuda" else 0
        self._regs = [self._agent.register_memory(kv_cache.data)]
        if kv_cache.scales is not None:
            self._regs.append(self._agent.register_memory(kv_cache.scales))
        # Warm-up target: reading a peer's block 0 must not touch a live block of ours.
        self._scratch = torch.empty(spec.block_bytes, dtype=torch.uint8, device=dev)
        self._regs.append(self._agent.register_memory(self._scratch))
        self.region = BlockRegion(
            mem_type=self.mem_type,
            device_id=dev_id,
            num_blocks=kv_cache.num_blocks,
            data_base=kv_cache.data.data_ptr(),
            block_bytes=spec.block_bytes,
            scales_base=kv_cache.scales.data_ptr() if kv_cache.scales is not None else 0,
            scale_block_bytes=spec.scale_block_bytes,
        )
        self._local_dlist = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self.region.descriptors(), self.mem_type
        )
        scratch_row = np.array(
            [[self._scratch.data_ptr(), spec.block_bytes, dev_id]], dtype=np.uint64
        )
        self._scratch_dlist = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", scratch_row, self.mem_type
        )
        self.metadata: bytes = self._agent.get_agent_metadata()  # goes into our HelloReply

    # ------------------------------------------------------------------ peers

    def add_peer(self, nixl_metadata: bytes) -> str:
        """Load a peer's NIXL metadata; returns the agent name it declares."""
        with self._lock:
            return _text(self._agent.add_remote_agent(nixl_metadata))

    def prep_peer(self, name: str, region: BlockRegion) -> Any:
        """The peer's prepped descriptor list (every block, from its HelloReply bases)."""
        with self._lock:
            return self._agent.prep_xfer_dlist(name, region.descriptors(), region.mem_type)

    def forget_peer(self, name: str, dlist: Any | None) -> None:
        with self._lock:
            if dlist is not None:
                quietly(dlist.release)
            quietly(lambda: self._agent.remove_remote_agent(name))

    def warm_up(self, peer_dlist: Any, timeout_s: float) -> str:
        """One 1-block READ of the peer's block 0 into scratch; returns its final state.

        It pays UCX's connection setup (~0.4 s on a fresh pair) at handshake time instead of
        on the first request. NIXL's own errors propagate.
        """
        with self._lock:
            handle = self._agent.make_prepped_xfer(
                "READ", self._scratch_dlist, [0], peer_dlist, [0], b""
            )
        try:
            with self._lock:
                state = self._agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.0005)  # unlocked: the side-channel thread may progress UCX
                with self._lock:
                    state = self._agent.check_xfer_state(handle)
            return state
        finally:
            with self._lock:
                quietly(handle.release)

    # ------------------------------------------------------------------ READs

    def make_read(
        self,
        local_ids: list[int],
        peer_dlist: Any,
        peer_region: BlockRegion,
        remote_ids: list[int],
        notif: bytes,
    ) -> Any:
        """A READ of the peer's `remote_ids` into our `local_ids`, not yet posted; `notif`
        (may be empty) reaches the peer when it lands."""
        with self._lock:
            return self._agent.make_prepped_xfer(
                "READ",
                self._local_dlist,
                self.region.indices(local_ids),
                peer_dlist,
                peer_region.indices(remote_ids),
                notif,
            )

    def transfer(self, handle: Any) -> str:
        """Post a READ; returns NIXL's state, "ERR (...)" when NIXL raised."""
        return self._state_of(lambda: self._agent.transfer(handle))

    def check(self, handle: Any) -> str:
        """NIXL's state of a posted READ: PROC, DONE, or an error (e.g. a remote disconnect)."""
        return self._state_of(lambda: self._agent.check_xfer_state(handle))

    def release(self, handle: Any, what: str) -> bool:
        """Release (cancel, if in flight) a READ; False when NIXL refused (retry later)."""
        try:
            with self._lock:
                handle.release()
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error classes
            log.warning("releasing the READ of %s: %s", what, e)
            return False
        return True

    def _state_of(self, call: Callable[[], str]) -> str:
        try:
            with self._lock:
                return call()
        except Exception as e:  # noqa: BLE001 - e.g. nixlRemoteDisconnectError
            return f"ERR ({e})"

    def make_rows_read(
        self, local_rows: np.ndarray, remote_rows: np.ndarray, peer_name: str, notif: bytes
    ) -> Any:
        """A READ given as explicit row lists (head slices, kv_transfer/tp_layout.py): row i of
        the peer's `remote_rows` lands on our `local_rows[i]`; not yet posted."""
        with self._lock:
            local = self._agent.get_xfer_descs(local_rows, self.mem_type)
            remote = self._agent.get_xfer_descs(remote_rows, self.mem_type)
            return self._agent.initialize_xfer("READ", local, remote, peer_name, notif)

    def warm_up_rows(self, peer_name: str, remote_row: np.ndarray, timeout_s: float) -> str:
        """`warm_up` for a peer known by rows only (another rank of a TP sender): one READ of
        `remote_row` (at most a block long) into scratch."""
        local = remote_row.copy()
        local[:, 0] = self._scratch.data_ptr()
        local[:, 2] = self.region.device_id
        handle = self.make_rows_read(local, remote_row, peer_name, b"")
        try:
            state = self.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.0005)
                state = self.check(handle)
            return state
        finally:
            with self._lock:
                quietly(handle.release)

    # ------------------------------------------------------------------ notifications

    def take_notifs(self, wait: bool = True) -> NotifBatch:
        """New notifications by peer name (taking them also progresses UCX).

        wait=False returns nothing at once when another thread is inside a NIXL call: that
        call progresses UCX itself (a CPU READ copies inside transfer()), and the side channel
        must not stall behind the copy.
        """
        if not self._lock.acquire(blocking=wait):
            return {}
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error classes
            log.warning("reading NIXL notifications: %s", e)
            return {}
        finally:
            self._lock.release()
        return {_text(agent): list(msgs) for agent, msgs in notifs.items()}

    def send_notif(self, peer_name: str, payload: bytes) -> None:
        """A raw notification to a peer (the last READ chunk carries the real ones; tests use
        this to send late and malformed ones)."""
        with self._lock:
            self._agent.send_notif(peer_name, payload)

    def close(self) -> None:
        with self._lock:
            for dlist in (self._local_dlist, self._scratch_dlist):
                quietly(dlist.release)
            for reg in self._regs:
                quietly(lambda reg=reg: self._agent.deregister_memory(reg))


def _text(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)
