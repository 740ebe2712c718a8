"""Tensor parallelism in the chart: serving.prefillTp / decodeTp (and tp for colocated
replicas) become `tandem serve --prefill-tp/--decode-tp/--tp`, the real settings accept the
head's line, each pool's pods hold whole TP groups (a group's ranks share one pod), and the
planner's GPU budget and pod bounds count workers x TP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers import (
    CHART,
    Helm,
    group_counts,
    head_serve_argv,
    one,
    parse_serve_args,
    with_local_profile,
)

TP_SET = {
    "serving.prefillTp": "2",
    "serving.decodeTp": "4",
    "serving.prefill": "3",
    "serving.decode": "1",
    "prefill.gpusPerPod": "8",
    "decode.gpusPerPod": "4",
    "autoscaling.planner.enabled": "true",
    "autoscaling.planner.minPrefill": "2",
    "autoscaling.planner.maxPrefill": "9",
    "autoscaling.planner.minDecode": "1",
    "autoscaling.planner.maxDecode": "3",
    "autoscaling.planner.gpuBudget": "30",
}


@pytest.fixture(scope="module")
def tp_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A profile of a TP-2 worker (the prefill pool's), as `tandem plan --tp 2` writes it."""
    from bench.capacity_profile import CapacityProfile

    profile = CapacityProfile(
        model="Llama-3.1-70B-Instruct",
        hardware="h100-sxm x2",
        source="roofline",
        prefill_points=[(256, 0.03), (2048, 0.2), (8192, 0.8)],
        decode_fixed_s=0.02,
        decode_per_seq_s=4e-5,
        decode_per_ctx_token_s=3e-9,
        kv_bytes_per_token=327680,
        transfer_latency_s=0.002,
        transfer_bytes_per_s=4.0e10,
        kv_capacity_tokens=200000,
        max_batch_tokens=8192,
        max_num_seqs=256,
        startup_s=120.0,
        gpus_per_worker=2,
    )
    return profile.save(tmp_path_factory.mktemp("tp-profile") / "capacity.json")


def _args(values: dict[str, str], profile: Path) -> list[str]:
    args = [a for k, v in values.items() for a in ("--set", f"{k}={v}")]
    return [*args, "--set-file", f"autoscaling.planner.capacityProfile.json={profile}"]


def _groups(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    rc = one(manifests, "RayCluster")
    return {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}


def _values(chosen: dict[str, str]) -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for key, raw in chosen.items():
        *path, last = key.split(".")
        node = values
        for p in path:
            node = node[p]
        node[last] = yaml.safe_load(raw)
    return values


def test_tp_values_reach_serve_and_the_planner_counts_gpus(helm: Helm, tp_profile: Path):
    from cluster.serve import settings_from_args

    manifests = helm.render(*_args(TP_SET, tp_profile))
    argv = head_serve_argv(manifests)
    ns = parse_serve_args(argv)
    assert (ns.prefill_tp, ns.decode_tp, ns.gpu_budget) == (2, 4, 30)
    settings = settings_from_args(parse_serve_args(with_local_profile(argv, tp_profile)))
    assert (settings.tp_size("prefill"), settings.tp_size("decode")) == (2, 4)
    config = settings.planner_config()
    assert config.budget_gpus(config.pool_gpus(2)) == 30
    # Pods hold whole groups: 8 GPUs = 4 prefill workers of TP 2; 4 GPUs = 1 decode worker.
    groups, values = _groups(manifests), _values(TP_SET)
    for pool in ("prefill", "decode"):
        g = groups[pool]
        assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == group_counts(values, pool)
    assert (groups["prefill"]["minReplicas"], groups["prefill"]["maxReplicas"]) == (1, 3)
    assert (groups["decode"]["minReplicas"], groups["decode"]["maxReplicas"]) == (1, 3)


def test_colocated_replicas_get_tp(helm: Helm):
    argv = head_serve_argv(helm.render("--set", "serving.mode=colocated", "--set", "serving.tp=2"))
    ns = parse_serve_args(argv)
    assert (ns.mode, ns.tp) == ("colocated", 2)
    plain = parse_serve_args(head_serve_argv(helm.render()))
    assert (plain.prefill_tp, plain.decode_tp) == (1, 1)  # the defaults: one GPU a worker


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"serving.prefillTp": "4", "prefill.gpusPerPod": "2"},
            "serving.prefillTp (4) is more than a prefill pod has",
        ),
        (
            {
                "serving.decodeTp": "2",
                "serving.decode": "3",
                "decode.gpusPerPod": "3",  # one TP-2 group a pod; the third GPU idles
                "decode.maxReplicas": "2",
            },
            "serving.decode (3 actors) exceeds what decode.maxReplicas x slots per pod can hold "
            "(2) with serving.decodeTp 2",
        ),
        ({"serving.prefillTp": "0"}, "prefillTp"),
        ({"serving.decodeTp": "17"}, "decodeTp"),
    ],
    ids=["group-larger-than-pod", "pods-hold-too-few-groups", "zero", "too-large"],
)
def test_bad_tp_values_fail_with_a_clear_message(helm: Helm, values: dict, message: str):
    args = [a for k, v in values.items() for a in ("--set", f"{k}={v}")]
    proc = helm.template(*args)
    assert proc.returncode != 0, f"helm template {args} rendered"
    assert message in proc.stderr, proc.stderr


def test_the_gpu_budget_must_hold_the_minimum_pools_in_gpus(helm: Helm, tp_profile: Path):
    chosen = {**TP_SET, "autoscaling.planner.gpuBudget": "7"}  # 2 x 2 + 1 x 4 = 8 GPUs
    proc = helm.template(*_args(chosen, tp_profile))
    assert proc.returncode != 0
    assert "minPrefill x prefillTp + minDecode x decodeTp = 2 x 2 + 1 x 4 = 8 GPUs" in proc.stderr
