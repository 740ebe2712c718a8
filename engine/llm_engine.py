"""The engine loop: add requests, `step()` (schedule -> run -> postprocess), abort.

One engine serves all three roles. "colocated" runs requests from prompt to last token.
"prefill" stops each request after its first token and keeps its blocks (state PREFILLED)
until the worker has handed them to a decode peer and calls `release`. "decode" also accepts
requests whose prompt KV arrives from a peer: `reserve_remote` allocates blocks for it (state
REMOTE_KV), the transfer fills them, and `commit_remote` joins the sequence to the batch with
the prefill worker's first token already in place.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.attention import select_backend
from engine.block_manager import BlockManager
from engine.config import ModelConfig, parse_dtype
from engine.kv_cache import KVCache, KVCacheSpec
from engine.loader import build_model
from engine.model_runner import ModelRunner
from engine.outputs import TokenOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import SeqStatus, Sequence

log = logging.getLogger(__name__)
ROLES = ("colocated", "prefill", "decode")


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str = "bfloat16"
    load_format: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None  # budget when num_kv_blocks is None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    kv_dtype: str = "auto"
    quantization: str | None = None  # None/"none" or "int8" (weight-only; engine.quantization)
    seed: int = 0
    device: str | None = None
    role: str = "colocated"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        parse_dtype(self.dtype)
        from engine.quantization import validate

        validate(self.quantization)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        mc = self.model_config
        self.dtype = parse_dtype(config.dtype)
        self.device = torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.max_model_len = min(config.max_model_len or mc.max_position, mc.max_position)
        torch.manual_seed(config.seed)
        self.model = build_model(mc, self.dtype, self.device, config.load_format, config.seed)
        self.model.quantize(config.quantization)
        self.kv_spec = KVCacheSpec(
            model=mc.architecture,
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            block_size=config.block_size,
            dtype=self.dtype,
            kv_dtype=config.kv_dtype,
        )
        num_blocks = config.num_kv_blocks or self._auto_num_blocks()
        self.cache = KVCache(self.kv_spec, num_blocks, self.device)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            # Without chunking a whole prompt must fit one step.
            budget = max(budget, self.max_model_len)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, budget, config.enable_chunked_prefill
        )
        self.backend = select_backend(
            config.attention_backend, self.device, mc.head_dim**-0.5, mc.sliding_window
        )
        self.runner = ModelRunner(self.model, self.cache, self.backend, self.device, config.seed)
        self.seqs: dict[str, Sequence] = {}
        self.num_steps = 0
        self.num_aborted = 0

    # -- sizing --------------------------------------------------------------------------
    def _auto_num_blocks(self) -> int:
        per_block = KVCache.bytes_per_block(self.kv_spec)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.85)
        else:
            budget = int((self.config.kv_cache_memory_gb or 1.0) * 2**30)
        # Never more than the batch could ever use.
        per_seq = -(-self.max_model_len // self.config.block_size)
        cap = self.config.max_num_seqs * per_seq + 1
        return max(1, min(budget // per_block, cap))

    # -- requests ------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_token_ids)} tokens; the context window is "
                f"{self.max_model_len} (at most {self.max_model_len - 1} prompt tokens)"
            )
        need = self.block_manager.blocks_needed(len(prompt_token_ids) + 1)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt needs {need} KV blocks; the cache has {self.block_manager.num_blocks}"
            )

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> None:
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(sampling, SamplingParams):
            raise ValueError("sampling must be a SamplingParams")
        self.validate_prompt(prompt_token_ids)
        seq = Sequence(request_id, list(prompt_token_ids), sampling)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def resume_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        sampling: SamplingParams,
    ) -> None:
        """Queue a request whose first outputs were produced elsewhere; its KV is recomputed
        (prompt and outputs) like a preempted sequence, and it continues at the next index."""
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_prompt(list(prompt_token_ids) + list(output_token_ids))
        seq = Sequence(request_id, list(prompt_token_ids), sampling)
        seq.token_ids.extend(output_token_ids)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks. False if unknown."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        if seq.block_table:
            self.block_manager.free(seq.block_table)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
        self.num_aborted += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- disaggregation hooks ------------------------------------------------------------
    def prefilled_blocks(self, request_id: str) -> list[int]:
        seq = self.seqs[request_id]
        if seq.status != SeqStatus.PREFILLED:
            raise ValueError(f"request {request_id!r} is {seq.status.value}, not prefilled")
        return list(seq.block_table)

    def release(self, request_id: str) -> None:
        """Free a prefilled request's blocks once its hand-off is over (or abandoned)."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None and seq.block_table:
            self.block_manager.free(seq.block_table)

    def reserve_remote(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int,
        sampling: SamplingParams,
    ) -> list[int] | None:
        """Blocks to receive a peer's prompt KV, or None while there is no room."""
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids)
        n = self.block_manager.blocks_needed(len(prompt_token_ids))
        # Leave room for the running batch to grow by a block each before taking new work.
        if n + len(self.scheduler.running) > self.block_manager.num_free_blocks:
            return None
        seq = Sequence(request_id, list(prompt_token_ids), sampling)
        seq.token_ids.append(first_token)
        seq.block_table = self.block_manager.allocate_blocks(n)
        seq.status = SeqStatus.REMOTE_KV
        seq.first_token_time = time.perf_counter()
        self.seqs[request_id] = seq
        return list(seq.block_table)

    def commit_remote(self, request_id: str) -> TokenOutput | None:
        """The peer's KV has landed: join the batch. Returns a final output if the first token
        already finished the request."""
        seq = self.seqs[request_id]
        if seq.status != SeqStatus.REMOTE_KV:
            raise ValueError(f"request {request_id!r} is {seq.status.value}, not remote_kv")
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_committed_blocks = self.block_manager.commit(
            seq.block_table, seq.token_ids, seq.num_computed_tokens
        )
        reason = self._finish_reason(seq, seq.token_ids[-1])
        if reason is not None:
            self._finish(seq, reason)
            return TokenOutput(request_id, 0, [], reason)
        self.scheduler.add_running(seq)
        return None

    # -- the loop ------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        tokens = self.runner.execute(plan)
        self.num_steps += 1
        now = time.perf_counter()
        outputs: list[TokenOutput] = []
        sampled = iter(tokens)
        for s in plan.scheduled:
            seq = s.seq
            samples = s.samples
            seq.num_computed_tokens += s.num_new_tokens
            seq.num_committed_blocks = self.block_manager.commit(
                seq.block_table, seq.token_ids, seq.num_computed_tokens, seq.num_committed_blocks
            )
            if not samples:
                continue
            token = next(sampled)
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._finish_reason(seq, token)
            index = seq.num_output_tokens - 1
            if reason is not None:
                self._finish(seq, reason)
            elif self.config.role == "prefill":
                self._hold(seq)
            outputs.append(TokenOutput(seq.request_id, index, [token], reason))
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        sp = seq.sampling
        if token in sp.stop_token_ids:
            return "stop"
        if not sp.ignore_eos and token in self.model_config.eos_token_ids:
            return "stop"
        if seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        seq.finish_time = time.perf_counter()

    def _hold(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        seq.status = SeqStatus.PREFILLED

    def pop_finished(self, request_id: str) -> Sequence | None:
        seq = self.seqs.get(request_id)
        if seq is not None and seq.status == SeqStatus.FINISHED:
            return self.seqs.pop(request_id)
        return None

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "queued_prefill_tokens": self.scheduler.num_waiting_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_hit_tokens": bm.num_prefix_hit_tokens,
            "prefix_query_tokens": bm.num_prefix_query_tokens,
            "num_steps": self.num_steps,
        }
