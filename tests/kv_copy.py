"""An in-process KV connector for tests: a prefill engine's hand-offs are copied straight into
a decode engine's cache (the engine's half of the hand-off under test without NIXL; the NIXL
path is what tests/workers and tests/e2e drive)."""

from __future__ import annotations

from engine.kv_connector import Handoff
from engine.llm_engine import LLMEngine


class CopyConnector:
    """Both halves: the prefill engine's hand-offs are kept; the decode engine's admissions
    copy the held blocks into the blocks the scheduler allocated."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine, auto_land: bool = True):
        self.prefill, self.decode = prefill, decode
        self.auto_land = auto_land
        self.handoffs: dict[str, Handoff] = {}
        self.admitted: list[tuple[str, list[int]]] = []
        self.refuse = False
        self.reused: dict[str, int] = {}  # request -> leading blocks the decode engine held
        prefill.set_kv_connector(self)
        decode.set_kv_connector(self)

    def on_prefilled(self, handoff: Handoff) -> bool:
        if self.refuse:
            return False
        self.handoffs[handoff.request_id] = handoff
        return True

    def on_remote_admitted(
        self, request_id: str, block_ids: list[int], num_reused_blocks: int
    ) -> None:
        self.admitted.append((request_id, block_ids))
        self.reused[request_id] = num_reused_blocks
        if self.auto_land:
            self.land(request_id)

    def land(self, request_id: str) -> None:
        h = self.handoffs.pop(request_id)
        blocks = dict(self.admitted)[request_id]
        assert len(blocks) == len(h.block_ids)
        src_cache, dst_cache = self.prefill.cache, self.decode.cache
        k = self.reused[request_id]  # the decode engine's own cached blocks stay as they are
        for src, dst in zip(h.block_ids[k:], blocks[k:], strict=True):
            dst_cache.data[dst].copy_(src_cache.data[src])
            if src_cache.scales is not None:  # FP8 KV: the per-token scales travel too
                dst_cache.scales[dst].copy_(src_cache.scales[src])
        self.prefill.release(request_id)
        self.decode.commit_remote(request_id)


def disaggregated_greedy(
    prefill: LLMEngine, decode: LLMEngine, prompts: list[list[int]], sampling
) -> list[list[int]]:
    """Every prompt prefilled on `prefill`, its KV copied, decoded on `decode`: the output a
    disaggregated deployment of these two engines must produce."""
    CopyConnector(prefill, decode)
    outputs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        prefill.add_request(f"r{i}", p, sampling)
    while prefill.has_unfinished():
        for out in prefill.step():
            outputs[out.request_id] = list(out.token_ids)
    for i, p in enumerate(prompts):
        if f"r{i}" in prefill.seqs:  # handed off (not finished by its first token)
            decode.add_remote_request(f"r{i}", p, outputs[f"r{i}"][0], sampling)
    while decode.has_unfinished():
        for out in decode.step():
            outputs[out.request_id].extend(out.token_ids)
    return [outputs[f"r{i}"] for i in range(len(prompts))]
