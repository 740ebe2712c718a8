"""The chart's planner (autoscaling.planner: `tandem serve --autoscale`), rendered by the real
helm and checked against the real `tandem serve` parser and settings, Kubernetes' schemas, the
KubeRay CRD and Ray's own reading of the RayCluster.

With the planner on, the head's `tandem serve` carries --autoscale and every planner flag from
values, the capacity profile is a read-only mount whose path is --capacity-profile, and each
worker group's pod bounds hold exactly the planner's actor bounds; with it off, nothing of it
renders. The spec's planner flags are the only ones asserted on; each must be a flag of the
real parser."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploy_helpers import (
    CHART,
    EXAMPLES,
    K8S_VERSION,
    Helm,
    find,
    given_flags,
    group_counts,
    head_serve_argv,
    one,
    parse_serve_args,
    pool_slots,
    serve_options,
    with_local_profile,
)

EXAMPLE = EXAMPLES / "planner-autoscaling.yaml"
POOLS = ("prefill", "decode")
# autoscaling.planner's values and the `tandem serve` flag each becomes (the spelling).
PLANNER_FLAGS = {
    "sloTtftMs": "--slo-ttft-ms",
    "sloTtftMsPer1k": "--slo-ttft-ms-per-1k",
    "sloTpotMs": "--slo-tpot-ms",
    "intervalS": "--interval-s",
    "minPrefill": "--min-prefill",
    "maxPrefill": "--max-prefill",
    "minDecode": "--min-decode",
    "maxDecode": "--max-decode",
    "gpuBudget": "--gpu-budget",
    "startupS": "--startup-s",
    "downCooldownS": "--down-cooldown-s",
}
PLANNER_ONLY = {"--autoscale", "--capacity-profile", *PLANNER_FLAGS.values()}
# Every planner value set, none at its default, and bounds that are not multiples of the slots.
ALL_SET = {
    "autoscaling.planner.enabled": "true",
    "autoscaling.planner.sloTtftMs": "750",
    "autoscaling.planner.sloTtftMsPer1k": "12.5",
    "autoscaling.planner.sloTpotMs": "42.5",
    "autoscaling.planner.intervalS": "7.5",
    "autoscaling.planner.minPrefill": "3",
    "autoscaling.planner.maxPrefill": "9",
    "autoscaling.planner.minDecode": "2",
    "autoscaling.planner.maxDecode": "11",
    "autoscaling.planner.gpuBudget": "17",
    "autoscaling.planner.startupS": "180",
    "autoscaling.planner.downCooldownS": "240",
    "serving.prefill": "4",
    "serving.decode": "5",
    "prefill.gpusPerPod": "2",
    "decode.gpusPerPod": "4",
}


def _json_text(obj: Any) -> str:
    """`--set-json` value giving a string key the JSON text of obj."""
    return json.dumps(json.dumps(obj))


def _set_args(values: dict[str, str]) -> list[str]:
    # --set-json: plain --set passes 42.5 as a string, which the schema rejects for a number.
    return [a for k, v in values.items() for a in ("--set-json", f"{k}={v}")]


def _flag(key: str) -> str:
    """The flag the chart derives from a camelCase value name (sloTtftMs -> --slo-ttft-ms)."""
    return "--" + re.sub(r"(?<!^)([A-Z]|(?<=[a-z])\d)", r"-\1", key).lower()


def _defaults() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _merged(*overlays: dict[str, Any]) -> dict[str, Any]:
    out = _defaults()
    for overlay in overlays:
        _merge(out, overlay)
    return out


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def _dotted(values: dict[str, str]) -> dict[str, Any]:
    """--set style dotted keys as nested values (numbers and booleans parsed as helm does)."""
    out: dict[str, Any] = {}
    for key, raw in values.items():
        *path, last = key.split(".")
        node = out
        for p in path:
            node = node.setdefault(p, {})
        node[last] = yaml.safe_load(raw)
    return out


def _groups(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    rc = one(manifests, "RayCluster")
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert sorted(groups) == sorted(POOLS), sorted(groups)
    return groups


def _head_spec(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return one(manifests, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]


@pytest.fixture(scope="module")
def profile_file(capacity_profile_file: Path) -> Path:
    return capacity_profile_file


@pytest.fixture(scope="module")
def planner_all_set(helm: Helm, profile_file: Path) -> list[dict[str, Any]]:
    """Every planner value set, the profile inline (--set-file), 2- and 4-GPU pods."""
    return helm.render(
        *_set_args(ALL_SET),
        "--set-file",
        f"autoscaling.planner.capacityProfile.json={profile_file}",
    )


def test_the_chart_offers_each_planner_flag_of_the_spec() -> None:
    """Each value of autoscaling.planner (but the switch and the profile) is one spec flag, and
    each spec flag is a flag of the real `tandem serve`."""
    planner = _defaults()["autoscaling"]["planner"]
    assert set(planner) - {"enabled", "capacityProfile"} == set(PLANNER_FLAGS)
    assert all(_flag(k) == f for k, f in PLANNER_FLAGS.items())
    missing = PLANNER_ONLY - serve_options()
    assert not missing, f"not flags of the real `tandem serve`: {sorted(missing)}"
    assert planner["enabled"] is False, "the planner is opt-in"


def test_head_runs_tandem_serve_autoscale_with_every_planner_value(
    planner_all_set: list[dict[str, Any]],
) -> None:
    argv = head_serve_argv(planner_all_set)
    assert PLANNER_ONLY <= given_flags(argv), argv
    ns = parse_serve_args(argv)
    assert ns.autoscale is True
    for key, flag in PLANNER_FLAGS.items():
        want = yaml.safe_load(ALL_SET[f"autoscaling.planner.{key}"])
        got = getattr(ns, flag[2:].replace("-", "_"))
        assert got == want, (flag, got, want)
    assert (ns.prefill, ns.decode) == (4, 5)
    assert ns.capacity_profile == "/etc/tandem/capacity/capacity-profile.json"


def test_the_rendered_line_is_a_valid_autoscaled_deployment(
    planner_all_set: list[dict[str, Any]], profile_file: Path
) -> None:
    """The real settings accept the head's line as a whole (its bounds, the serving counts
    within them, the profile, once its in-pod path is this machine's copy), and the planner
    gets every value the chart was given."""
    from cluster.serve import settings_from_args

    argv = with_local_profile(head_serve_argv(planner_all_set), profile_file)
    settings = settings_from_args(parse_serve_args(argv))
    assert settings.autoscale
    config = settings.planner_config()
    assert (config.slo_ttft_ms, config.slo_tpot_ms, config.interval_s) == (750, 42.5, 7.5)
    assert (config.min_prefill, config.max_prefill) == (3, 9)
    assert (config.min_decode, config.max_decode) == (2, 11)
    assert (config.gpu_budget, config.startup_s, config.down_cooldown_s) == (17, 180, 240)
    assert settings.capacity_profile_data().hardware == "H100"


@pytest.mark.parametrize(
    "extra",
    [{}, {"prefill.gpusPerPod": "0", "decode.gpusPerPod": "0", "prefill.cpuSlots": "3"}],
    ids=["gpu-pods", "cpu-pods"],
)
def test_group_bounds_hold_exactly_the_planners_actors(
    helm: Helm, profile_file: Path, extra: dict[str, str]
) -> None:
    """Each group's pods hold at least the planner's minimum actors and room for its maximum,
    with less than one pod to spare, as KubeRay's spec and as Ray's autoscaler reads it; the
    actors `tandem serve` starts with fit the starting pods."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    chosen = ALL_SET | extra
    manifests = helm.render(
        *_set_args(chosen),
        "--set-file",
        f"autoscaling.planner.capacityProfile.json={profile_file}",
    )
    values = _merged(_dotted(chosen))
    rc = copy.deepcopy(one(manifests, "RayCluster"))
    rc["metadata"]["namespace"] = "serving"
    types = _derive_autoscaling_config_from_ray_cr(rc)["available_node_types"]
    serve = parse_serve_args(head_serve_argv(manifests))
    groups = _groups(manifests)
    for pool in POOLS:
        slots = pool_slots(values[pool])
        g, t = groups[pool], types[pool]
        lo, hi = getattr(serve, f"min_{pool}"), getattr(serve, f"max_{pool}")
        assert (g["minReplicas"], g["maxReplicas"]) == (t["min_workers"], t["max_workers"])
        assert g["minReplicas"] * slots >= lo > (g["minReplicas"] - 1) * slots
        assert g["maxReplicas"] * slots >= hi > (g["maxReplicas"] - 1) * slots
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert g["replicas"] * slots >= getattr(serve, pool)
        assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == group_counts(values, pool)
        # The actors ask for the resource this group's pods advertise, slots units per pod.
        flag = getattr(serve, f"{pool}_resource")
        assert flag == values[pool]["rayResource"]
        assert t["resources"][flag] == slots
        other = "decode" if pool == "prefill" else "prefill"
        assert values[other]["rayResource"] not in t["resources"]


def test_ray_autoscaler_is_on_with_the_chosen_options(
    rendered: dict[str, list[dict]],
) -> None:
    """The planner's example runs Ray's autoscaler (it adds the pods the planner's actors wait
    for) with the example's options, on the group level too."""
    example = yaml.safe_load(EXAMPLE.read_text())["autoscaling"]
    rc = one(rendered["planner-autoscaling"], "RayCluster")
    assert rc["spec"]["enableInTreeAutoscaling"] is True
    options = rc["spec"]["autoscalerOptions"]
    assert options["upscalingMode"] == example["upscalingMode"] == "Default"
    assert options["idleTimeoutSeconds"] == example["idleTimeoutSeconds"]
    groups = _groups(rendered["planner-autoscaling"])
    assert {g["idleTimeoutSeconds"] for g in groups.values()} == {example["idleTimeoutSeconds"]}
    values = _merged(yaml.safe_load(EXAMPLE.read_text()))
    for pool in POOLS:
        g = groups[pool]
        assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == group_counts(values, pool)
    # The example uses one GPU per pod, so pods equal the planner's actor bounds.
    assert (groups["prefill"]["minReplicas"], groups["prefill"]["maxReplicas"]) == (
        example["planner"]["minPrefill"],
        example["planner"]["maxPrefill"],
    )


def test_inline_profile_is_a_configmap_mounted_read_only_at_the_flags_path(
    planner_all_set: list[dict[str, Any]], profile_file: Path
) -> None:
    from bench.capacity_profile import CapacityProfile

    cm = one(planner_all_set, "ConfigMap", "-capacity-profile")
    assert cm["metadata"]["name"] == "tandem-capacity-profile"
    # Byte for byte the file given, and a profile the real class loads.
    assert cm["data"] == {"capacity-profile.json": profile_file.read_text()}
    loaded = CapacityProfile.from_dict(json.loads(cm["data"]["capacity-profile.json"]))
    assert loaded == CapacityProfile.load(profile_file)
    _assert_mounted(planner_all_set, "tandem-capacity-profile", "capacity-profile.json")
    try:
        kubernetes_validate.validate(cm, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"ConfigMap: {e.message} at {list(e.path)}")


def test_existing_configmap_is_mounted_and_none_is_made(rendered: dict[str, list[dict]]) -> None:
    manifests = rendered["planner-autoscaling"]
    assert not find(manifests, "ConfigMap", "-capacity-profile")
    example = yaml.safe_load(EXAMPLE.read_text())["autoscaling"]["planner"]["capacityProfile"]
    _assert_mounted(manifests, example["existingConfigMap"], example["key"])


def _assert_mounted(manifests: list[dict[str, Any]], configmap: str, key: str) -> None:
    """The head mounts `key` of `configmap` read-only where --capacity-profile points, and no
    worker pod mounts it (only `tandem serve` on the head reads it)."""
    spec = _head_spec(manifests)
    volumes = [v for v in spec["volumes"] if v.get("configMap", {}).get("name") == configmap]
    assert len(volumes) == 1, spec["volumes"]
    volume = volumes[0]
    assert volume["configMap"]["items"] == [{"key": key, "path": key}]
    mounts = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert len(mounts) == 1 and mounts[0]["readOnly"] is True, mounts
    path = parse_serve_args(head_serve_argv(manifests)).capacity_profile
    assert path == f"{mounts[0]['mountPath'].rstrip('/')}/{key}"
    for pool, g in _groups(manifests).items():
        names = {v["name"] for v in g["template"]["spec"]["volumes"]}
        assert volume["name"] not in names, pool


def test_planner_renders_pass_kubernetes_validate_and_the_crd(
    planner_all_set: list[dict[str, Any]], raycluster_schema: dict
) -> None:
    rc = one(planner_all_set, "RayCluster")
    errors = list(jsonschema.Draft7Validator(raycluster_schema).iter_errors(rc))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:10])
    checked = 0
    for m in planner_all_set:
        if m["kind"] == "RayCluster":
            continue
        kubernetes_validate.validate(m, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 5  # the ConfigMap beside the Service, Secret, NetworkPolicy, Pod, PDBs


@pytest.mark.parametrize(
    "extra",
    [
        [],
        [
            "--set-json",
            f"autoscaling.planner.capacityProfile.json={_json_text({'prefill_points': []})}",
        ],
    ],
    ids=["defaults", "profile-given-planner-off"],
)
def test_planner_off_renders_nothing_of_it(helm: Helm, extra: list[str]) -> None:
    manifests = helm.render(*extra)
    argv = head_serve_argv(manifests)
    assert not given_flags(argv) & PLANNER_ONLY, argv
    assert parse_serve_args(argv).autoscale is False
    assert not find(manifests, "ConfigMap")
    spec = _head_spec(manifests)
    assert not [v for v in spec["volumes"] if "configMap" in v]
    assert "capacity" not in json.dumps(one(manifests, "RayCluster"))
    # The groups keep their own counts.
    defaults = _defaults()
    for pool, g in _groups(manifests).items():
        assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == group_counts(defaults, pool)


def test_null_values_leave_tandems_defaults(helm: Helm, profile_file: Path) -> None:
    """gpuBudget, startupS and downCooldownS left null give no flag, so `tandem serve`'s own
    defaults hold; the rest are always on the line."""
    manifests = helm.render(
        "--set",
        "autoscaling.planner.enabled=true",
        "--set-file",
        f"autoscaling.planner.capacityProfile.json={profile_file}",
    )
    argv = head_serve_argv(manifests)
    nullable = {"--gpu-budget", "--startup-s", "--down-cooldown-s"}
    assert not given_flags(argv) & nullable, argv
    assert PLANNER_ONLY - nullable <= given_flags(argv), argv


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "autoscaling.planner.minPrefill=-1"], "/autoscaling/planner/minPrefill'"),
        (["--set", "autoscaling.planner.minDecode=-2"], "/autoscaling/planner/minDecode'"),
        (["--set", "autoscaling.planner.maxDecode=0"], "/autoscaling/planner/maxDecode'"),
        (["--set", "autoscaling.planner.gpuBudget=-4"], "/autoscaling/planner/gpuBudget'"),
        (["--set", "autoscaling.planner.sloTtftMs=0"], "/autoscaling/planner/sloTtftMs'"),
        (["--set", "autoscaling.planner.intervalS=-1"], "/autoscaling/planner/intervalS'"),
        (["--set", "autoscaling.planner.startupS=-1"], "/autoscaling/planner/startupS'"),
        (["--set", "autoscaling.planner.minPrefil=1"], "'minPrefil' not allowed"),
        (
            ["--set", "autoscaling.planner.minPrefill=5"],
            "autoscaling.planner.minPrefill (5) must be <= autoscaling.planner.maxPrefill (4)",
        ),
        (
            [
                "--set",
                "autoscaling.planner.minDecode=3",
                "--set",
                "autoscaling.planner.maxDecode=2",
            ],
            "autoscaling.planner.minDecode (3) must be <= autoscaling.planner.maxDecode (2)",
        ),
        (
            ["--set", "serving.decode=9"],
            "serving.decode (9 actors to start with) must lie between "
            "autoscaling.planner.minDecode (1) and maxDecode (8)",
        ),
        (
            ["--set", "autoscaling.planner.gpuBudget=1"],
            "autoscaling.planner.gpuBudget (1) is below what the minimum pools hold",
        ),
        (["--set", "autoscaling.enabled=false"], "autoscaling.planner.enabled needs"),
        (["--set", "serving.mode=colocated"], "it needs serving.mode disagg"),
        (
            ["--set", "autoscaling.planner.capacityProfile.mountPath=/tmp/profile"],
            "capacityProfile.mountPath (/tmp/profile) must not lie in /tmp",
        ),
        (
            ["--set", "autoscaling.planner.capacityProfile.mountPath=/models/p"],
            "must not lie in /models",
        ),
    ],
    ids=[
        "negative-min-prefill",
        "negative-min-decode",
        "zero-max-decode",
        "negative-budget",
        "zero-slo",
        "negative-interval",
        "negative-startup",
        "typo",
        "min-gt-max-prefill",
        "min-gt-max-decode",
        "start-outside-bounds",
        "budget-below-minimums",
        "ray-autoscaler-off",
        "colocated",
        "mount-in-tmp",
        "mount-in-model",
    ],
)
def test_bad_planner_values_fail_with_a_clear_message(
    helm: Helm, profile_file: Path, args: list[str], message: str
) -> None:
    proc = helm.template(
        "--set",
        "autoscaling.planner.enabled=true",
        "--set-file",
        f"autoscaling.planner.capacityProfile.json={profile_file}",
        *args,
    )
    assert proc.returncode != 0, f"helm template {args} rendered"
    assert message in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "autoscaling.planner needs exactly one capacity profile"),
        (
            ["--set", "autoscaling.planner.capacityProfile.existingConfigMap=mine", "--set-file"],
            "autoscaling.planner needs exactly one capacity profile",
        ),
        (
            ["--set-json", f"autoscaling.planner.capacityProfile.json={json.dumps('not json')}"],
            "autoscaling.planner.capacityProfile.json is not a capacity profile",
        ),
        (
            ["--set-json", f"autoscaling.planner.capacityProfile.json={_json_text({'a': 1})}"],
            "autoscaling.planner.capacityProfile.json is not a capacity profile",
        ),
    ],
    ids=["none", "both", "not-json", "not-a-profile"],
)
def test_the_profile_must_be_given_once_and_be_a_profile(
    helm: Helm, profile_file: Path, args: list[str], message: str
) -> None:
    if args and args[-1] == "--set-file":
        args = [*args, f"autoscaling.planner.capacityProfile.json={profile_file}"]
    proc = helm.template("--set", "autoscaling.planner.enabled=true", *args)
    assert proc.returncode != 0, f"helm template {args} rendered"
    assert message in proc.stderr, proc.stderr


def test_notes_show_the_planners_bounds(helm: Helm) -> None:
    proc = helm.run(
        "install", "tandem", CHART, "--namespace", "tandem", "--dry-run=client", "-f", EXAMPLE
    )
    assert proc.returncode == 0, proc.stderr
    notes = " ".join(proc.stdout.split("NOTES:", 1)[1].split())
    p = yaml.safe_load(EXAMPLE.read_text())["autoscaling"]["planner"]
    assert "`tandem serve --autoscale`" in notes
    assert f"between {p['minPrefill']}-{p['maxPrefill']} prefill and" in notes
    assert f"{p['minDecode']}-{p['maxDecode']} decode workers ({p['gpuBudget']} GPUs" in notes
    assert f"for TTFT <= {p['sloTtftMs']} ms and TPOT" in notes  # no allowance in the example
    assert "tandem_slo_requests_total{result}" in notes
    per_1k = helm.run(
        "install", "tandem", CHART, "--namespace", "tandem", "--dry-run=client", "-f", EXAMPLE,
        "--set-json", "autoscaling.planner.sloTtftMsPer1k=250",
    )  # fmt: skip
    assert per_1k.returncode == 0, per_1k.stderr
    assert f"TTFT <= {p['sloTtftMs']} ms + 250 ms per 1k prompt tokens" in per_1k.stdout
    # The pod counts shown are the derived ones (one GPU per pod in the example).
    assert f"({p['minPrefill']}-{p['maxPrefill']} prefill pods," in notes
