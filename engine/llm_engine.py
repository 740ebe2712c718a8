"""The engine loop: add requests, `step()` (schedule -> run -> postprocess), abort.

One engine serves all three roles (engine/roles.py). "colocated" runs requests from prompt to
last token. "prefill" stops each request after its first token: the step marks it PREFILLED
(its blocks kept) and hands it to the KV connector (`on_prefilled`), which gives the blocks
back with `release` once a decode peer has them. "decode" also accepts requests whose prompt KV
arrives from a peer (`add_remote_request`): they queue and are admitted by the same scheduler
as local ones; on admission the connector's `on_remote_admitted` receives the blocks to fill,
and `commit_remote` (KV landed: join the batch with the peer's first token in place),
`recompute_remote` (it did not: prefill here) or `abort` ends the wait. The connector may call
these from inside `on_remote_admitted` (a transfer that cannot start).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.config import ModelConfig, parse_dtype
from engine.config_flags import setting
from engine.cuda_graphs import DecodeGraphs
from engine.decode_ahead import MODES as DECODE_AHEAD_MODES
from engine.decode_ahead import DecodeAhead
from engine.kv_cache import KV_DTYPES, BlockManager
from engine.kv_connector import KVConnector
from engine.kv_handoff import KVHandoff
from engine.kv_host_cache import HostKVCache
from engine.kv_setup import auto_num_blocks, build_kv, kv_spec_for
from engine.loader import build_model
from engine.model_runner import ModelRunner
from engine.models.parallel import check_tp_settings
from engine.outputs import TokenOutput
from engine.protocol import SCHEDULING_POLICIES, SamplingParams, trusted
from engine.quantization import QUANTIZATIONS, resolve
from engine.quantization import validate as validate_quantization
from engine.roles import COLOCATED, PREFILL, check_role
from engine.scheduler import Scheduler, SeqStatus, Sequence, choice_key

log = logging.getLogger(__name__)
LOAD_FORMATS = ("auto", "dummy")


@dataclass(slots=True)
class EngineConfig:
    """One engine's settings. The CLI flags of `tandem serve` are generated from these fields
    (engine/config_flags.py); `cli=False` marks the ones a deployment sets per worker."""

    model: str = setting(help="local Hugging Face model directory", cli=False)
    tokenizer: str | None = setting(
        None,
        "tokenizer: a Hugging Face tokenizer directory or a GGUF file (default: the model's own)",
    )
    dtype: str = setting("bfloat16", "model dtype (float32 for exact parity with HF)")
    load_format: str = setting(
        "auto", "'dummy': seeded random weights, no safetensors read", choices=LOAD_FORMATS
    )
    block_size: int = setting(16, "KV block size in tokens (a power of two)")
    num_kv_blocks: int | None = setting(None, "KV cache blocks (default: sized from memory)")
    kv_cache_memory_gb: float | None = setting(
        None, "KV cache budget in GiB when --num-kv-blocks is not given (CPU default: 1)"
    )
    kv_host_cache_gb: float = setting(
        0.0, "host-memory KV tier in GiB for blocks the device cache evicts (0: off)"
    )
    max_num_seqs: int = setting(256, "sequences per step")
    scheduling_policy: str = setting(
        "fcfs", "fcfs, or priority: by request priority (lower first)", choices=SCHEDULING_POLICIES
    )
    max_num_batched_tokens: int = setting(2048, "tokens per step (the chunked-prefill budget)")
    max_model_len: int | None = setting(None, "cap on the context window")
    enable_prefix_caching: bool = setting(
        True, "reuse cached prompt-prefix blocks", aliases=("--prefix-caching",)
    )
    decode_kv_reuse: bool = setting(
        True, "decode role: take a remote prompt's cached leading blocks, READ only the rest"
    )
    enable_chunked_prefill: bool = setting(
        True, "split long prompts across steps", aliases=("--chunked-prefill",)
    )
    attention_backend: str = setting("auto", "auto, torch, triton or flash_attn")
    kv_dtype: str = setting(
        "auto", "fp8_e4m3 stores KV in FP8 with per-token scales", choices=KV_DTYPES
    )
    quantization: str | None = setting(
        None,
        "projection weights: auto, none, int8, int8-w8a8, fp8 (W8A8), fp8-weight-only, weight-only "
        "(engine.quantization)",
        choices=QUANTIZATIONS,
        cli=False,
    )
    enforce_eager: bool = setting(
        False, "never capture decode steps as CUDA graphs (CUDA only; engine.cuda_graphs)"
    )
    decode_ahead: str = setting(
        "auto",
        "launch a greedy decode step before the last one's tokens are read back (auto: with "
        "CUDA graphs; engine.decode_ahead)",
        choices=DECODE_AHEAD_MODES,
    )
    seed: int = setting(0, "seed for dummy weights and sampling")
    device: str | None = setting(None, "torch device (default: cuda when present)", cli=False)
    role: str = setting(COLOCATED, "colocated, prefill or decode", cli=False)
    tensor_parallel_size: int = setting(
        1, "ranks sharing the model's weights and KV heads (engine.distributed)", cli=False
    )

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not self.kv_host_cache_gb >= 0:  # NaN too
            raise ValueError(f"kv_host_cache_gb must be >= 0, got {self.kv_host_cache_gb}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_role(self.role)
        if self.decode_ahead not in DECODE_AHEAD_MODES:
            raise ValueError(f"decode_ahead must be one of {DECODE_AHEAD_MODES}")
        parse_dtype(self.dtype)
        validate_quantization(self.quantization)
        check_tp_settings(self.tensor_parallel_size, self.role, self.load_format)


class LLMEngine(KVHandoff):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        mc = self.model_config
        self.dtype = parse_dtype(config.dtype)
        self.device = torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.max_model_len = mc.context_window(config.max_model_len)
        torch.manual_seed(config.seed)
        # The layout the weights get (engine.quantization.RESOLVED).
        fp8_checkpoint = mc.fp8_checkpoint is not None and config.load_format == "auto"
        self.quantization = resolve(config.quantization, fp8_checkpoint, self.device)
        self.tp, shard = None, None
        if config.tensor_parallel_size > 1:
            from engine.distributed import TPGroup
            from engine.models.parallel import Shard

            shard = Shard.of(mc, 0, config.tensor_parallel_size)  # refuses before spawning
            self.tp = TPGroup(config, config.tensor_parallel_size, self.device)
        try:
            self._build(config, mc, shard)
        except BaseException:
            self.shutdown()
            raise
        self.seqs: dict[str, Sequence] = {}
        # Request id -> the keys of its choices 1..n-1 once forked (n > 1).
        self.groups: dict[str, list[str]] = {}
        self._grammars = None  # engine.structured.GrammarCompiler, on first use
        self.num_steps = 0
        self.kv_connector: KVConnector | None = None
        self.ahead = DecodeAhead(self, config.decode_ahead)

    def _build(self, config: EngineConfig, mc: ModelConfig, shard) -> None:
        """The model (this rank's shard with TP), KV cache, scheduler, backend and runner."""
        group = None if self.tp is None else self.tp.group
        self.model = build_model(
            mc, self.dtype, self.device, config.load_format, config.seed, self.quantization,
            shard, group,
        )  # fmt: skip
        self.kv_spec = kv_spec_for(config, mc, shard, self.dtype)
        num_blocks = config.num_kv_blocks or auto_num_blocks(
            self.kv_spec, config, self.device, self.max_model_len
        )
        self.cache, self.backend = build_kv(self.kv_spec, config, mc, self.device, num_blocks)
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
        self.scheduler.set_policy(config.scheduling_policy)
        self.scheduler.remote_reuse = config.decode_kv_reuse
        self.host_cache = None
        if config.kv_host_cache_gb > 0 and config.enable_prefix_caching:
            host = HostKVCache(self.cache, self.block_manager, int(config.kv_host_cache_gb * 2**30))
            self.host_cache = self.scheduler.host = host
        args = (self.model, self.cache, self.backend, self.device, config.seed, mc.eos_token_ids)
        if self.tp is None:
            self.runner = ModelRunner(*args)
        else:
            from engine.distributed import TPModelRunner

            self.runner = TPModelRunner(self.tp, *args)
            self.tp.finish_start(num_blocks)
        # Not under TP: capturing the all-reduces in graphs is not built (decode runs eagerly).
        if self.device.type == "cuda" and not config.enforce_eager and self.tp is None:
            self._capture_graphs()

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do without TP); the engine cannot step
        afterwards. Idempotent."""
        if self.tp is not None:
            self.tp.close()

    def _capture_graphs(self) -> None:
        """Decode steps as CUDA graphs, when the attention backend can be captured."""
        if not getattr(self.backend, "graph_safe", False):
            log.info("attention backend %s: decode runs eagerly", self.backend.name)
            return
        if not self.model.graph_capturable:  # a MoE sizes its expert groups on the host
            log.info("%s: decode runs eagerly", self.model.cfg.architecture)
            return
        graphs = DecodeGraphs(
            self.model, self.cache, self.backend, self.config.max_num_seqs, self.max_model_len
        )
        t0 = time.perf_counter()
        try:
            graphs.capture()
        except RuntimeError as e:  # a driver or allocator refusal: slower, still correct
            log.warning("CUDA graph capture failed (%s): decode runs eagerly", e)
            return
        log.info("captured %d decode graphs in %.1f s", len(graphs.sizes), time.perf_counter() - t0)
        self.runner.graphs = graphs

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
        self.ahead.drain()  # a new request is admitted by an ordinary step
        seq = self._new_group(request_id, prompt_token_ids, sampling, range(sampling.n))
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def _new_group(
        self, request_id: str, prompt: list[int], sampling: SamplingParams, choices
    ) -> Sequence:
        """The sequence of a request's first listed choice, with the others as its pending
        forks (each with its own generator and grammar state)."""
        first, *rest = choices
        key = request_id
        seq = Sequence(key, list(prompt), sampling, group_id=request_id, choice=first)
        seq.forks = [
            Sequence(
                choice_key(request_id, c), list(prompt), sampling, group_id=request_id, choice=c
            )
            for c in rest
        ]
        if sampling.structured is not None:
            from engine.structured import GrammarMatcher

            compiled = self.grammars.compile(*sampling.structured)  # StructuredError: 400
            for s in (seq, *seq.forks):
                s.grammar = GrammarMatcher(compiled)
        return seq

    @property
    def grammars(self):
        """The structured-output compiler, built on first use (it needs the tokenizer)."""
        if self._grammars is None:
            from engine.model_info import load_tokenizer
            from engine.structured import GrammarCompiler

            tokenizer = load_tokenizer(self.config.tokenizer or self.config.model)
            if tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer (or --tokenizer)")
            mc = self.model_config
            self._grammars = GrammarCompiler(tokenizer, mc.vocab_size, mc.eos_token_ids)
        return self._grammars

    def abort(self, request_id: str) -> bool:
        """Drop a request (every choice of it) wherever it is and free its blocks. False if
        unknown."""
        self.ahead.drain()
        found = False
        for key in [request_id, *self.groups.pop(request_id, ())]:
            seq = self.seqs.pop(key, None)
            if seq is None:
                continue
            found = True
            self.scheduler.remove(seq)
            if seq.block_table:
                self.block_manager.free(seq.block_table)
            seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
        return found

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.ahead.stash)

    def _fork(self, parent: Sequence) -> None:
        """Give each pending fork of `parent` (now past its prompt) the prompt's KV: shared
        full blocks, a copied last block; with no block free for the copy, a fork queues to
        be recomputed (its full blocks are then prefix-cache hits)."""
        forks, parent.forks = parent.forks, []
        if not forks:
            return
        self.groups[parent.group_id] = [f.request_id for f in forks]
        for child in forks:
            self.seqs[child.request_id] = child
            try:
                table, copy = self.block_manager.fork(
                    parent.block_table, parent.num_computed_tokens
                )
            except MemoryError:
                self.scheduler.add(child)
                continue
            if copy is not None:
                self.cache.copy_block(parent.block_table[len(table) - 1], copy)
            child.block_table = table
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_committed_blocks = parent.num_committed_blocks
            child.num_cached_tokens = parent.num_cached_tokens
            self.scheduler.add_running(child)

    # -- the loop ------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        if self.ahead.inflight is not None:
            return self.ahead.advance()
        return [*self.ahead.take_stash(), *self.step_now()]

    def step_now(self) -> list[TokenOutput]:
        """An ordinary step (nothing in flight): schedule, run, record."""
        plan = self.scheduler.schedule()
        if plan.fetch:
            self._start_fetches(plan.fetch)
        if not plan.scheduled:
            return []
        if self.host_cache is not None:
            self.host_cache.wait()  # promoted blocks are copied before the step reads them
        if self.ahead.may_launch(plan):
            self.ahead.launch(plan)  # its tokens come back with the next step()
            return []
        samplers, tokens, entries = self.runner.execute(plan)
        self.num_steps += 1
        for s in plan.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            seq.num_committed_blocks = self.block_manager.commit(
                seq.block_table,
                seq.token_ids,
                seq.num_computed_tokens,
                seq.num_committed_blocks,
                salt=seq.sampling.cache_salt,
            )
        now = time.perf_counter()
        outputs: list[TokenOutput] = []
        prefill = self.config.role == PREFILL
        i = 0
        while i < len(samplers):
            parent = samplers[i]
            group = samplers[i : i + 1 + len(parent.forks)]
            picks = list(zip(group, tokens[i:], entries[i:], strict=False))
            i += len(group)
            if not prefill:
                self._fork(parent)
            running, parent_reason = [], None
            for seq, token, entry in picks:
                out = self._record(seq, token, entry, now)
                outputs.append(out)
                if out.finish_reason is None:
                    running.append((seq.choice, token))
                elif prefill and seq is parent:
                    parent_reason = out.finish_reason  # its blocks may still go to a peer
                else:
                    self._finish(seq, out.finish_reason)
            if prefill:
                self._end_prefill(parent, running, parent_reason)
        return outputs

    def _record(
        self, seq: Sequence, token: int, entry: tuple | None, now: float, pos: int | None = None
    ) -> TokenOutput:
        """Append a sampled token to `seq` (or, decode-ahead, put it at `pos`, its placeholder)
        and say what the step produced for it."""
        if pos is None:
            pos = len(seq.token_ids)
            seq.token_ids.append(token)
        else:
            seq.token_ids[pos] = token
        logprobs = None
        if entry is not None:
            seq.output_logprobs.append(entry)
            seq.cumulative_logprob += entry[0]
            logprobs = [entry]
        if seq.grammar is not None:
            seq.grammar.accept(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        index = pos - seq.num_prompt_tokens
        prompt_logprobs = None
        if index == 0 and seq.choice == 0 and seq.sampling.prompt_logprobs is not None:
            prompt_logprobs = seq.prompt_logprobs
        reason = self._finish_reason(seq, token, length=pos + 1)
        return trusted(  # the engine's own values: checked where they came in
            TokenOutput,
            seq.group_id,
            index,
            [token],
            reason,
            seq.choice,
            logprobs,
            prompt_logprobs,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def _end_prefill(
        self, parent: Sequence, running: list[tuple[int, int]], parent_reason: str | None
    ) -> None:
        """Prefill role, after a request's first tokens: hand the KV on for the choices still
        running, or free it when none is (then `parent_reason` is its own finish)."""
        parent.forks = []  # the choices live on the decode worker, not here
        if running:
            self._hand_off(parent, running)
        else:
            self._finish(parent, parent_reason)

    def _finish_reason(self, seq: Sequence, token: int, length: int | None = None) -> str | None:
        """Why `seq` ends at `token` (None: it goes on); `length`: its tokens through this one
        (default: all it holds; decode-ahead's sequences hold a placeholder past it)."""
        sp, length = seq.sampling, seq.num_tokens if length is None else length
        if token in sp.stop_token_ids:
            return "stop"
        if not sp.ignore_eos and token in self.model_config.eos_token_ids:
            return "stop"
        if length - seq.num_prompt_tokens >= sp.max_tokens or length >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        seq.finish_time = time.perf_counter()

    def pop_finished(self, request_id: str) -> Sequence | None:
        """The finished sequence of choice 0 (its other choices in `.choices`, n > 1), once
        every choice of the request has finished; None before."""
        seq = self.seqs.get(request_id)
        keys = self.groups.get(request_id, [])
        members = [self.seqs.get(k) for k in keys]
        if seq is None or any(m is None or m.status != SeqStatus.FINISHED for m in [seq, *members]):
            return None
        for key in [request_id, *self.groups.pop(request_id, ())]:
            del self.seqs[key]
        seq.choices = [seq, *members] if members else []
        return seq

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> dict:
        bm = self.block_manager
        host = self.host_cache.stats() if self.host_cache is not None else {}
        return {
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "queued_prefill_tokens": self.scheduler.num_waiting_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            # Both tiers: the prompt tokens a cache saved computing.
            "prefix_hit_tokens": bm.num_prefix_hit_tokens + host.get("host_hit_tokens", 0),
            "prefix_query_tokens": bm.num_prefix_query_tokens,
            "num_steps": self.num_steps,
            **host,
        }
