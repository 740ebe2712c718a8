"""A KV hand-off between pools: what the engine asks of a KV connector.

The engine decides *when* and *which blocks* (one scheduler, one block pool, one admission
policy); the connector decides *how the bytes move* (kv_transfer, NIXL). This is vLLM v1's
split of a KV connector into a scheduler-side and a worker-side half.

The engine's two calls (engine/llm_engine.py, from inside `step`), one per role, so a connector
implements only its own half (`PrefillKV` or `DecodeKV`; `KVConnector` is either) and
`LLMEngine.set_kv_connector` refuses one that lacks its role's call:

- prefill role: when a request's prompt is done and its first token sampled (and it is not
  already finished), the engine marks it PREFILLED (its blocks stay allocated) and calls
  `on_prefilled(handoff)`. The connector takes ownership of those blocks for the hand-off and
  later gives them back with `LLMEngine.release(request_id)`; returning False refuses the
  hand-off, and the engine frees the blocks at once.
- decode role: a request whose prompt KV comes from a peer (`LLMEngine.add_remote_request`)
  waits in the scheduler's queue like any other; when the scheduler admits it, blocks are
  allocated, the request enters REMOTE_KV, and the engine calls
  `on_remote_admitted(request_id, block_ids, num_reused_blocks)`: the first
  `num_reused_blocks` of `block_ids` are this worker's own prefix-cache blocks for the same
  leading tokens (taken by reference, already filled). The connector fills the rest and calls
  `LLMEngine.commit_remote` (the KV landed), `LLMEngine.recompute_remote` (it did not: prefill
  the prompt here) or `LLMEngine.abort`.

The serving loop's half of the same object (`WorkerConnector`: the frames it owns, the hooks
around each step, aborts, drain, load counters) and `NoConnector` (colocated workers) are in
engine/engine_server.py, beside the loop that calls them; the prefill and decode connectors
are in kv_transfer/. What the loop used to read from `LLMEngine.seqs` the engine now reports:
`TokenOutput.num_cached_tokens`, and `LLMEngine.abort` returning whether it knew the id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True, frozen=True)
class Handoff:
    """A prefilled request whose KV is ready to move: `block_ids` hold `num_tokens` tokens of
    prompt KV (the first token's KV is computed by whoever decodes it)."""

    request_id: str
    block_ids: list[int]
    first_token: int
    num_tokens: int
    # (choice, first token) of every choice still running (n > 1); the first is first_token's.
    choices: list[tuple[int, int]] | None = None


class PrefillKV(Protocol):
    """The prefill role's connector, as the engine's step calls it."""

    def on_prefilled(self, handoff: Handoff) -> bool:
        """Hold `handoff.block_ids` for a peer. False: refuse (the engine frees the blocks)."""
        ...


class DecodeKV(Protocol):
    """The decode role's connector, as the engine's step calls it."""

    def on_remote_admitted(
        self, request_id: str, block_ids: list[int], num_reused_blocks: int
    ) -> None:
        """The scheduler admitted the request; start filling `block_ids[num_reused_blocks:]`
        (the leading ones hold this worker's cached KV of the same tokens)."""
        ...


KVConnector = PrefillKV | DecodeKV
# The call each role's engine makes (a colocated engine moves no KV and takes no connector).
ROLE_CALLS = {"prefill": "on_prefilled", "decode": "on_remote_admitted"}
