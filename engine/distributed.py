"""Tensor parallelism inside one engine: its process group, the ranks rank 0 starts, and the
per-step plan they receive.

Rank 0 is the engine (scheduler, sampler, sockets); ranks 1..N-1 are processes it starts with
their own entry point (`python -m engine.distributed '<json>'`: the settings travel as JSON on
the command line, nothing is pickled). They meet at a TCPStore rank 0 opens on 127.0.0.1 and
form one process group, private to this engine (gloo on CPU, NCCL on CUDA; never the global
default group, so two engines in one process do not collide). Each rank loads only its shard
(engine.models.parallel) and holds a KV cache of its own KV heads, with the same block ids.

Each step rank 0 broadcasts the plan as plain int64 tensors: a 2-value header (command,
payload length), then the payload (`model_runner.pack_step`: token ids, positions, slots, the
attention metadata, block tables, and the block copies a fork made since the last step; the
tensor rank 0 unpacks itself, `unpack_step`); every rank runs
the forward pass (the row-parallel projections all-reduce), and rank 0 alone computes logits
and samples. A worker waits for the header without a deadline (an engine may idle for hours);
the payload and the all-reduces have `COLLECTIVE_TIMEOUT_S`.

Besides steps, rank 0 can run a function on the other ranks (`TPGroup.run_hook`, command
HOOK: a JSON request as int64 bytes on the broadcast, each rank's JSON answer in the store):
how kv_transfer registers every rank's KV with its own NIXL agent without engine/ importing
it (modules under `HOOK_PREFIXES` only).

Failure: before each step rank 0 checks that every rank's process is alive, and again every
`WAIT_SLICE_S` while it waits for a collective on CPU; a failed collective is reported the
same way: `TPError` naming the rank and its exit status; the engine
then refuses further steps. Workers die with rank 0 (PR_SET_PDEATHSIG) and exit when its
connection closes; `TPGroup.close` (LLMEngine.shutdown, and at exit) stops them, and kills
any that do not stop within `STOP_TIMEOUT_S`.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from engine.kv_setup import build_kv, kv_spec_for
from engine.model_runner import ModelRunner, forward_context, unpack_step

COLLECTIVE_TIMEOUT_S = float(os.environ.get("TANDEM_TP_TIMEOUT_S", "120"))
START_TIMEOUT_S = 600.0  # a rank loads its shard within this
# A rank answers a hook within this, or the group is down: a hung rank must not stall rank 0's
# loop for START_TIMEOUT_S (a decode group's READ orders are hooks).
HOOK_TIMEOUT_S = 30.0
# On CPU rank 0 waits for a collective in slices this long and checks its ranks' processes in
# between: gloo does not always notice a peer that was SIGKILLed (CI saw a broadcast to one
# wait out the whole COLLECTIVE_TIMEOUT_S), so a dead rank is named within a slice.
WAIT_SLICE_S = 0.5
WAIT_SLICE = timedelta(seconds=WAIT_SLICE_S)
STOP_TIMEOUT_S = 10.0
IDLE = timedelta(days=365)  # a worker's wait for the next step's header
STEP, STOP, HOOK = 1, 0, 2
# What a rank may run besides steps (`TPGroup.run_hook`): modules under these prefixes. A
# rank's KV memory is registered for transfer by kv_transfer (which engine/ must not import).
HOOK_PREFIXES = ("kv_transfer.",)
MAX_HOOK_BYTES = 1 << 20  # a decode rank's READ order names every block of a prompt


class TPError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the engine cannot step any more."""


class ProcessGroup:
    """This engine's group: gloo (CPU) or NCCL (CUDA), with broadcast and all-reduce."""

    def __init__(
        self,
        store,
        rank: int,
        size: int,
        device: torch.device,
        alive: Callable[[], None] | None = None,
    ):
        """`alive`: raises TPError when a rank has died (rank 0's check, run between the
        slices of a wait on CPU; see WAIT_SLICE_S)."""
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        self.rank, self.size, self.device, self.alive = rank, size, device, alive
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, timeout)

    def broadcast(self, t: torch.Tensor, timeout: timedelta | None = None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        if timeout is not None:
            opts.timeout = timeout
        self.wait(self.pg.broadcast([t], opts), timeout)

    def wait(self, work, timeout: timedelta | None = None) -> None:
        """Wait for a collective; on CPU with an `alive` check, in WAIT_SLICE_S slices with
        the check between them, up to `timeout` (default COLLECTIVE_TIMEOUT_S). A gloo wait
        that times out can be waited on again; other errors are raised at once."""
        if self.alive is None or self.device.type == "cuda":
            work.wait()
            return
        limit = timeout.total_seconds() if timeout is not None else COLLECTIVE_TIMEOUT_S
        deadline = time.monotonic() + limit
        while True:
            try:
                work.wait(WAIT_SLICE)
                return
            except RuntimeError as e:
                if "timed out" not in str(e).lower():
                    raise
                if time.monotonic() >= deadline:  # worded as gloo words its own deadline
                    ms = round(limit * 1000)
                    raise RuntimeError(f"Timed out waiting {ms}ms for the collective") from e
                self.alive()

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        if t.device.type == "cpu" and t.dtype not in (torch.float32, torch.float64):
            # gloo sums in the tensor's dtype; in fp32 the sum of two bf16 values rounds once,
            # as a bf16 add does.
            wide = t.float()
            self.wait(self.pg.allreduce([wide], opts))
            t.copy_(wide)
            return
        self.wait(self.pg.allreduce([t], opts))


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the thread that started it exits."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class TPGroup:
    """Rank 0's side: the worker processes, the store and the group."""

    def __init__(self, config, size: int, device: torch.device):
        self.size, self.device, self.broken, self.started = size, device, None, False
        self.hooks = 0  # run_hook calls so far: each answers under its own store keys
        self.store = dist.TCPStore(
            "127.0.0.1", 0, size, True, timedelta(seconds=START_TIMEOUT_S), wait_for_workers=False
        )
        settings = dataclasses.asdict(config)
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, size):
            spec = {"config": settings, "rank": rank, "size": size, "port": self.store.port}
            spec["parent"] = os.getpid()
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "engine.distributed", json.dumps(spec)],
                    preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                )
            )
        atexit.register(self.close)
        try:
            self._wait_for("up")
            self.group = ProcessGroup(self.store, 0, size, device, self.check_alive)
        except BaseException:
            self.close()
            raise

    def _wait_for(
        self, key: str, first_sleep_s: float = 0.02, timeout_s: float = START_TIMEOUT_S
    ) -> None:
        """Until every worker has set `key{rank}` in the store; TPError if one exits first.
        Sleeps start at `first_sleep_s` and double up to 20 ms (a hook's answer is quick)."""
        deadline = time.monotonic() + timeout_s
        keys = [f"{key}{r}" for r in range(1, self.size)]
        sleep_s = first_sleep_s
        while not self.store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                self.broken = f"ranks not {key} after {timeout_s:.0f} s"
                raise TPError(f"tensor-parallel group is down: {self.broken}")
            time.sleep(sleep_s)
            sleep_s = min(0.02, sleep_s * 2)

    def finish_start(self, num_blocks: int) -> None:
        """Tell the workers the KV block count and wait until each has its model and cache."""
        self.store.set("num_blocks", str(num_blocks))
        try:
            self._wait_for("ready")
            self.started = True
        except BaseException:
            self.close()
            raise

    def check_alive(self) -> None:
        if self.broken is not None:
            raise TPError(f"tensor-parallel group is down: {self.broken}")
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                self.broken = f"rank {rank} (pid {proc.pid}) exited with status {code}"
                raise TPError(f"tensor-parallel group is down: {self.broken}")

    def send_step(self, flat: torch.Tensor) -> None:
        self.check_alive()
        header = torch.tensor([STEP, flat.numel()], dtype=torch.int64)
        try:
            self.group.broadcast(header.to(self.device))
            self.group.broadcast(flat.to(self.device))
        except RuntimeError as e:
            self.failed(e)

    def run_hook(self, module: str, arg: dict) -> list[dict]:
        """Call `module.rank_hook(cache, rank, arg) -> dict` on ranks 1..N-1 and return their
        answers in rank order (the other ranks' share of something rank 0 sets up: their NIXL
        agents). Request and answers travel as JSON: the request as int64 bytes on the
        broadcast, the answers through the store."""
        if not module.startswith(HOOK_PREFIXES):
            raise ValueError(f"a rank hook must be under {HOOK_PREFIXES}, got {module!r}")
        self.check_alive()
        self.hooks += 1
        text = json.dumps({"module": module, "arg": arg, "key": f"hook{self.hooks}/"}).encode()
        if len(text) > MAX_HOOK_BYTES:
            raise ValueError(f"a rank hook's argument is over {MAX_HOOK_BYTES} bytes")
        payload = torch.tensor(list(text), dtype=torch.int64)
        limit = timedelta(seconds=HOOK_TIMEOUT_S)  # gloo waits for each rank to post its recv
        try:
            self.group.broadcast(torch.tensor([HOOK, len(text)]).to(self.device), limit)
            self.group.broadcast(payload.to(self.device), limit)
        except RuntimeError as e:
            self.failed(e)
        self._wait_for(f"hook{self.hooks}/", first_sleep_s=0.0002, timeout_s=HOOK_TIMEOUT_S)
        keys = [f"hook{self.hooks}/{r}" for r in range(1, self.size)]
        answers = [json.loads(self.store.get(k)) for k in keys]
        for k in keys:  # a decode group runs hooks per request: the store must not grow
            self.store.delete_key(k)
        for rank, answer in enumerate(answers, start=1):
            if "error" in answer:
                raise TPError(f"rank {rank}: {module}.rank_hook failed: {answer['error']}")
        return answers

    def failed(self, e: BaseException):
        """Raise TPError for a failed collective, naming a dead rank when there is one."""
        time.sleep(0.1)  # let a rank that just died be reaped
        try:
            self.check_alive()
        except TPError as dead:
            raise dead from e
        self.broken = f"collective failed: {e}"
        raise TPError(f"tensor-parallel group is down: {self.broken}") from e

    def close(self) -> None:
        """Stop every worker (a STOP header, then SIGKILL after STOP_TIMEOUT_S; a group that
        never finished starting is killed at once: its ranks may be inside a collective of
        the load); idempotent."""
        atexit.unregister(self.close)
        alive = all(p.poll() is None for p in self.procs)
        if self.started and self.broken is None and alive:
            try:
                self.group.broadcast(torch.tensor([STOP, 0], dtype=torch.int64).to(self.device))
            except RuntimeError:
                pass
        self.broken = self.broken or "closed"
        deadline = time.monotonic() + (STOP_TIMEOUT_S if self.started else 0.0)
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class TPModelRunner(ModelRunner):
    """Rank 0's runner: each step's plan goes to the other ranks before the forward pass."""

    def __init__(self, tp: TPGroup, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tp = tp
        self.copies: list[int] = []
        copy_block = self.cache.copy_block

        def copy_and_record(src: int, dst: int) -> None:
            copy_block(src, dst)
            self.copies += [src, dst]  # the other ranks copy their heads' KV next step

        self.cache.copy_block = copy_and_record

    def prepare(self, plan):
        flat = self.pack(plan, self.copies)  # the copies were made here already
        self.copies = []
        self.tp.send_step(flat)
        ids, positions, meta, _ = unpack_step(flat, self.device)
        return ids, positions, meta

    def execute(self, plan):
        try:
            return super().execute(plan)
        except TPError:
            raise
        except RuntimeError as e:
            if _is_collective_error(e):
                self.tp.failed(e)
            raise


def _is_collective_error(e: BaseException) -> bool:
    text = str(e).lower()
    return any(w in text for w in ("gloo", "nccl", "connection", "timed out", "timeout"))


def _worker_model(spec: dict, group: ProcessGroup, store):
    """This rank's model, KV cache and attention backend, built as LLMEngine builds rank 0's."""
    from engine.config import ModelConfig, parse_dtype
    from engine.loader import build_model
    from engine.models.parallel import Shard
    from engine.quantization import resolve

    # Rank 0's EngineConfig as its fields (checked there; importing it here would cycle).
    config = SimpleNamespace(**spec["config"])
    mc = ModelConfig.from_pretrained(config.model)
    shard = Shard.of(mc, spec["rank"], spec["size"])
    dtype, device = parse_dtype(config.dtype), group.device
    torch.manual_seed(config.seed)
    fp8_checkpoint = mc.fp8_checkpoint is not None and config.load_format == "auto"
    method = resolve(config.quantization, fp8_checkpoint, device)
    model = build_model(mc, dtype, device, config.load_format, config.seed, method, shard, group)
    kv_spec = kv_spec_for(config, mc, shard, dtype)
    cache, backend = build_kv(kv_spec, config, mc, device, int(store.get("num_blocks")))
    return model, cache, backend


@torch.inference_mode()
def _run_hook(group: ProcessGroup, cache, size: int, store) -> None:
    """A `TPGroup.run_hook` call on this rank; its answer (or error) goes to the store."""
    payload = torch.empty(size, dtype=torch.int64, device=group.device)
    group.broadcast(payload)
    req = json.loads(bytes(payload.cpu().tolist()).decode())
    try:
        if not req["module"].startswith(HOOK_PREFIXES):
            raise ValueError(f"refused hook module {req['module']!r}")
        answer = importlib.import_module(req["module"]).rank_hook(cache, group.rank, req["arg"])
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises TPError
        answer = {"error": f"{type(e).__name__}: {e}"}
    store.set(f"{req['key']}{group.rank}", json.dumps(answer))


def _serve(group: ProcessGroup, model, cache, backend, store) -> None:
    """Run every step rank 0 broadcasts until it says STOP."""
    header = torch.zeros(2, dtype=torch.int64, device=group.device)
    while True:
        group.broadcast(header, timeout=IDLE)
        command, size = header.tolist()
        if command == STOP:
            return
        if command == HOOK:
            _run_hook(group, cache, size, store)
            continue
        flat = torch.empty(size, dtype=torch.int64, device=group.device)
        group.broadcast(flat)
        ids, positions, meta, copies = unpack_step(flat.cpu(), group.device)
        for src, dst in copies:
            cache.copy_block(src, dst)
        with forward_context(meta):
            model(ids, positions, cache, backend)


def worker_main(argv: list[str]) -> int:
    """Entry point of ranks 1..N-1: `python -m engine.distributed '<json spec>'`."""
    spec = json.loads(argv[0])
    if os.getppid() != spec["parent"]:
        return 1  # rank 0 died before we were set up
    rank, size = spec["rank"], spec["size"]
    device_name = spec["config"].get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    store = dist.TCPStore(
        "127.0.0.1", spec["port"], size, False, timedelta(seconds=START_TIMEOUT_S)
    )
    store.set(f"up{rank}", "1")
    group = ProcessGroup(store, rank, size, device)
    model, cache, backend = _worker_model(spec, group, store)
    store.set(f"ready{rank}", "1")
    _serve(group, model, cache, backend, store)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
