"""The decode worker: the one serving loop (`engine.engine_server.EngineServer`) composed with
the decode side's KV connector (`kv_transfer.decode_connector.DecodeConnector`, where the
remote-prefill lifecycle, the failure policy and the abort races live)."""

from __future__ import annotations

from engine.engine_server import EngineServer
from engine.llm_engine import LLMEngine
from engine.roles import DECODE
from kv_transfer.decode_connector import FAILURE_POLICIES, DecodeConnector, KVReader

__all__ = ["FAILURE_POLICIES", "decode_server"]


def decode_server(
    worker_id: str,
    engine: LLMEngine,
    agent: KVReader,
    bind_host: str = "127.0.0.1",
    on_transfer_failure: str = "recompute",
    max_frame_bytes: int = 16 << 20,
) -> EngineServer:
    """A decode worker's loop around `engine` (role "decode"), pulling KV with `agent`;
    `on_transfer_failure` is "recompute" (prefill here) or "error" (fail the request)."""
    connector = DecodeConnector(agent, on_transfer_failure)
    return EngineServer(worker_id, DECODE, engine, connector, bind_host, max_frame_bytes)
