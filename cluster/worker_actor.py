"""The Ray actor that hosts one worker: an engine plus its serving loop.

Ray only places, restarts and health-checks it; requests and tokens travel on the worker's
own ZMQ sockets and KV on NIXL. `role` picks the loop's KV connector: "prefill"
(prefill_server), "decode" (decode_server) or "colocated" (none: prefill and decode here).

Each construction is one incarnation (a fresh id): Ray re-runs the constructor when it
restarts a dead actor, so the controller tells a replacement from the worker it replaces by
`incarnation` in `info()`, `load()` and `watch()`. `drain()` is the last call of a worker
taken out of service: it returns once nothing is left in it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import asdict

import ray


class WorkerActor:
    def __init__(
        self,
        worker_id: str,
        role: str,
        engine_kwargs: dict,
        bind_host: str = "127.0.0.1",
        num_threads: int = 1,
        lease_seconds: float = 30.0,
        on_transfer_failure: str = "recompute",
        log_level: str = "WARNING",
        max_frame_bytes: int = 16 << 20,
        faults: dict | None = None,
        read_timeout_s: float = 30.0,
    ):
        import torch

        logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(message)s")
        # One worker per core share: never let two workers' thread pools fight.
        torch.set_num_threads(max(1, num_threads))
        if bind_host == "auto":
            bind_host = ray.util.get_node_ip_address()
        from engine.llm_engine import EngineConfig, LLMEngine
        from engine.roles import DECODE, PREFILL, check_role

        _prepare_ranks(engine_kwargs.get("tensor_parallel_size", 1), num_threads)
        engine = LLMEngine(EngineConfig(**engine_kwargs, role=check_role(role)))
        self.worker_id, self.role = worker_id, role
        self.incarnation = uuid.uuid4().hex
        self._stopped = threading.Event()
        # The layout the weights got (the setting resolved for this device), else the dtype.
        quant = engine.quantization
        self.weights = quant if quant != "none" else engine.config.dtype
        if role == PREFILL:
            from prefill_worker.server import prefill_server

            agent = _agent(worker_id, engine, bind_host, (lease_seconds, read_timeout_s), faults)
            self.server = prefill_server(worker_id, engine, agent, bind_host, max_frame_bytes)
        elif role == DECODE:
            from decode_worker.server import decode_server

            agent = _agent(worker_id, engine, bind_host, (lease_seconds, read_timeout_s), faults)
            self.server = decode_server(
                worker_id, engine, agent, bind_host, on_transfer_failure, max_frame_bytes
            )
        else:
            from engine.engine_server import EngineServer

            self.server = EngineServer(
                worker_id, role, engine, bind_host=bind_host, max_frame_bytes=max_frame_bytes
            )
        # Testing only: every engine step takes this much longer (long, killable streams).
        self.server.step_delay_s = float((faults or {}).get("step_delay_s", 0.0))
        self.server.on_group_down = self._exit_for_restart
        _freeze_startup_objects()
        self.server.start()

    def info(self) -> dict:
        agent = getattr(self.server.connector, "agent", None)
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "request_endpoint": self.server.endpoint,
            # KV events (engine/kv_events.py): what its prefix cache holds, for the routers.
            "kv_events_endpoint": self.server.kv_events_endpoints[0],
            "kv_snapshot_endpoint": self.server.kv_events_endpoints[1],
            "kv_endpoint": agent.endpoint if agent is not None else "",
            "kv_name": agent.name if agent is not None else "",
            "kv_instance_id": agent.instance_id if agent is not None else "",
            "weights": self.weights,  # the resolved quantization, or the dtype without one
        }

    def _exit_for_restart(self, error: Exception) -> None:
        """A TP group that lost a rank never steps again (engine.distributed.TPError): exit,
        so that Ray starts a new incarnation of the whole group (max_restarts), as it does
        for a dead worker; its requests already got their errors, given a moment to leave."""
        logging.getLogger(__name__).error("%s: %s; exiting to be replaced", self.worker_id, error)
        time.sleep(0.5)  # the queued error messages leave (the reply sockets' I/O thread)
        os._exit(1)

    # Polled several times a second: Ray's GCS would keep an event per call (memory that
    # grows with uptime, up to its cap), for calls nobody needs to trace.
    @ray.method(enable_task_events=False)
    def load(self) -> dict:
        return {**asdict(self.server.latest_load()), "incarnation": self.incarnation}

    @ray.method(enable_task_events=False)
    def watch(self, timeout_s: float) -> str:
        """Returns after `timeout_s` (or at stop) while the process lives; the caller learns
        of its death from the call failing (see cluster/controller.py)."""
        self._stopped.wait(timeout_s)
        return self.incarnation

    def set_peers(self, peers: dict[str, str]) -> bool:
        """The KV agents this worker may exchange blocks with: name -> current instance id."""
        agent = getattr(self.server.connector, "agent", None)
        if agent is not None:
            agent.set_allowed_peers(dict(peers))
        return True

    def drain(self, timeout_s: float, settle_s: float) -> dict:
        """Wait until this worker holds nothing (no request, no lease, no READ) for `settle_s`
        in a row, or `timeout_s` passes; then stop its loop. Returns whether it got idle."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        idle_since: float | None = None
        while time.monotonic() < deadline:
            now = time.monotonic()
            if self.server.is_idle():
                idle_since = idle_since or now
                if now - idle_since >= settle_s:
                    break
            else:
                idle_since = None
            time.sleep(0.05)
        idle = self.server.is_idle()
        self.stop()
        return {"idle": idle, "seconds": round(time.monotonic() - t0, 3)}

    def stop(self) -> bool:
        if not self._stopped.is_set():
            self._stopped.set()
            self.server.stop()
        return True


def _agent(worker_id: str, engine, bind_host: str, timeouts: tuple, faults: dict | None):
    """The worker's KV agent; `timeouts` is (lease_seconds, read_timeout_s)."""
    from kv_transfer.agent import KVTransferAgent
    from kv_transfer.faults import FaultPlan

    kv_faults = {k: v for k, v in (faults or {}).items() if k != "step_delay_s"}
    plan = FaultPlan.from_dict(kv_faults) if kv_faults else None
    lease_s, read_timeout_s = timeouts
    # A TP prefill worker: every rank registers its own KV with its own NIXL agent, and the
    # handshake tells a reader where each rank's heads are (kv_transfer/tp_rank.py).
    return KVTransferAgent(
        worker_id, engine.cache, bind_host, lease_s, read_timeout_s, faults=plan, tp_group=engine.tp
    )


def _freeze_startup_objects() -> None:
    """Everything allocated so far (model, tokenizer, imported modules) lives as long as the
    worker: move it out of the collector's view, so that a full collection during serving
    scans only what serving allocates (a long pause there is a TPOT outlier)."""
    import gc

    gc.collect()
    gc.freeze()


def _prepare_ranks(tp: int, num_threads: int) -> None:
    """Before the engine starts its TP ranks: they are this process's children
    (engine/distributed.py) and inherit its environment, so each gets the same core share and,
    with GPUs, its own bundle's GPU."""
    if tp == 1:
        return
    os.environ["OMP_NUM_THREADS"] = str(max(1, num_threads))
    if ray.get_gpu_ids():
        share_group_gpus(tp)


def share_group_gpus(tp: int) -> list[str]:
    """In rank 0 (the actor), before CUDA starts: make the GPUs of every bundle of its group
    visible, in bundle order, so that the ranks it starts (subprocesses that inherit the
    environment; rank r takes cuda:r) each get their own bundle's GPU. Returns the list.

    Why not one actor asking for N GPUs: an actor draws its resources from a single bundle,
    and one bundle per rank is what lets Ray account (and the autoscaler plan) per GPU and
    STRICT_PACK guarantee the node. Ray sets CUDA_VISIBLE_DEVICES of a process to the GPUs
    of its own bundle only, so rank 0 asks each other bundle for its GPU id with a probe task
    scheduled there (the bundle's GPU is fixed when the group is placed); as vLLM's Ray
    executor does with one actor per bundle."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = ray.util.get_current_placement_group()
    own = [str(g) for g in ray.get_gpu_ids()]
    if group is None or tp == 1:
        return own

    def probe(i: int):
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)
        task = ray.remote(_gpu_ids_task).options(
            num_gpus=1, num_cpus=0, scheduling_strategy=strategy
        )
        return task.remote()

    others = ray.get([probe(i) for i in range(1, tp)], timeout=120)
    ids = own + [str(g) for ids in others for g in ids]
    if len(set(ids)) != tp:
        raise RuntimeError(f"a TP-{tp} group's bundles gave GPUs {ids}, not {tp} distinct ones")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    return ids


def _gpu_ids_task() -> list:
    return ray.get_gpu_ids()
