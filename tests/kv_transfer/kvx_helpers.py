"""Test helpers: a peer process handle and a worker-like wrapper around an in-process agent."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer.agent import KVTransferAgent
from kv_transfer.messages import ReadDone, ReadFailed, Released

ROOT = Path(__file__).resolve().parents[2]
PEER_SCRIPT = Path(__file__).with_name("peer_proc.py")


def spec(**kw) -> KVCacheSpec:
    return KVCacheSpec(
        model=kw.get("model", "LlamaForCausalLM"),
        num_layers=kw.get("num_layers", 2),
        num_kv_heads=kw.get("num_kv_heads", 2),
        head_dim=kw.get("head_dim", 64),
        block_size=kw.get("block_size", 16),
        dtype=torch.bfloat16,
        kv_dtype=kw.get("kv_dtype", "auto"),
    )


class PeerProcess:
    """A worker stand-in in another OS process (see peer_proc.py)."""

    def __init__(self, name: str, num_blocks: int, agent: dict | None = None, **spec_kw):
        cfg = {"name": name, "num_blocks": num_blocks, "agent": agent or {}, **spec_kw}
        # The repo first, then whatever the caller's path holds (packages installed to a
        # private folder on the GPU machine).
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path)
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        hello = self._read(60)
        self.metadata = hello["metadata"]
        self.name = name

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self._lines.put(line[2:])
        self._lines.put("")

    def _read(self, timeout: float) -> dict:
        line = self._lines.get(timeout=timeout)
        if not line:
            raise RuntimeError(f"peer process exited with {self.proc.wait()}")
        return json.loads(line)

    def call(self, op: str, timeout: float = 30, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        out = self._read(timeout)
        return out

    def wait_events(self, n: int, timeout: float) -> list[dict]:
        got: list[dict] = []
        end = time.monotonic() + timeout
        while len(got) < n and time.monotonic() < end:
            got += self.call("events")["events"]
            if len(got) < n:
                time.sleep(0.02)
        return got

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def freeze(self, timeout: float = 5.0) -> None:
        """SIGSTOP, and wait until every thread is really stopped (delivery is asynchronous)."""
        self.kill(signal.SIGSTOP)
        task_dir = Path(f"/proc/{self.proc.pid}/task")
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            states = []
            for stat in task_dir.glob("*/stat"):
                try:
                    states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
                except (OSError, IndexError):
                    continue
            if states and all(st in ("T", "t") for st in states):
                return
            time.sleep(0.005)
        raise RuntimeError(f"peer {self.name} did not stop")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit", timeout=10)
            except (RuntimeError, OSError, queue.Empty) as e:
                print(f"peer {self.name} did not quit cleanly ({e}); killing it")
            self.kill()
        self.proc.wait(timeout=10)


class LocalWorker:
    """An in-process agent with a worker's loop duties: free list, poll, event log."""

    def __init__(
        self, name: str, num_blocks: int, agent: dict | None = None, device: str = "cpu", **spec_kw
    ):
        self.cache = KVCache(spec(**spec_kw), num_blocks, device=device)
        self.agent = KVTransferAgent(name, self.cache, **(agent or {}))
        self.free = list(range(num_blocks))
        self.events: list = []

    def alloc(self, n: int) -> list[int]:
        picked = self.free[1::2][:n]  # non-contiguous, and different from the peer's pattern
        if len(picked) < n:
            rest = [b for b in self.free if b not in set(picked)]
            picked += rest[: n - len(picked)]
        for b in picked:
            self.free.remove(b)
        return picked

    def poll(self) -> list:
        evs = self.agent.poll()
        for ev in evs:
            if isinstance(ev, Released):
                self.free.extend(ev.block_ids)
            elif isinstance(ev, ReadFailed):
                self.free.extend(ev.local_block_ids)
        self.events += evs
        return evs

    def wait_for(self, rid: str, timeout: float) -> ReadDone | ReadFailed | Released | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.poll()
            for ev in self.events:
                if ev.request_id == rid:
                    return ev
            time.sleep(0.002)
        return None

    def close(self) -> None:
        self.agent.close()
