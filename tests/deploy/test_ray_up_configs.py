"""The `ray up` cluster YAMLs in cluster/configs/, through Ray's own config preparation and
validation (what `ray up` runs before it talks to the cloud), plus the pool layout tandem
relies on. Each head's `tandem serve` line is parsed by the real `tandem` CLI parser.

test_there_is_a_config_per_cloud fails when the configs are gone (the parametrized tests would
otherwise be collected with an empty parameter set and skip)."""

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
    serve_argv,
    serve_defaults,
    with_local_profile,
)

CONFIGS = sorted(RAY_CONFIGS.glob("*.yaml"))


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _prepared(path: Path) -> dict[str, Any]:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(copy.deepcopy(_load(path)))
    validate_config(config)
    return config


def _serve_command(config: dict[str, Any]) -> str:
    found = [c for c in config["head_start_ray_commands"] if "tandem serve" in c]
    assert len(found) == 1, config["head_start_ray_commands"]
    return found[0]


def test_there_is_a_config_per_cloud() -> None:
    assert {p.stem for p in CONFIGS} >= {"aws", "gcp"}, CONFIGS
    assert {_load(p)["provider"]["type"] for p in CONFIGS} >= {"aws", "gcp"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_passes_rays_cluster_config_validation(path: Path) -> None:
    config = _prepared(path)
    assert config["head_node_type"] in config["available_node_types"]


def test_ray_validation_rejects_a_broken_config() -> None:
    """The validator really runs (so the test above can fail)."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    assert CONFIGS, f"no cluster configs in {RAY_CONFIGS}"
    config = copy.deepcopy(_load(CONFIGS[0]))
    node_type = next(iter(config["available_node_types"].values()))
    node_type["resources"]["tandem_prefill"] = "eight"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(config))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_pools_map_to_node_types_by_custom_resource(path: Path) -> None:
    config = _prepared(path)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0, "the head takes no GPU"
    serve = parse_serve_args(serve_argv(_serve_command(config)))
    total_min = 0
    for resource, actors in (
        (serve.prefill_resource, serve.prefill),
        (serve.decode_resource, serve.decode),
    ):
        assert resource not in head["resources"]
        holders = [t for t in types.values() if resource in t["resources"]]
        assert len(holders) == 1, f"exactly one node type advertises {resource}"
        t = holders[0]
        # One unit per GPU: an actor takes one unit and one GPU.
        assert t["resources"][resource] == t["resources"]["GPU"] > 0
        assert 0 < t["min_workers"] <= t["max_workers"]
        # The actors `tandem serve` starts fit the node type's upper bound.
        assert actors <= t["max_workers"] * t["resources"][resource]
        total_min += t["min_workers"]
    assert (
        sum(t.get("max_workers", 0) for n, t in types.items() if n != config["head_node_type"])
        <= config["max_workers"]
    )
    assert total_min <= config["max_workers"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_head_starts_tandem_serve_on_the_local_ray(path: Path) -> None:
    config = _load(path)
    commands = config["head_start_ray_commands"]
    ray_start = next(i for i, c in enumerate(commands) if "ray start --head" in c)
    serve_at = next(i for i, c in enumerate(commands) if "tandem serve" in c)
    assert ray_start < serve_at
    # The dashboard stays on the head's loopback; `ray dashboard` tunnels to it.
    assert "--dashboard-host=127.0.0.1" in commands[ray_start]
    assert "--num-gpus=0" in commands[ray_start]
    argv = serve_argv(commands[serve_at])
    serve = parse_serve_args(argv)
    assert (serve.address, serve.bind_host, serve.mode) == ("auto", "auto", "disagg")
    # The key is read from a file, never put on the command line.
    assert "--api-key" not in given_flags(argv)
    assert serve.api_key == serve_defaults().api_key
    assert 'TANDEM_API_KEY="$(cat ~/.tandem-api-key)"' in commands[serve_at]
    assert any("tandem-api-key" in c for c in config["head_setup_commands"])
    # The model directory `tandem serve` loads is the one setup_commands downloads on every node.
    model_dir = serve.model.replace("~", "$HOME")
    assert any(model_dir in c for c in config["setup_commands"]), serve.model
    workers = config["worker_start_ray_commands"]
    assert any("ray start" in c for c in workers), workers
    for c in workers:
        assert "--head" not in c and "tandem serve" not in c


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_setup_installs_tandem_with_the_same_ray(path: Path) -> None:
    import ray

    setup = " ".join(_load(path)["setup_commands"])
    assert re.search(r'"tandem @ git\+https://[^"]+"', setup), setup
    pinned = re.search(r'"ray\[default\]==([0-9.]+)"', setup)
    assert pinned and pinned.group(1) == ray.__version__, (
        "the cluster's Ray must match the Ray `ray up` runs with"
    )


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_ray_start_commands_parse_with_rays_cli(path: Path) -> None:
    import shlex

    from ray.scripts.scripts import start

    config = _load(path)
    parsed: dict[str, list[dict[str, Any]]] = {}
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        parsed[key] = []
        for c in config[key]:
            for part in re.split(r";|&&|\|\|", c):
                words = shlex.split(part.replace("$RAY_HEAD_IP", "10.0.0.1"))
                if words[:2] == ["ray", "start"]:
                    parsed[key].append(start.make_context("ray start", words[2:]).params)
    # One `ray start` each: the head's with --head, the workers' joining the head.
    head, workers = parsed["head_start_ray_commands"], parsed["worker_start_ray_commands"]
    assert len(head) == 1 and head[0]["head"], head
    assert len(workers) == 1 and not workers[0]["head"], workers
    assert workers[0]["address"] == f"10.0.0.1:{head[0]['port']}", workers[0]["address"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_documented_quantization_flags_parse(path: Path, capacity_profile_file: Path) -> None:
    """The serve line names each pool's quantization and the KV dtype; the comment above it
    shows the quantized profile (`--quantized`) and its explicit equivalent. Each documented
    span added to the serve line parses with the real parser, and the two spellings of the
    profile give the workers the same settings."""
    from cluster.serve import settings_from_args

    def quantization(extra: list[str]) -> tuple[str, str, str]:
        s = settings_from_args(parse_serve_args(argv + extra))
        return s.prefill_quantization, s.decode_quantization, s.engine["kv_dtype"]

    # --autoscale loads its capacity profile: the head's path, here a local one.
    argv = with_local_profile(serve_argv(_serve_command(_load(path))), capacity_profile_file)
    assert {"--prefill-quantization", "--decode-quantization", "--kv-dtype"} <= given_flags(argv)
    as_shipped = quantization([])
    assert as_shipped[:2] == ("auto", "auto"), as_shipped
    # The quantization spans (the TP recipe has a test of its own: test_ray_up_autoscaling).
    spans = [s for s in comment_flag_spans(path) if not s.startswith("--prefill-tp")]
    assert "--quantized" in spans, spans
    results = {span: quantization(shlex.split(span)) for span in spans}
    profile = ("fp8", "weight-only", "fp8_e4m3")
    assert results.pop("--quantized") == profile
    # The explicit equivalent the comment gives, and the line's own per-pool flags.
    assert profile in results.values(), results
    assert as_shipped in results.values(), results
