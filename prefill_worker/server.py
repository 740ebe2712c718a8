"""The prefill worker: the one serving loop (`engine.engine_server.EngineServer`) composed with
the prefill side's KV connector (`kv_transfer.prefill_connector.PrefillConnector`, where the
request lifecycle and the lease handling live)."""

from __future__ import annotations

from engine.engine_server import EngineServer
from engine.llm_engine import LLMEngine
from engine.roles import PREFILL
from kv_transfer.prefill_connector import KVHolder, PrefillConnector


def prefill_server(
    worker_id: str,
    engine: LLMEngine,
    agent: KVHolder,
    bind_host: str = "127.0.0.1",
    max_frame_bytes: int = 16 << 20,
) -> EngineServer:
    """A prefill worker's loop around `engine` (role "prefill"), handing KV over with `agent`."""
    return EngineServer(
        worker_id, PREFILL, engine, PrefillConnector(agent), bind_host, max_frame_bytes
    )
