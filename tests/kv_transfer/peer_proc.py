"""A worker stand-in in its own OS process, driven by the tests over stdin/stdout.

It owns a real KVCache and a real KVTransferAgent, runs a worker-like loop (poll() every
iteration, free blocks on Released/ReadFailed, a free list like a block manager's) and answers
one JSON command per line with one line "@@{json}". `pause` stops the loop's poll() calls
(a worker stuck in a long step) while commands are still answered, so a test can kill it with
a READ genuinely in flight. JSON here is only the test's control channel, not tandem's wire.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer.agent import KVTransferAgent
from kv_transfer.messages import ReadDone, ReadFailed, Released


def make_spec(cfg: dict) -> KVCacheSpec:
    return KVCacheSpec(
        model=cfg.get("model", "LlamaForCausalLM"),
        num_layers=cfg.get("num_layers", 2),
        num_kv_heads=cfg.get("num_kv_heads", 2),
        head_dim=cfg.get("head_dim", 64),
        block_size=cfg.get("block_size", 16),
        dtype=torch.bfloat16,
        kv_dtype=cfg.get("kv_dtype", "auto"),
    )


def block_hashes(cache: KVCache, blocks: list[int]) -> list[str]:
    out = []
    for b in blocks:
        h = hashlib.sha256(cache.data[b].cpu().contiguous().view(torch.uint8).numpy().tobytes())
        if cache.scales is not None:
            h.update(cache.scales[b].cpu().contiguous().view(torch.uint8).numpy().tobytes())
        out.append(h.hexdigest())
    return out


def event_dict(ev) -> dict:
    if isinstance(ev, Released):
        return {
            "kind": "released",
            "rid": ev.request_id,
            "blocks": list(ev.block_ids),
            "reason": ev.reason,
        }
    if isinstance(ev, ReadDone):
        return {"kind": "read_done", "rid": ev.request_id, "blocks": list(ev.local_block_ids)}
    assert isinstance(ev, ReadFailed)
    return {
        "kind": "read_failed",
        "rid": ev.request_id,
        "blocks": list(ev.local_block_ids),
        "reason": ev.reason,
    }


def main() -> None:
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    cache = KVCache(make_spec(cfg), cfg["num_blocks"], device=cfg.get("device", "cpu"))
    agent = KVTransferAgent(cfg["name"], cache, **cfg.get("agent", {}))
    free = list(range(cache.num_blocks))
    events: list[dict] = []
    paused_until = 0.0

    def reply(obj: dict) -> None:
        sys.stdout.write("@@" + json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"ready": True, "metadata": agent.metadata(), "pid": os.getpid()})
    while True:
        if time.monotonic() >= paused_until:
            for ev in agent.poll():
                events.append(event_dict(ev))
                if isinstance(ev, Released | ReadFailed):
                    blocks = ev.block_ids if isinstance(ev, Released) else ev.local_block_ids
                    free.extend(blocks)
        ready, _, _ = select.select([sys.stdin], [], [], 0.002)
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "fill":
                g = torch.Generator().manual_seed(cmd["seed"])
                raw = cache.data.view(torch.uint8)
                raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
                if cache.scales is not None:
                    cache.scales.copy_(torch.rand(cache.scales.shape, generator=g) + 0.01)
                if cache.device.type == "cuda":
                    torch.cuda.synchronize()
                reply({"ok": True})
            elif op == "alloc":
                # Every other free block: non-contiguous ids, like a fragmented block manager.
                n = cmd["n"]
                picked = free[::2][:n]
                if len(picked) < n:
                    picked += [b for b in free if b not in set(picked)][: n - len(picked)]
                for b in picked:
                    free.remove(b)
                reply({"blocks": picked})
            elif op == "free_count":
                reply({"free": len(free)})
            elif op == "hashes":
                reply({"hashes": block_hashes(cache, cmd["blocks"])})
            elif op == "write_kv":
                # Real engine writes (FP8: quantized with per-token scales) into given slots.
                g = torch.Generator().manual_seed(cmd["seed"])
                spec = cache.spec
                slots = torch.tensor(cmd["slots"], dtype=torch.int64, device=cache.device)
                for layer in range(spec.num_layers):
                    shape = (len(slots), spec.num_kv_heads, spec.head_dim)
                    k = (torch.randn(shape, generator=g) * 3).to(cache.device)
                    v = torch.randn(shape, generator=g).to(cache.device)
                    cache.write(layer, slots, k, v)
                reply({"ok": True})
            elif op == "gather_hash":
                h = hashlib.sha256()
                table = torch.tensor(cmd["blocks"], dtype=torch.int64, device=cache.device)
                for layer in range(cache.spec.num_layers):
                    k, v = cache.gather(layer, table, torch.float32)
                    h.update(k.cpu().numpy().tobytes())
                    h.update(v.cpu().numpy().tobytes())
                reply({"hash": h.hexdigest()})
            elif op == "hold":
                reply({"deadline": agent.hold(cmd["rid"], cmd["blocks"], cmd["peer"])})
            elif op == "connect":
                agent.connect(cmd["metadata"])
                reply({"ok": True})
            elif op == "allow":
                agent.set_allowed_peers(cmd["peers"])
                reply({"ok": True})
            elif op == "start_read":
                agent.start_read(
                    cmd["rid"],
                    cmd["peer"],
                    cmd["remote"],
                    cmd["local"],
                    cmd["deadline"],
                    sender_instance=cmd.get("sender_instance"),
                )
                paused_until = time.monotonic() + cmd.get("pause", 0.0)
                reply({"ok": True, "state": agent.transfer_state(cmd["rid"]).name})
            elif op == "state":
                st = agent.transfer_state(cmd["rid"])
                reply({"state": None if st is None else st.name})
            elif op == "abort":
                reply({"known": agent.abort(cmd["rid"], cmd.get("peer"))})
            elif op == "pause":
                paused_until = time.monotonic() + cmd["seconds"]
                reply({"ok": True})
            elif op == "events":
                reply({"events": events})
                events = []
            elif op == "stats":
                reply(agent.stats().to_dict() | {"held": agent.num_held()})
            elif op == "quit":
                agent.close()
                reply({"ok": True})
                return
            else:
                reply({"error": f"unknown op {op}"})
        except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
            reply({"error": f"{type(e).__name__}: {e}", "fields": list(getattr(e, "fields", ()))})


if __name__ == "__main__":
    main()
