"""The Ray actor that hosts one worker: an engine plus its serving loop.

Ray only places, restarts and health-checks it; requests and tokens travel on the worker's
own ZMQ sockets and KV on NIXL. `role` picks the loop: "prefill" (PrefillServer), "decode"
(DecodeServer) or "colocated" (a plain EngineServer doing prefill and decode).
"""

from __future__ import annotations

import logging
from dataclasses import asdict


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
    ):
        import torch

        logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(message)s")
        # One worker per core share: never let two workers' thread pools fight.
        torch.set_num_threads(max(1, num_threads))
        if bind_host == "auto":
            import ray

            bind_host = ray.util.get_node_ip_address()
        from engine.llm_engine import EngineConfig, LLMEngine
        from engine.roles import DECODE, PREFILL, check_role

        engine = LLMEngine(EngineConfig(**engine_kwargs, role=check_role(role)))
        self.worker_id, self.role = worker_id, role
        # The layout the weights got (the setting resolved for this device), else the dtype.
        quant = engine.quantization
        self.weights = quant if quant != "none" else engine.config.dtype
        if role == PREFILL:
            from kv_transfer.agent import KVTransferAgent
            from prefill_worker.server import PrefillServer

            agent = KVTransferAgent(worker_id, engine.cache, bind_host, lease_seconds)
            self.server = PrefillServer(worker_id, engine, agent, bind_host, max_frame_bytes)
        elif role == DECODE:
            from decode_worker.server import DecodeServer
            from kv_transfer.agent import KVTransferAgent

            agent = KVTransferAgent(worker_id, engine.cache, bind_host, lease_seconds)
            self.server = DecodeServer(
                worker_id, engine, agent, bind_host, on_transfer_failure, max_frame_bytes
            )
        else:
            from engine.engine_server import EngineServer

            self.server = EngineServer(worker_id, role, engine, bind_host, max_frame_bytes)
        # Everything allocated so far (model, tokenizer, imported modules) lives as long as
        # the worker: move it out of the collector's view, so that a full collection during
        # serving scans only what serving allocates (a long pause there is a TPOT outlier).
        import gc

        gc.collect()
        gc.freeze()
        self.server.start()

    def info(self) -> dict:
        agent = getattr(self.server, "agent", None)
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "request_endpoint": self.server.endpoint,
            "kv_endpoint": agent.endpoint if agent is not None else "",
            "weights": self.weights,  # the resolved quantization, or the dtype without one
        }

    def load(self) -> dict:
        return asdict(self.server.latest_load())

    def stop(self) -> bool:
        self.server.stop()
        return True
