"""KV-block transfer bandwidth over NIXL between two OS processes, against a plain copy of the
same bytes on the same device, measured in the same run.

The sender is a child process (`benchmarks.gpu.nixl_peer`), the receiver this process; both
are tandem's real `KVTransferAgent` over real `KVCache`s (block-major layout). On `--device
cuda` the caches are shaped like Llama-3-8B in bf16 (32 layers, 8 KV heads, head_dim 128,
16-token blocks: 2 MiB per block, 1024 blocks = 2 GiB per cache) and live in VRAM (UCX should
pick cuda_ipc); `--quick` on CPU uses 2 layers and 256 blocks of 128 KiB in DRAM (UCX: cma).

One timed READ is the whole request path, wall clock: start_read -> ReadDone (chunked READs,
the sender's lease confirmation on the side channel) -> torch.cuda.synchronize(). Each size is
read once untimed (reported as first_seconds), then `repeats` times interleaved with a torch
copy of the same bytes between two buffers on the device (synced the same way), so a noisy
neighbour slows both alike. Bandwidth counts bytes once (bytes moved / seconds). The ratio is
best NIXL over best copy at the size where NIXL peaks; goal 0.70. Connection setup (handshake
plus the agent's 1-block warm-up READ, UCX's wire-up) is timed separately by connect().
Afterwards the received blocks are hashed against the sender's (byte_exact).

    python -m benchmarks.gpu.nixl_bandwidth --device cuda --out nixl.json
    python -m benchmarks.gpu.nixl_bandwidth --device cpu --quick --out /tmp/nixl.json

UCX_* variables are passed through (e.g. UCX_PROTO_INFO=y shows the transport chosen).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from benchmarks.gpu.common import python_profile
from benchmarks.gpu.nixl_peer import blocks_sha256, make_spec
from engine.kv_cache import KVCache
from kv_transfer.agent import KVTransferAgent
from kv_transfer.messages import ReadDone

REPO = Path(__file__).resolve().parents[2]
GOAL = 0.70
LLAMA3_8B_KV = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
QUICK_KV = dict(num_layers=2, num_kv_heads=8, head_dim=128, block_size=16)
# (kv spec, blocks per cache, blocks per read, timed repeats)
FULL = (LLAMA3_8B_KV, 1024, (64, 256, 1024), 5)
QUICK = (QUICK_KV, 256, (16, 64, 256), 3)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Peer:
    """The sender process; one JSON line per command on stdin, "@@{json}" answers on stdout."""

    def __init__(self, cfg: dict):
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path)
        # stderr is inherited: the sender's errors and UCX's logs stay visible.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.gpu.nixl_peer", json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env,
        )  # fmt: skip
        self._lines: queue.Queue[str] = queue.Queue()
        # A reader thread, so a dead or stuck sender turns into a timeout, not a hang.
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self._lines.put(line[2:])
        self._lines.put("")

    def answer(self, timeout: float = 60.0) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"the sender did not answer within {timeout}s") from None
        if not line:
            raise RuntimeError(f"the sender exited with {self.proc.wait()}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"sender: {out['error']}")
        return out

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def call(self, timeout: float = 60.0, **cmd) -> dict:
        self.send(**cmd)
        return self.answer(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="quit", timeout=10)
            except (RuntimeError, OSError):
                self.proc.kill()
        self.proc.wait(timeout=10)


class Bench:
    """This process as the receiver: its cache, its agent, and a copy target for the baseline."""

    def __init__(self, device: torch.device, spec_fields: dict, num_blocks: int, peer: Peer,
                 max_read_bytes: int | None):  # fmt: skip
        self.device, self.peer = device, peer
        self.cache = KVCache(make_spec(spec_fields), num_blocks, device=device)
        self.block_bytes = KVCache.bytes_per_block(self.cache.spec)
        self.copy_dst = torch.empty_like(self.cache.data)  # same bytes, same device
        kw = {} if max_read_bytes is None else {"max_read_bytes": max_read_bytes}
        t = time.perf_counter()
        name = f"nixl-bw-rcv-{os.getpid()}"
        self.agent = KVTransferAgent(name, self.cache, lease_seconds=60.0, **kw)
        self.agent_seconds = time.perf_counter() - t  # registration of the cache with NIXL
        self.mem_type = self.agent.metadata()["mem_type"]
        # How the agent splits a read into READs (kv_transfer.receiver, max_read_bytes).
        self.blocks_per_chunk = max(1, self.agent.max_read_bytes // self.block_bytes)
        self._n = 0

    def connect(self, sender_md: dict) -> float:
        """Seconds of the handshake, including the 1-block warm-up READ (UCX's wire-up)."""
        self.sender = sender_md["name"]
        t = time.perf_counter()
        self.agent.connect(sender_md)
        return time.perf_counter() - t

    def read_once(self, ids: list[int]) -> tuple[float, dict]:
        """(wall seconds start_read -> ReadDone -> synced, where that wall went: the agent's
        landing and lease-confirmation times, and when our poll saw ReadDone)."""
        self._n += 1
        rid = f"bw-{self._n}"
        deadline = self.peer.call(op="hold", rid=rid, blocks=ids, peer=self.agent.name)["deadline"]
        sync(self.device)  # nothing of ours still queued when the clock starts
        t = time.perf_counter()
        self.agent.start_read(rid, self.sender, ids, ids, deadline)
        posted = time.perf_counter() - t  # the ids checked and the first chunk posted
        ev = self._wait(rid, timeout=30.0)
        seen = time.perf_counter() - t
        sync(self.device)  # the READ's copy is on UCX's stream: make sure it is visible here
        wall = time.perf_counter() - t
        if not isinstance(ev, ReadDone):
            raise RuntimeError(f"READ of {len(ids)} blocks failed: {ev}")
        # Untimed: the sender frees the blocks (NIXL notification) before they are held again.
        self.peer.call(op="wait_released", rid=rid, timeout=30.0)
        parts = {"posted": posted, "landed": ev.seconds, "confirmed": ev.confirmed_s, "seen": seen}
        return wall, parts

    def _wait(self, rid: str, timeout: float):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for ev in self.agent.poll():
                if ev.request_id == rid:
                    return ev
            # Short sleep, not a spin: a spinning loop holds the GIL and the side-channel
            # thread (the lease confirmation) would wait a whole switch interval (5 ms).
            time.sleep(20e-6)
        raise RuntimeError(f"no ReadDone for {rid} within {timeout}s")

    def copy_once(self, n: int) -> float:
        src, dst = self.cache.data[:n], self.copy_dst[:n]
        sync(self.device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(self.device)
        return time.perf_counter() - t


def measure(bench: Bench, n: int, repeats: int) -> dict:
    """One size: an untimed first read, then NIXL and copy interleaved, then the hash check."""
    ids = list(range(n))  # contiguous: NIXL merges adjacent descriptors, as in a fresh cache
    nbytes = n * bench.block_bytes
    first, _ = bench.read_once(ids)
    bench.copy_once(n)
    bench.cache.data[:n].zero_()  # so the check below proves the timed reads moved the bytes
    walls, parts, copies = [], [], []
    for _ in range(repeats):
        wall, inner = bench.read_once(ids)
        walls.append(wall)
        parts.append(inner)
        copies.append(bench.copy_once(n))
    agent_s = [p["landed"] for p in parts]
    bench.peer.send(op="hash", blocks=ids)  # the sender hashes its blocks while we hash ours
    ours = blocks_sha256(bench.cache, ids)
    theirs = bench.peer.answer(timeout=120.0)["sha256"]
    best, med, cbest = min(walls), statistics.median(walls), min(copies)
    return {
        "blocks": n, "bytes": nbytes, "seconds": best, "seconds_median": med,
        "gb_per_s": nbytes / best / 1e9, "gb_per_s_median": nbytes / med / 1e9,
        "first_seconds": first, "agent_seconds_best": min(agent_s),
        "copy_seconds": cbest, "copy_gb_per_s": nbytes / cbest / 1e9,
        "copy_gb_per_s_median": nbytes / statistics.median(copies) / 1e9,
        "ratio": (nbytes / best) / (nbytes / cbest), "byte_exact": ours == theirs,
        "chunks": -(-n // bench.blocks_per_chunk), "samples_seconds": walls,
        "copy_samples_seconds": copies,
        # Per sample: start_read returned, ReadDone seen by our poll (from our clock's start);
        # READ landed, lease confirmed (from the agent's start, after the ids are checked);
        # the wall adds the final device sync.
        "wall_parts": parts,
    }  # fmt: skip


def profile_read(bench: Bench, n: int) -> dict:
    """One more read of `n` blocks under cProfile: where this thread's time goes between
    start_read and ReadDone (the status checks, the handle release, the lease's lock)."""
    out = {}

    def read():
        out["wall"], out["parts"] = bench.read_once(list(range(n)))

    prof = python_profile(read)
    return {"blocks": n, **out, **prof}


def machine(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
            "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")}}  # fmt: skip
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        info["nixl"] = importlib.metadata.version("nixl")
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def run(device: torch.device, quick: bool, max_read_bytes: int | None) -> dict:
    spec_fields, num_blocks, sizes, repeats = QUICK if quick else FULL
    peer = Peer({"name": f"nixl-bw-snd-{os.getpid()}", "device": str(device),
                 "num_blocks": num_blocks, "spec": spec_fields, "seed": 1234})  # fmt: skip
    bench = None
    try:
        # Built while the sender process starts up (imports, cache, agent): they overlap.
        bench = Bench(device, spec_fields, num_blocks, peer, max_read_bytes)
        sender_md = peer.answer(timeout=120.0)["metadata"]
        connect_s = bench.connect(sender_md)
        reads = [measure(bench, n, repeats) for n in sizes]
        poll_profile = profile_read(bench, sizes[-1])
    finally:
        if bench is not None:
            bench.agent.close()
        peer.close()
    top = max(reads, key=lambda r: r["gb_per_s"])
    ratio = top["gb_per_s"] / top["copy_gb_per_s"]
    return {
        "benchmark": "nixl_bandwidth", "device": device.type, "quick": quick,
        "mem_type": bench.mem_type, "sender_mem_type": sender_md["mem_type"],
        "kv_spec": {**spec_fields, "dtype": "bfloat16"}, "num_blocks": num_blocks,
        "block_bytes": bench.block_bytes, "blocks_per_read": list(sizes), "repeats": repeats,
        "max_read_bytes": bench.agent.max_read_bytes,
        "setup": {"receiver_agent_seconds": bench.agent_seconds, "connect_seconds": connect_s,
                  "first_read": {"blocks": reads[0]["blocks"],
                                 "seconds": reads[0]["first_seconds"]}},
        "reads": reads, "poll_profile": poll_profile,
        "best_gb_per_s": top["gb_per_s"], "best_blocks": top["blocks"],
        "copy_gb_per_s": top["copy_gb_per_s"], "ratio": ratio, "goal": GOAL,
        "met": ratio >= GOAL, "byte_exact": all(r["byte_exact"] for r in reads),
        "machine": machine(device),
    }  # fmt: skip


def summary(r: dict) -> str:
    mib = r["block_bytes"] / 2**20
    lines = [
        f"NIXL READ, {r['sender_mem_type']} -> {r['mem_type']}, two processes, {mib:g} MiB "
        f"blocks, best (median) of {r['repeats']}; copy = torch copy on the same device",
        f"connect (handshake + warm-up READ) {r['setup']['connect_seconds'] * 1e3:.1f} ms; "
        f"first read of {r['setup']['first_read']['blocks']} blocks "
        f"{r['setup']['first_read']['seconds'] * 1e3:.2f} ms",
        f"{'blocks':>7} {'MiB':>7} {'NIXL GB/s':>18} {'copy GB/s':>18} {'ratio':>6} {'chunks':>6}",
    ]
    for x in r["reads"]:
        lines.append(
            f"{x['blocks']:>7} {x['bytes'] / 2**20:>7.0f} {x['gb_per_s']:>8.2f} "
            f"({x['gb_per_s_median']:>7.2f}) {x['copy_gb_per_s']:>8.2f} "
            f"({x['copy_gb_per_s_median']:>7.2f}) {x['ratio']:>6.0%} {x['chunks']:>6}"
        )
    verdict = "met" if r["met"] else "missed"
    lines.append(
        f"best {r['best_gb_per_s']:.2f} GB/s at {r['best_blocks']} blocks = {r['ratio']:.0%} of "
        f"copy (goal {r['goal']:.0%}: {verdict}); byte-exact: {r['byte_exact']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", required=True, choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="small caches (the CPU test mode)")
    ap.add_argument("--out", required=True, help="path of the JSON result")
    ap.add_argument("--max-read-mb", type=float, help="agent's max_read_bytes in MiB")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(1)  # one copy thread against NIXL's one copy stream (UCX cma)
    mrb = None if args.max_read_mb is None else int(args.max_read_mb * 2**20)
    result = run(device, args.quick, mrb)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(summary(result))
    print(f"wrote {out}")
    return 0 if result["byte_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
