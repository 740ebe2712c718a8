"""`tandem bench serve`: an async streaming load generator for any OpenAI-compatible server.

The flags are generated from `BenchConfig` (bench/config.py), one per field, so a setting's
name, default and help are written once; `--goodput` (several KEY:VALUE words, as vLLM spells
it) is added here, its help taken from the field. `run` builds the config, runs `run_benchmark`
(bench/client.py) and `finish` (bench/report.py): the printed table, the JSON and the plots.

Python API (benchmarks/ call it in-process): `result = await run_benchmark(BenchConfig(...))`,
then `result.to_dict()` / `result.to_json()` / `result.write_json(path)`; `finish(result)`
prints the report and writes the JSON and plots the config names.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from bench.client import run_benchmark
from bench.config import BenchConfig
from bench.report import finish
from bench.vllm_compat import parse_goodput
from engine.config_flags import add_flags, values_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, BenchConfig)
    parser.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:VALUE",
        default=None,
        help=BenchConfig.__dataclass_fields__["goodput"].metadata["help"]
        + "; a request is good when it meets every SLO given",
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The config of parsed flags; a malformed flag value raises ValueError."""
    goodput = getattr(args, "goodput", None)
    return BenchConfig(
        **values_from_args(BenchConfig, args),
        goodput=parse_goodput(goodput) if goodput else None,
    )


def run(args: argparse.Namespace) -> int:
    """Exit status 0 when at least one request completed, 1 when none did, 2 on bad flags."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"tandem bench serve: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run_benchmark(config))
    except (ValueError, OSError) as exc:  # unreadable trace, bad trace values
        print(f"tandem bench serve: {exc}", file=sys.stderr)
        return 2
    finish(result)
    return 0 if result.metrics.completed > 0 else 1
