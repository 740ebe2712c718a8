"""The host-memory KV tier (engine/kv_host_cache.py) on the device: how fast its real demote and
promote paths move Llama-3-8B-shaped blocks between VRAM and pinned host memory, against one
plain pinned copy of the same bytes measured in the same run, and whether a promotion overlaps
compute on the default stream as the tier's side stream intends.

Blocks are 2 MiB (32 layers x K,V x 16 tokens x 8 KV heads x 128, bf16); every block is one
contiguous copy. Demotion is `HostKVCache.demote` per block (what `BlockManager` calls when it
reuses a cached block); promotion is `HostKVCache.allocate` on a prompt whose hash chain is in
the pool (the admission path: fresh device blocks, one copy each on the side stream, then
`wait()` before the step). Bandwidth counts bytes once. Overlap: a bf16 GEMM loop about as long
as the promotion, alone, then launched on the compute stream right after the promotion's copies
were queued; overlap = (compute + promote - both) / min(compute, promote) (1.0: fully hidden).
After the round trip every promoted block must equal the block that was demoted (byte_exact).

    python -m benchmarks.gpu.kv_tier --device cuda --out DIR        # writes DIR/kv_tier.json
    python -m benchmarks.gpu.kv_tier --device cpu --quick --out DIR # the dry run
"""

from __future__ import annotations

import time

import torch

from benchmarks.gpu.common import log, section_args, stats, sync, timed, write_json
from engine.kv_cache import BlockManager, KVCache, KVCacheSpec, hash_block
from engine.kv_host_cache import HostKVCache

LLAMA3_8B_KV = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
QUICK_KV = dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
REPS = 5


def make_tier(device: torch.device, quick: bool, blocks: int):
    spec = KVCacheSpec(model="LlamaForCausalLM", dtype=torch.bfloat16,
                       **(QUICK_KV if quick else LLAMA3_8B_KV))  # fmt: skip
    cache = KVCache(spec, 2 * blocks, device)
    cache.data.uniform_(-100, 100)  # distinct bytes per block: a misplaced copy shows
    bm = BlockManager(2 * blocks, spec.block_size)
    host = HostKVCache(cache, bm, (blocks + 1) * KVCache.bytes_per_block(spec))
    return spec, cache, bm, host


def chain(n_blocks: int, bs: int, seed: int) -> tuple[list[int], list[tuple], list[int]]:
    """A prompt of n_blocks whole blocks plus one token, its chunks and their hash chain."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 30000, (n_blocks * bs + 1,), generator=g).tolist()
    chunks = [tuple(ids[i * bs : (i + 1) * bs]) for i in range(n_blocks)]
    hashes, prev = [], None
    for c in chunks:
        prev = hash_block(prev, c)
        hashes.append(prev)
    return ids, chunks, hashes


def round_trip(cache, bm, host, n: int, seed: int, device) -> dict:
    """Demote blocks 0..n-1 into the pool, then promote them back through admission."""
    ids, chunks, hashes = chain(n, cache.spec.block_size, seed)
    reference = cache.data[:n].clone()
    sync(device)
    t0 = time.perf_counter()
    for bid in reversed(range(n)):  # tail first, as BlockManager evicts a freed sequence
        host.demote(bid, hashes[bid], chunks[bid])
    host.synchronize()
    sync(device)
    t_demote = time.perf_counter() - t0
    cache.data[:n].zero_()  # the promotion must bring every byte back, wherever it lands
    t0 = time.perf_counter()
    table, cached, _ = host.allocate(ids)
    host.wait()
    sync(device)
    t_promote = time.perf_counter() - t0
    exact = cached == n * cache.spec.block_size and all(
        torch.equal(cache.data[table[i]], reference[i]) for i in range(n)
    )
    cache.data[:n].copy_(reference)
    bm.free(table)
    host.clear()  # the next repeat demotes the same hashes anew
    return {"demote_s": t_demote, "promote_s": t_promote, "exact": exact}


def overlap(cache, bm, host, n: int, device) -> dict | None:
    if device.type != "cuda":
        return None
    ids, chunks, hashes = chain(n, cache.spec.block_size, 99)
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)

    def compute(k):
        for _ in range(k):
            a @ a

    t_one = stats(timed(lambda: compute(1), device, 5))["min"]
    iters = max(1, int(0.02 / t_one))  # ~20 ms of GEMMs
    t_compute = stats(timed(lambda: compute(iters), device, 3))["min"]

    def promote(with_compute: bool):
        for bid in reversed(range(n)):
            host.demote(bid, hashes[bid], chunks[bid])
        host.synchronize()
        sync(device)
        t0 = time.perf_counter()
        table, _, _ = host.allocate(ids)
        if with_compute:
            compute(iters)  # queued on the compute stream while the side stream copies
        host.wait()
        sync(device)
        dt = time.perf_counter() - t0
        bm.free(table)
        host.clear()
        return dt

    t_promote = min(promote(False) for _ in range(3))
    t_both = min(promote(True) for _ in range(3))
    hidden = (t_compute + t_promote - t_both) / min(t_compute, t_promote)
    return {"compute_s": t_compute, "promote_s": t_promote, "both_s": t_both,
            "overlap": round(hidden, 3)}  # fmt: skip


def pinned_copy(nbytes: int, device: torch.device) -> dict:
    """One contiguous copy each way between pinned host memory and the device."""
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = stats(timed(lambda: dev.copy_(host, non_blocking=True), device, REPS))["min"]
    d2h = stats(timed(lambda: host.copy_(dev, non_blocking=True), device, REPS))["min"]
    return {"h2d_gb_per_s": nbytes / h2d / 1e9, "d2h_gb_per_s": nbytes / d2h / 1e9}


def main(argv=None) -> None:
    args, device = section_args(__doc__, argv)
    n = 64 if args.quick else 512  # 1 GiB of 8B-shaped KV per direction on the device
    spec, cache, bm, host = make_tier(device, args.quick, n)
    nbytes = n * host.block_bytes
    log(f"kv_tier: {n} blocks of {host.block_bytes} bytes, {nbytes / 2**30:.2f} GiB")
    base = pinned_copy(nbytes, device)
    trips = [round_trip(cache, bm, host, n, seed, device) for seed in range(REPS + 1)][1:]
    demote = nbytes / min(t["demote_s"] for t in trips) / 1e9
    promote = nbytes / min(t["promote_s"] for t in trips) / 1e9
    result = {
        "device": str(device),
        "block_bytes": host.block_bytes,
        "blocks": n,
        "pinned": device.type == "cuda" and host.data.is_pinned(),
        "pinned_copy": base,
        "demote_gb_per_s": demote,
        "promote_gb_per_s": promote,
        "demote_vs_copy": demote / base["d2h_gb_per_s"],
        "promote_vs_copy": promote / base["h2d_gb_per_s"],
        "byte_exact": all(t["exact"] for t in trips),
        "promote_overlap": overlap(cache, bm, host, n, device),
        "every_block_freed": bm.num_free_blocks == len(bm.blocks),
    }
    log(f"kv_tier: demote {demote:.1f} GB/s, promote {promote:.1f} GB/s; "
        f"pinned copy d2h {base['d2h_gb_per_s']:.1f}, h2d {base['h2d_gb_per_s']:.1f}")  # fmt: skip
    write_json(args.out, "kv_tier.json", result)


if __name__ == "__main__":
    main()
