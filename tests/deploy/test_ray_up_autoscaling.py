"""The `ray up` YAMLs run `tandem serve --autoscale`: the planner's per-pool bounds on the head's
serve line and the node types' min_workers/max_workers (as Ray's own config preparation leaves
them) describe the same pools, through the custom resource each pool's actors ask for; the GPU
budget fits between the pools' minimums and what their node types can hold; the capacity
profile the line names is written on the head before `tandem serve` starts. The line is parsed,
and turned into settings, by the real `tandem` code."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers import (
    RAY_CONFIGS,
    comment_flag_spans,
    given_flags,
    parse_serve_args,
    parse_tandem_args,
    serve_argv,
    serve_options,
    with_local_profile,
)

CONFIGS = sorted(RAY_CONFIGS.glob("*.yaml"))
# The planner flags of the issue; each must be a flag of the real `tandem serve`.
PLANNER_FLAGS = {
    "--autoscale",
    "--capacity-profile",
    "--slo-ttft-ms",
    "--slo-tpot-ms",
    "--interval-s",
    "--min-prefill",
    "--max-prefill",
    "--min-decode",
    "--max-decode",
    "--gpu-budget",
    "--startup-s",
    "--down-cooldown-s",
}


def _prepared(path: Path) -> dict[str, Any]:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(copy.deepcopy(yaml.safe_load(path.read_text())))
    validate_config(config)
    return config


def _serve_argv(config: dict[str, Any]) -> list[str]:
    found = [c for c in config["head_start_ray_commands"] if "tandem serve" in c]
    assert len(found) == 1, config["head_start_ray_commands"]
    return serve_argv(found[0])


def _pool_type(config: dict[str, Any], resource: str) -> dict[str, Any]:
    holders = [t for t in config["available_node_types"].values() if resource in t["resources"]]
    assert len(holders) == 1, f"exactly one node type advertises {resource}"
    return holders[0]


def test_there_are_configs() -> None:
    assert {p.stem for p in CONFIGS} >= {"aws", "gcp"}, CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_serve_line_runs_the_planner_with_every_flag(path: Path) -> None:
    missing = PLANNER_FLAGS - serve_options()
    assert not missing, f"not flags of the real `tandem serve`: {sorted(missing)}"
    argv = _serve_argv(_prepared(path))
    assert PLANNER_FLAGS <= given_flags(argv), sorted(PLANNER_FLAGS - given_flags(argv))
    serve = parse_serve_args(argv)
    assert serve.autoscale is True and serve.mode == "disagg"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_node_type_bounds_are_the_planners_bounds(path: Path) -> None:
    config = _prepared(path)
    _check_bounds(config, parse_serve_args(_serve_argv(config)))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_tp_recipe_of_the_comment_keeps_the_bounds_consistent(path: Path) -> None:
    """The configs' comment on tensor parallelism (a 70B model: its TP sizes, the bounds and
    starting workers divided by them, the budget kept in GPUs), added to the serve line, gives
    a line whose bounds still match the node types: the same check as the shipped line's."""
    config = _prepared(path)
    recipes = [s for s in comment_flag_spans(path) if s.startswith("--prefill-tp")]
    assert len(recipes) == 1, recipes
    argv = [*_serve_argv(config), *shlex.split(recipes[0])]  # the later flags win
    serve = parse_serve_args(argv)
    assert (serve.prefill_tp, serve.decode_tp) == (4, 2)
    _check_bounds(config, serve)
    with pytest.raises(AssertionError):  # the check does see TP: bounds left in GPUs fail
        _check_bounds(config, parse_serve_args([*_serve_argv(config), "--prefill-tp", "4"]))


def _check_bounds(config: dict[str, Any], serve) -> None:
    """Each pool's node type keeps the nodes the planner's minimum needs and can grow to hold
    its maximum, with less than a node to spare: a node of G GPUs (G units of the pool's
    resource) holds G / TP workers of the pool's TP size (a group's ranks share a node); the
    GPU budget, in GPUs (workers x TP), lets both minimums run and stops at what the maxima
    hold."""
    gpus_at_max = 0
    for pool in ("prefill", "decode"):
        resource = getattr(serve, f"{pool}_resource")
        t = _pool_type(config, resource)
        units = t["resources"][resource]
        assert units == t["resources"]["GPU"] > 0, "one unit per GPU: a rank takes one GPU"
        tp = getattr(serve, f"{pool}_tp")
        per_node = units // tp
        assert per_node >= 1, (pool, tp, units)
        lo, hi = getattr(serve, f"min_{pool}"), getattr(serve, f"max_{pool}")
        assert -(-lo // per_node) == t["min_workers"], (pool, lo, per_node, t["min_workers"])
        assert -(-hi // per_node) == t["max_workers"], (pool, hi, per_node, t["max_workers"])
        # The workers it starts with lie within the bounds (and fit the starting nodes).
        assert lo <= getattr(serve, pool) <= min(hi, t["min_workers"] * per_node)
        gpus_at_max += hi * tp
    workers = [
        t for n, t in config["available_node_types"].items() if n != config["head_node_type"]
    ]
    assert sum(t["max_workers"] for t in workers) <= config["max_workers"]
    floor = serve.min_prefill * serve.prefill_tp + serve.min_decode * serve.decode_tp
    assert floor <= serve.gpu_budget <= gpus_at_max


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_real_settings_accept_the_autoscaled_line(path: Path, capacity_profile_file: Path) -> None:
    from cluster.serve import settings_from_args

    argv = _serve_argv(_prepared(path))
    settings = settings_from_args(parse_serve_args(with_local_profile(argv, capacity_profile_file)))
    config = settings.planner_config()
    serve = parse_serve_args(argv)
    for name in ("min_prefill", "max_prefill", "min_decode", "max_decode", "gpu_budget"):
        assert getattr(config, name) == getattr(serve, name), name
    assert (config.slo_ttft_ms, config.slo_tpot_ms) == (serve.slo_ttft_ms, serve.slo_tpot_ms)
    assert (config.interval_s, config.startup_s) == (serve.interval_s, serve.startup_s)
    assert config.down_cooldown_s == serve.down_cooldown_s
    assert settings.max_workers() == serve.max_prefill + serve.max_decode


def _plan_argv(config: dict[str, Any]) -> tuple[str, list[str]]:
    """(the command, the `tandem plan` arguments after `plan`) of head_setup_commands."""
    plans = [c for c in config["head_setup_commands"] if re.search(r"\btandem plan\b", c)]
    assert len(plans) == 1, config["head_setup_commands"]
    words = shlex.split(plans[0].split("||")[-1])
    at = next(i for i, w in enumerate(words) if Path(w).name == "tandem")
    assert words[at + 1] == "plan", words
    return plans[0], words[at + 2 :]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_head_writes_the_capacity_profile_before_serving(path: Path) -> None:
    """`tandem plan` on the head (head_setup_commands run before head_start_ray_commands)
    writes the file --capacity-profile names, once, for the model, KV dtype and decode GPU of
    the serve line and the node types."""
    config = _prepared(path)
    serve = parse_serve_args(_serve_argv(config))
    command, argv = _plan_argv(config)
    plan = parse_tandem_args(["plan", *argv])
    assert plan.out == serve.capacity_profile
    assert plan.tp == serve.decode_tp  # a profile of one decode worker, of its GPUs
    assert (plan.model, plan.kv_dtype) == (serve.model, serve.kv_dtype)
    # One profile for both pools: the slower GPU, the decode node type's.
    decode_type = next(
        name
        for name, t in config["available_node_types"].items()
        if serve.decode_resource in t["resources"]
    )
    assert decode_type.endswith(f"_{plan.gpu}"), (decode_type, plan.gpu)
    # Written only when missing, so a profile put there by hand wins.
    assert command.startswith(f"test -s {serve.capacity_profile} ||"), command


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_planned_profile_starts_the_planner(path: Path, tmp_path: Path) -> None:
    """The head's `tandem plan` line, run for real (the model's preset in place of its
    directory, which only the cluster has), writes a profile the serve line's settings load
    and the planner starts from, within the line's bounds."""
    from cluster import cli
    from cluster.planner.policy import Planner
    from cluster.serve import settings_from_args

    config = _prepared(path)
    serve_args = _serve_argv(config)
    serve = parse_serve_args(serve_args)
    _, argv = _plan_argv(config)
    preset = Path(serve.model).name.lower().removesuffix("-instruct")
    out = tmp_path / "capacity.json"
    argv = [
        preset if w == serve.model else str(out) if w == serve.capacity_profile else w for w in argv
    ]
    assert cli.main(["plan", *argv]) == 0
    settings = settings_from_args(parse_serve_args(with_local_profile(serve_args, out)))
    planner = Planner(settings.capacity_profile_data(), settings.planner_config())
    start = planner.initial()
    assert serve.min_prefill <= start["prefill"] <= serve.max_prefill, start
    assert serve.min_decode <= start["decode"] <= serve.max_decode, start
