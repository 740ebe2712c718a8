"""`tandem profile`: the latency profile of one worker, measured in-process (no Ray, no HTTP).

Lifecycle of a run (`profile_model`):
1. build one `LLMEngine` on this process's threads (default 1: one worker's core share), with
   prefix caching off (repeated prompts must be computed, not looked up) and a token budget
   that fits the longest prompt in one step;
2. warm up (one prefill at the shortest and one at the longest length, so lazy allocations
   and kernel choices are not timed);
3. prefill: for each prompt length, `repeats` fresh random prompts with max_tokens=1, each
   timed as the one `engine.step()` that computes the prompt and samples the first token
   (the median is reported: TTFT of an idle worker);
4. decode: one batch-1 request grows from a short prompt to `max_position` tokens, every step
   timed; the time of the step that reads a context of P tokens is the per-token decode cost at
   position P (reported at `positions` as the median of a small window of steps around it);
5. report: JSON (every raw sample, the medians, the machine) and two PNGs,
   prefill_latency.png and decode_latency.png.

These are the per-worker numbers the planner's sizing rule needs: prefill tokens/s against
prompt length, and the decode step time against context length. Only engine/ is needed; the
default model is the demo's cached `small` checkpoint (`tools.make_model.cached_model`).
The flags are generated from `ProfileConfig`; `--model` (optional here) and `--out` are not
config fields. `--capacity` runs bench/capacity.py instead (the planner's capacity profile).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from engine.config_flags import add_flags, parse_int_list, setting, values_from_args

DEFAULT_LENGTHS = (32, 64, 128, 256, 512, 768, 1024, 1536, 2000)
DEFAULT_OUT = "benchmarks/results/profile"


@dataclass(slots=True)
class ProfileConfig:
    """One `tandem profile` run; each CLI field is also its flag (`--lengths`, ...)."""

    model: str = setting(help="local HF model directory")
    dtype: str = setting("float32", "torch dtype of the weights and activations")
    lengths: tuple[int, ...] = setting(
        DEFAULT_LENGTHS, "prompt lengths to prefill, comma-separated", parse=parse_int_list
    )
    positions: tuple[int, ...] | None = setting(
        None, "decode positions to report (unset: 12 evenly spaced)", parse=parse_int_list
    )
    max_position: int | None = setting(
        None, "grow the decode sequence to this many tokens (unset: the context window)"
    )
    repeats: int = setting(3, "prefill runs per length (median)")
    threads: int = setting(1, "torch threads (one worker's share)")
    window: int = setting(8, "decode steps around each reported position", cli=False)
    seed: int = setting(0, "seed of the random prompts (and of the default model)")
    load_format: str = setting(
        "auto", "weights: 'auto' reads them, 'dummy' is seeded random", choices=("auto", "dummy")
    )
    attention_backend: str = setting("auto", "attention backend of the engine")

    def __post_init__(self) -> None:
        if not self.lengths or any(n < 1 for n in self.lengths):
            raise ValueError(f"lengths must be positive, got {self.lengths}")
        self.lengths = tuple(sorted(set(self.lengths)))
        if self.positions is not None:
            if not self.positions or any(p < 1 for p in self.positions):
                raise ValueError(f"positions must be positive, got {self.positions}")
            self.positions = tuple(sorted(set(self.positions)))
        if self.max_position is not None and self.max_position < 2:
            raise ValueError(f"max_position must be >= 2, got {self.max_position}")
        for name in ("repeats", "threads", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(slots=True)
class PrefillPoint:
    prompt_len: int
    median_s: float
    samples_s: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.prompt_len / self.median_s


@dataclass(slots=True)
class DecodePoint:
    position: int  # context tokens the step attends over
    median_s: float


@dataclass(slots=True)
class ProfileResult:
    config: ProfileConfig
    prefill: list[PrefillPoint]
    decode: list[DecodePoint]
    decode_steps_s: list[float]  # raw: index i is the step at position decode_start + i
    decode_start: int
    machine: dict = field(default_factory=dict)
    started_at: str = ""

    def to_dict(self) -> dict:
        return {
            "model": self.config.model,
            "started_at": self.started_at,
            "config": asdict(self.config),
            "machine": self.machine,
            "prefill": [
                {
                    "prompt_len": p.prompt_len,
                    "median_ms": p.median_s * 1e3,
                    "tokens_per_s": p.tokens_per_s,
                    "samples_ms": [s * 1e3 for s in p.samples_s],
                }
                for p in self.prefill
            ],
            "decode": [
                {
                    "position": d.position,
                    "median_ms": d.median_s * 1e3,
                    "tokens_per_s": 1.0 / d.median_s,
                }
                for d in self.decode
            ],
            "decode_raw": {
                "first_position": self.decode_start,
                "step_ms": [s * 1e3 for s in self.decode_steps_s],
            },
        }


def _machine(threads: int) -> dict:
    import torch

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": threads,
        "load_avg_1_5_15": list(os.getloadavg()),
        "torch": torch.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }


def _random_prompt(rng: Any, n: int, vocab: int) -> list[int]:
    # Ids above the special tokens and below the vocab; fresh per call so nothing is cached.
    return [int(t) for t in rng.integers(16, vocab, size=n)]


def _timed_step(engine: Any) -> float:
    import torch

    t0 = time.perf_counter()
    engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - t0


def _build_engine(cfg: ProfileConfig, window_len: int, longest: int) -> Any:
    from engine.llm_engine import EngineConfig, LLMEngine

    return LLMEngine(
        EngineConfig(
            model=cfg.model,
            dtype=cfg.dtype,
            load_format=cfg.load_format,
            attention_backend=cfg.attention_backend,
            enable_prefix_caching=False,
            enable_chunked_prefill=False,
            max_num_batched_tokens=longest,
            max_num_seqs=4,
            # Room for the longest request plus slack; no auto-sizing from a memory budget.
            num_kv_blocks=2 * (-(-longest // 16)) + 8,
            max_model_len=window_len,
            seed=cfg.seed,
            decode_ahead="off",  # one synced step per timing, its tokens read at once
        )
    )


def _profile_prefill(
    engine: Any,
    cfg: ProfileConfig,
    lengths: tuple[int, ...],
    rng: Any,
    vocab: int,
    log: Callable[[str], None],
) -> list[PrefillPoint]:
    from engine.protocol import SamplingParams

    greedy_one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rid = iter(range(1 << 30))

    def one_prefill(n: int) -> float:
        name = f"prefill-{next(rid)}"
        engine.add_request(name, _random_prompt(rng, n, vocab), greedy_one)
        elapsed = _timed_step(engine)
        if engine.has_unfinished():
            raise RuntimeError(f"a {n}-token prompt did not prefill in one step")
        engine.pop_finished(name)
        return elapsed

    # Warm-up: first calls allocate workspaces and pick kernels.
    for n in (min(lengths), max(lengths)):
        one_prefill(n)

    prefill: list[PrefillPoint] = []
    for n in lengths:
        samples = [one_prefill(n) for _ in range(cfg.repeats)]
        point = PrefillPoint(n, statistics.median(samples), samples)
        prefill.append(point)
        log(
            f"prefill {n:>5} tokens: {point.median_s * 1e3:8.1f} ms "
            f"({point.tokens_per_s:8.0f} tok/s)"
        )
    return prefill


def _profile_decode(
    engine: Any,
    start: int,
    max_position: int,
    rng: Any,
    vocab: int,
    log: Callable[[str], None],
) -> list[float]:
    """One sequence from a `start`-token prompt to `max_position` tokens, each step timed."""
    from engine.protocol import SamplingParams

    name = "decode-0"
    engine.add_request(
        name,
        _random_prompt(rng, start, vocab),
        SamplingParams(max_tokens=max_position - start, temperature=0.0, ignore_eos=True),
    )
    _timed_step(engine)  # the prefill of the short prompt: not a decode step
    steps: list[float] = []
    next_report = time.perf_counter() + 5.0
    while engine.has_unfinished():
        steps.append(_timed_step(engine))
        if time.perf_counter() > next_report:
            log(f"decode position {start + len(steps)}/{max_position}")
            next_report += 5.0
    engine.pop_finished(name)
    return steps


def _decode_points(cfg: ProfileConfig, steps: list[float], first_pos: int) -> list[DecodePoint]:
    """The median step time in a window around each reported position."""
    import numpy as np

    positions = cfg.positions or tuple(
        sorted({int(p) for p in np.linspace(first_pos, first_pos + len(steps) - 1, 12)})
    )
    decode: list[DecodePoint] = []
    for p in positions:
        i = p - first_pos
        if not 0 <= i < len(steps):
            continue
        lo, hi = max(0, i - cfg.window // 2), min(len(steps), i + cfg.window // 2 + 1)
        decode.append(DecodePoint(p, statistics.median(steps[lo:hi])))
    return decode


def profile_model(cfg: ProfileConfig, log: Callable[[str], None] = print) -> ProfileResult:
    import numpy as np
    import torch

    from engine.config import ModelConfig

    torch.set_num_threads(cfg.threads)
    machine = _machine(cfg.threads)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    mc = ModelConfig.from_pretrained(cfg.model)  # the context window sizes the engine
    window_len = mc.max_position
    max_position = min(cfg.max_position or window_len, window_len)
    lengths = tuple(n for n in cfg.lengths if n < window_len)
    if not lengths:
        raise ValueError(f"every length is >= the context window ({window_len})")
    engine = _build_engine(cfg, window_len, max(max(lengths), max_position))
    rng = np.random.default_rng(cfg.seed)
    prefill = _profile_prefill(engine, cfg, lengths, rng, mc.vocab_size, log)
    start = min(16, max_position - 1)
    steps = _profile_decode(engine, start, max_position, rng, mc.vocab_size, log)
    # Step i reads the prompt plus i+1 outputs: its context is start + 1 + i tokens.
    first_pos = start + 1
    decode = _decode_points(cfg, steps, first_pos)
    for d in decode:
        log(f"decode at position {d.position:>5}: {d.median_s * 1e3:7.2f} ms/token")
    return ProfileResult(cfg, prefill, decode, steps, first_pos, machine, started_at)


def _new_figure() -> Any:
    # Agg canvas on a Figure directly: no pyplot, so no GUI backend and no global state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2))
    FigureCanvasAgg(fig)
    return fig


def _title(result: ProfileResult, what: str) -> str:
    cfg = result.config
    return f"{what}, {Path(cfg.model).name}, {cfg.dtype}, {cfg.threads} thread(s)"


def _plot_prefill(result: ProfileResult, path: Path) -> Path:
    fig = _new_figure()
    ax = fig.add_subplot()
    xs = [p.prompt_len for p in result.prefill]
    ax.plot(xs, [p.median_s * 1e3 for p in result.prefill], "o-", label="median")
    for p in result.prefill:
        ax.scatter(
            [p.prompt_len] * len(p.samples_s),
            [s * 1e3 for s in p.samples_s],
            s=8,
            color="gray",
            alpha=0.5,
        )
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("prefill latency (ms)")
    ax.set_title(_title(result, "prefill latency"))
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(
        xs,
        [p.tokens_per_s for p in result.prefill],
        "s--",
        color="tab:orange",
        alpha=0.7,
        label="tokens/s",
    )
    ax2.set_ylabel("prefill tokens/s", color="tab:orange")
    ax2.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _plot_decode(result: ProfileResult, path: Path) -> Path:
    import numpy as np

    fig = _new_figure()
    ax = fig.add_subplot()
    raw = np.array(result.decode_steps_s) * 1e3
    pos = np.arange(result.decode_start, result.decode_start + len(raw))
    ax.plot(pos, raw, ".", ms=2, color="gray", alpha=0.4, label="each step")
    ax.plot(
        [d.position for d in result.decode],
        [d.median_s * 1e3 for d in result.decode],
        "o-",
        label=f"median of {result.config.window} steps",
    )
    ax.set_xlabel("position (context tokens)")
    ax.set_ylabel("decode time per token (ms), batch 1")
    ax.set_title(_title(result, "decode latency"))
    top = float(np.percentile(raw, 99)) * 1.3 if len(raw) else 1.0
    ax.set_ylim(0, top)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_profile(result: ProfileResult, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        _plot_prefill(result, out_dir / "prefill_latency.png"),
        _plot_decode(result, out_dir / "decode_latency.png"),
    ]


def add_arguments(p: argparse.ArgumentParser) -> None:
    # --model is optional on the command line (the demo's cached model) though the config
    # needs one, so it is written here rather than generated.
    p.add_argument(
        "--model", default=None, help="local HF model directory (default: the demo's `small` model)"
    )
    add_flags(p, ProfileConfig, exclude=("model",))
    p.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help="directory for profile.json and the PNGs (default: %(default)s)",
    )
    p.add_argument(
        "--capacity",
        action="store_true",
        help="measure a capacity profile for the planner instead (bench/capacity.py)",
    )
    from bench.capacity import add_arguments as add_capacity_arguments

    add_capacity_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.capacity:
        from bench.capacity import run as run_capacity

        return run_capacity(args)
    model = args.model
    if model is None:
        from tools.make_model import cached_model

        model = str(cached_model(seed=args.seed))
    try:
        cfg = ProfileConfig(
            model=str(model), **values_from_args(ProfileConfig, args, exclude=("model",))
        )
        result = profile_model(cfg, log=lambda m: print(m, flush=True))
    except (ValueError, FileNotFoundError) as e:
        print(f"tandem profile: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "profile.json"
    json_path.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    for path in [json_path, *plot_profile(result, out)]:
        print(f"wrote {path}")
    return 0
