"""The sender half of `benchmarks.gpu.nixl_bandwidth`: a real `KVCache` (filled with seeded
random bytes) and a real `KVTransferAgent` in their own OS process, so the READs measured by
the parent cross a process boundary as they do between a prefill and a decode worker.

The parent drives it over stdin/stdout with one JSON object per line; each answer is one line
"@@{json}" (other stdout lines, e.g. a library's banner, are skipped). JSON here is only a
local control pipe, never pickle; the KV itself moves only through NIXL.

    python -m benchmarks.gpu.nixl_peer '{"name": "snd", "device": "cuda", "num_blocks": 1024,
                                         "spec": {"num_layers": 32, ...}, "seed": 0}'

Commands: hold {rid, blocks, peer} -> {deadline}; wait_released {rid} -> {reason} (once the
agent reported the lease released); hash {blocks} -> {sha256}; quit.
"""

from __future__ import annotations

import hashlib
import json
import select
import sys
import time

import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer.agent import KVTransferAgent
from kv_transfer.messages import Released

HASH_CHUNK_BLOCKS = 64  # blocks copied to the host per step while hashing (bounds the copy)


def make_spec(fields: dict) -> KVCacheSpec:
    """A bf16 Llama KV layout from plain fields (both processes build it from the same dict)."""
    return KVCacheSpec(model="LlamaForCausalLM", dtype=torch.bfloat16, **fields)


def blocks_sha256(cache: KVCache, block_ids: list[int]) -> str:
    """One SHA-256 over the bytes of `block_ids`, in that order (data, then FP8 scales)."""
    h = hashlib.sha256()
    for i in range(0, len(block_ids), HASH_CHUNK_BLOCKS):
        ids = torch.tensor(block_ids[i : i + HASH_CHUNK_BLOCKS], device=cache.device)
        for t in (cache.data, cache.scales):
            if t is not None:
                h.update(t.index_select(0, ids).cpu().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def fill(cache: KVCache, seed: int) -> None:
    """Random bytes in every block, generated on the cache's own device (no 2 GiB host copy)."""
    g = torch.Generator(device=cache.device).manual_seed(seed)
    cache.data.view(torch.uint8).random_(0, 256, generator=g)
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)


def reply(obj: dict) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(agent: KVTransferAgent, cache: KVCache) -> None:
    """The worker-like loop: poll() every iteration (it turns NIXL notifications into
    Released events), answer one command at a time."""
    released: dict[str, str] = {}  # rid -> release reason
    waiting: str | None = None
    while True:
        for ev in agent.poll():
            if isinstance(ev, Released):
                released[ev.request_id] = ev.reason
        if waiting is not None:
            if waiting not in released:
                time.sleep(0.0002)  # releases the GIL for the side-channel thread
                continue
            reply({"reason": released.pop(waiting)})
            waiting = None
        # A 1 ms select also releases the GIL, so renewals are answered while we wait here.
        if not select.select([sys.stdin], [], [], 0.001)[0]:
            continue
        line = sys.stdin.readline()
        if not line:
            return
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "hold":
            reply({"deadline": agent.hold(cmd["rid"], cmd["blocks"], cmd["peer"])})
        elif op == "wait_released":
            waiting = cmd["rid"]
        elif op == "hash":
            reply({"sha256": blocks_sha256(cache, cmd["blocks"])})
        elif op == "quit":
            reply({"ok": True})
            return
        else:
            reply({"error": f"unknown op {op!r}"})


def main() -> None:
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)  # the parent times a copy on the same cores: keep this one quiet
    cache = KVCache(make_spec(cfg["spec"]), cfg["num_blocks"], device=cfg["device"])
    fill(cache, cfg.get("seed", 0))
    # A long lease: a slow hash or a busy box between commands must not expire a hold.
    agent = KVTransferAgent(cfg["name"], cache, lease_seconds=60.0)
    try:
        reply({"metadata": agent.metadata()})
        serve(agent, cache)
    finally:
        agent.close()


if __name__ == "__main__":
    main()
