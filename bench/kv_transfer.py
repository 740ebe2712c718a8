"""`tandem bench kv-transfer`: NIXL READ bandwidth between two processes vs a torch copy.

The receiver is this process, the sender a child process (`python -m bench.kv_transfer
--sender CFG`) driven over its stdin/stdout with one JSON line per command (a local control
pipe; the KV itself moves only through NIXL). Both sides run real `KVTransferAgent`s over
KV caches laid out like the `small` preset (Llama, 8 layers, 4 KV heads, head_dim 64, blocks
of 16 tokens: 128 KiB per bf16 block), so a timing covers the whole request path: start_read,
chunked READs, the sender's lease confirmation, and the NIXL notification.

    tandem bench kv-transfer --size-mb 64 --json   one JSON object (size_mb, nixl_gbps, ...)
    tandem bench kv-transfer                       table over 1-256 MB + 512-token latency

The flags are generated from `KVBenchConfig`. kv_transfer/ itself stays runtime-only; this
module only drives its public agent.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.config_flags import add_flags, setting, values_from_args

# The `small` preset's KV shape (tools/make_model.py, llama/small).
SMALL = {
    "model": "LlamaForCausalLM",
    "num_layers": 8,
    "num_kv_heads": 4,
    "head_dim": 64,
    "block_size": 16,
}
TABLE_SIZES_MB = (1, 4, 16, 64, 256)
REQUEST_TOKENS = 512
JSON_SIZE_MB = 64.0  # the one size --json measures when --size-mb is not given


@dataclass(slots=True)
class KVBenchConfig:
    """One `tandem bench kv-transfer` run; each field is also its flag (`--size-mb`, ...)."""

    size_mb: float | None = setting(
        None, f"transfer size for --json ({JSON_SIZE_MB:g} if unset); added to the table otherwise"
    )
    json: bool = setting(False, "print one JSON object")
    repeats: int = setting(5, "timed transfers per size")
    kv_dtype: str = setting("auto", "KV cache dtype (auto = bf16)", choices=("auto", "fp8_e4m3"))
    max_read_mb: float = setting(64.0, "largest single NIXL READ (the agent's max_read_bytes)")

    def sizes_mb(self) -> list[float]:
        """The transfer sizes to measure: one for --json, else the table plus --size-mb."""
        if self.json:
            return [self.size_mb if self.size_mb is not None else JSON_SIZE_MB]
        return sorted(set(TABLE_SIZES_MB) | ({self.size_mb} if self.size_mb else set()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, KVBenchConfig)


def _spec(kv_dtype: str) -> Any:
    from engine.kv_cache import KVCacheSpec

    return KVCacheSpec(dtype=torch.bfloat16, kv_dtype=kv_dtype, **SMALL)


def run(args: argparse.Namespace) -> int:
    from engine.kv_cache import KVCache

    cfg = KVBenchConfig(**values_from_args(KVBenchConfig, args))
    if cfg.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    # memcpy is one thread, as NIXL's READ is one stream; torch's multi-threaded copy would
    # also leave OpenMP workers spinning on a core the NIXL copy needs.
    torch.set_num_threads(1)
    spec = _spec(cfg.kv_dtype)
    per_block = KVCache.bytes_per_block(spec)
    sizes = cfg.sizes_mb()
    if any(s <= 0 for s in sizes):
        raise SystemExit("--size-mb must be > 0")
    req_blocks = -(-REQUEST_TOKENS // spec.block_size)
    max_blocks = max(max(_blocks(s, per_block) for s in sizes), 2 * req_blocks)
    bench = _Bench(spec, max_blocks + 1, cfg.kv_dtype, int(cfg.max_read_mb * (1 << 20)))
    try:
        rows = [_measure_size(bench, size, per_block, cfg.repeats) for size in sizes]
        request = _measure_request(bench, req_blocks, per_block, cfg.repeats)
    finally:
        bench.close()
    meta = {
        "kv_dtype": cfg.kv_dtype,
        "block_bytes": per_block,
        "memcpy_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "mem_type": "DRAM",
        "repeats": cfg.repeats,
    }
    if cfg.json:
        print(json.dumps({**rows[0], "request_512": request, **meta}))
    else:
        _print_table(cfg, per_block, rows, request)
    return 0


def _measure_size(bench: _Bench, size: float, per_block: int, repeats: int) -> dict[str, Any]:
    """NIXL and memcpy bandwidth for one transfer of `size` MB of whole blocks."""
    n = _blocks(size, per_block)
    nbytes = n * per_block
    ids = list(range(n))
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    bench.read_once(ids)  # untimed: faults pages in on both sides
    dst.copy_(src)
    nixl_s, copy_s = [], []
    # Interleaved, so a noisy neighbour slows both measurements alike.
    for _ in range(repeats):
        nixl_s.append(bench.read_once(ids))
        copy_s.append(_copy_once(src, dst))
    return {
        "size_mb": size,
        "bytes": nbytes,
        "blocks": n,
        "nixl_gbps": nbytes / statistics.median(nixl_s) / 1e9,
        "nixl_gbps_best": nbytes / min(nixl_s) / 1e9,
        "memcpy_gbps": nbytes / statistics.median(copy_s) / 1e9,
        "memcpy_gbps_best": nbytes / min(copy_s) / 1e9,
    }


def _measure_request(
    bench: _Bench, req_blocks: int, per_block: int, repeats: int
) -> dict[str, Any]:
    """One request's KV at REQUEST_TOKENS tokens, on every other block (a fragmented cache)."""
    req_ids = list(range(0, 2 * req_blocks, 2))
    bench.read_once(req_ids)
    lat = [bench.read_once(req_ids) for _ in range(max(10, repeats))]
    return {
        "tokens": REQUEST_TOKENS,
        "blocks": req_blocks,
        "bytes": req_blocks * per_block,
        "latency_ms_median": statistics.median(lat) * 1e3,
        "latency_ms_best": min(lat) * 1e3,
    }


def _print_table(
    cfg: KVBenchConfig, per_block: int, rows: list[dict[str, Any]], request: dict[str, Any]
) -> None:
    print(
        f"KV transfer, {cfg.kv_dtype} KV of the small preset ({per_block // 1024} KiB/block), "
        f"DRAM, median of {cfg.repeats} (best in brackets)"
    )
    print(f"{'size MB':>8} {'blocks':>7} {'NIXL GB/s':>16} {'memcpy GB/s':>16} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['size_mb']:>8g} {r['blocks']:>7} "
            f"{r['nixl_gbps']:>7.2f} ({r['nixl_gbps_best']:>6.2f}) "
            f"{r['memcpy_gbps']:>7.2f} ({r['memcpy_gbps_best']:>6.2f}) "
            f"{r['nixl_gbps'] / r['memcpy_gbps']:>6.0%}"
        )
    print(
        f"one {REQUEST_TOKENS}-token request: {request['blocks']} blocks, "
        f"{request['bytes'] / (1 << 20):.2f} MiB, latency {request['latency_ms_median']:.2f} ms "
        f"median ({request['latency_ms_best']:.2f} best)"
    )


def _blocks(size_mb: float, per_block: int) -> int:
    return max(1, round(size_mb * (1 << 20) / per_block))


def _copy_once(src: torch.Tensor, dst: torch.Tensor) -> float:
    """Plain torch copy between two resident buffers."""
    t = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t


class _Bench:
    """This process as the receiver; a child process as the sender."""

    def __init__(self, spec: Any, num_blocks: int, kv_dtype: str, max_read_bytes: int) -> None:
        from engine.kv_cache import KVCache
        from kv_transfer.agent import KVTransferAgent

        cfg = {"num_blocks": num_blocks, "kv_dtype": kv_dtype, "name": f"bench-snd-{os.getpid()}"}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.kv_transfer", "--sender", json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=root,
            env=env,
        )
        self.sender = self._reply()["metadata"]
        self.cache = KVCache(spec, num_blocks)
        self.cache.data.view(torch.uint8).fill_(0)
        self.agent = KVTransferAgent(
            f"bench-rcv-{os.getpid()}",
            self.cache,
            lease_seconds=60.0,
            max_read_bytes=max_read_bytes,
        )
        self.agent.connect(self.sender)
        self._n = 0

    def _reply(self) -> dict[str, Any]:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"benchmark sender exited ({self.proc.wait()})")
            if line.startswith("@@"):
                return json.loads(line[2:])

    def _call(self, **cmd: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def read_once(self, block_ids: list[int]) -> float:
        """Seconds from start_read to ReadDone for one request reading `block_ids`."""
        self._n += 1
        rid = f"bench-{self._n}"
        deadline = self._call(op="hold", rid=rid, blocks=block_ids, peer=self.agent.name)[
            "deadline"
        ]
        t = time.perf_counter()
        self.agent.start_read(rid, self.sender["name"], block_ids, block_ids, deadline)
        while True:
            done = [e for e in self.agent.poll() if e.request_id == rid]
            if done:
                break
            # A worker loop does other work between polls; spinning here would hold the GIL
            # and delay the side-channel thread's lease confirmation by a switch interval.
            time.sleep(0.0001)
        elapsed = time.perf_counter() - t
        failure = getattr(done[0], "reason", None)  # ReadFailed carries a reason
        if failure is not None:
            raise RuntimeError(f"benchmark READ failed: {failure}")
        self._call(op="wait_released", rid=rid)
        return elapsed

    def close(self) -> None:
        self.agent.close()
        if self.proc.poll() is None:
            try:
                self._call(op="quit")
            except (RuntimeError, OSError, ValueError):
                pass
            self.proc.kill()
        self.proc.wait(timeout=10)


def _sender_main(cfg: dict) -> int:
    from engine.kv_cache import KVCache
    from kv_transfer.agent import KVTransferAgent

    torch.set_num_threads(1)
    cache = KVCache(_spec(cfg["kv_dtype"]), cfg["num_blocks"])
    raw = cache.data.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    agent = KVTransferAgent(cfg["name"], cache, lease_seconds=60.0)
    released: set[str] = set()

    def reply(obj: dict) -> None:
        sys.stdout.write("@@" + json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"metadata": agent.metadata()})
    waiting: str | None = None
    try:
        while True:
            released.update(ev.request_id for ev in agent.poll())
            if waiting is not None and waiting in released:
                released.discard(waiting)
                waiting = None
                reply({"ok": True})
            if waiting is None and select.select([sys.stdin], [], [], 0.001)[0]:
                line = sys.stdin.readline()
                if not line:
                    return 0
                cmd = json.loads(line)
                if cmd["op"] == "hold":
                    reply({"deadline": agent.hold(cmd["rid"], cmd["blocks"], cmd["peer"])})
                elif cmd["op"] == "wait_released":
                    waiting = cmd["rid"]
                elif cmd["op"] == "quit":
                    reply({"ok": True})
                    return 0
    finally:
        agent.close()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--sender":
        sys.exit(_sender_main(json.loads(sys.argv[2])))
    parser = argparse.ArgumentParser(prog="python -m bench.kv_transfer")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
