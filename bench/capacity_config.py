"""`CapacityConfig`: the settings of one `tandem profile --capacity` run (bench/capacity.py),
and the `Log` callback type its steps take. A module of its own so the timed steps
(bench/capacity_steps.py) and the live part (bench/capacity_live.py) can name the type without
importing bench/capacity.py, which imports them (no import cycle, type-check-time ones included).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.config_flags import parse_int_list, setting

Log = Callable[[str], None]
DEFAULT_OUT_DIR = "benchmarks/results"
SERVE_DTYPE = "bfloat16"  # EngineConfig's default: what `tandem serve` runs without --dtype
# Flags the latency profile (bench/profile.py) already defines; a capacity run reads them too.
SHARED_FLAGS = ("model", "dtype", "threads", "seed", "load_format", "attention_backend", "repeats")


@dataclass(slots=True)
class CapacityConfig:
    """One `tandem profile --capacity` run. Engine fields mean what tandem serve's flags of the
    same name mean; list fields left unset get the full or the --quick defaults."""

    model: str = setting(help="local HF model directory")
    dtype: str = setting(SERVE_DTYPE, "torch dtype of both workers", cli=False)
    threads: int = setting(1, "torch threads of each worker (one worker's core share)", cli=False)
    seed: int = setting(0, "seed of the random prompts", cli=False)
    load_format: str = setting("auto", "weights: auto or dummy", cli=False)
    attention_backend: str = setting("auto", "attention backend", cli=False)
    repeats: int = setting(3, "timed runs per prefill point (median)", cli=False)
    prefill_quantization: str = setting("auto", "projection weights of the prefill worker")
    decode_quantization: str = setting("auto", "projection weights of the decode worker")
    kv_dtype: str = setting("auto", "KV cache dtype (auto or fp8_e4m3)")
    tp: int = setting(
        1,
        "tensor-parallel ranks (GPUs) of each measured worker: the profile describes a worker "
        "of this many GPUs (its gpus_per_worker; tandem serve --prefill-tp/--decode-tp)",
    )
    block_size: int = setting(16, "KV block size in tokens")
    max_num_batched_tokens: int = setting(2048, "token budget of one step")
    max_num_seqs: int = setting(256, "sequences per step")
    kv_cache_memory_gb: float | None = setting(None, "KV cache GiB (unset: serve's default)")
    num_kv_blocks: int | None = setting(None, "KV cache blocks (unset: sized from memory)")
    kv_host_cache_gb: float = setting(0.0, "host-memory KV tier GiB per worker (0: off)")
    max_model_len: int | None = setting(None, "cap on the context window")
    prefill_lengths: tuple[int, ...] | None = setting(
        None, "prompt lengths to prefill, comma-separated (unset: 16 .. the step budget)",
        parse=parse_int_list,
    )  # fmt: skip
    batches: tuple[int, ...] | None = setting(
        None, "decode batch sizes, comma-separated (unset: 1,2,4,8,16,32,64)", parse=parse_int_list
    )
    contexts: tuple[int, ...] | None = setting(
        None, "decode context per sequence, comma-separated (unset: 16 .. the window)",
        parse=parse_int_list,
    )  # fmt: skip
    decode_steps: int | None = setting(None, "timed decode steps per grid cell (unset: 6)")
    live: bool = setting(False, "measure the overheads outside the engine on a live server")
    live_requests: int | None = setting(None, "live: requests per prompt length (unset: 3)")
    disagg_threshold: int = setting(
        256, "live: prompts shorter than this are prefilled on the decode worker (serve's)"
    )
    quick: bool = setting(False, "a small, fast run (tests): fewer points, steps and repeats")
    hardware: str | None = setting(None, "hardware name in the profile (unset: this CPU/GPU)")
    capacity_out: str | None = setting(
        None, f"profile JSON path (unset: {DEFAULT_OUT_DIR}/capacity-<cpu|cuda>.json)"
    )

    def __post_init__(self) -> None:
        for name in ("threads", "repeats", "block_size", "max_num_batched_tokens", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        for name in ("prefill_lengths", "batches", "contexts"):
            values = getattr(self, name)
            if values is not None:
                if not values or any(v < 1 for v in values):
                    raise ValueError(f"{name} must be positive integers, got {values}")
                setattr(self, name, tuple(sorted(set(values))))
        for name in ("decode_steps", "live_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.disagg_threshold < 0:
            raise ValueError(f"disagg_threshold must be >= 0, got {self.disagg_threshold}")

    @property
    def steps(self) -> int:
        return self.decode_steps or (3 if self.quick else 6)

    @property
    def runs(self) -> int:
        return 1 if self.quick else self.repeats
