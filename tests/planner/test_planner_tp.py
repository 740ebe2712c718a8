"""A worker of N GPUs in planning: `tandem plan`'s roofline of a TP-N worker (the weights and the
KV split over N GPUs, two all-reduces per layer per step: cluster/planner/roofline.py), the
capacity profile that carries N (measured or planned), and `tandem serve --autoscale` refusing
a profile of another TP size."""

from __future__ import annotations

import pytest

from cluster.planner.gpus import gpu
from cluster.planner.model_shapes import PRESETS
from cluster.planner.roofline import (
    ACTIVATION_BYTES,
    ALLREDUCE_LATENCY_S,
    Hardware,
    RooflineSettings,
    allreduce_s,
    roofline_profile,
)

MODEL = PRESETS["llama-3-70b"]


def test_the_all_reduce_cost_of_a_tp_worker():
    h100 = gpu("h100")
    assert allreduce_s(MODEL, Hardware.of(h100, tp=1)) == (0.0, 0.0)
    fixed, per_token = allreduce_s(MODEL, Hardware.of(h100, tp=4))
    count = 2 * MODEL.num_layers
    assert fixed == pytest.approx(count * ALLREDUCE_LATENCY_S)
    # Ring: 2 (N-1)/N of one token's activations per all-reduce, over NVLink (450 GB/s).
    ring = 2 * 3 / 4 * MODEL.hidden_size * ACTIVATION_BYTES / 450e9
    assert per_token == pytest.approx(count * ring)
    # Without NVLink (L40S) the all-reduces take PCIe: slower per token.
    assert allreduce_s(MODEL, Hardware.of(gpu("l40s"), tp=4))[1] > per_token


def test_a_tp_profile_carries_its_gpus_and_pays_the_all_reduces():
    s = RooflineSettings(max_batch_tokens=4096)
    tp4 = roofline_profile(MODEL, Hardware.of(gpu("h100"), tp=4), s)
    tp8 = roofline_profile(MODEL, Hardware.of(gpu("h100"), tp=8), s)
    assert (tp4.gpus_per_worker, tp8.gpus_per_worker) == (4, 8)
    # Twice the GPUs halve the weights' read but not the all-reduces' latency: less than 2x.
    assert tp8.decode_fixed_s > tp4.decode_fixed_s / 2
    fixed, per_token = allreduce_s(MODEL, Hardware.of(gpu("h100"), tp=8))
    assert tp8.decode_per_seq_s > per_token > 0  # each sequence's token is all-reduced too
    # Every prefill point pays the all-reduces of its tokens.
    tokens, seconds = tp8.prefill_points[-1]
    assert seconds > fixed + per_token * tokens


def test_the_capacity_run_measures_and_serves_workers_of_its_tp_size():
    from bench.capacity import engine_config
    from bench.capacity_config import CapacityConfig
    from bench.capacity_live import serve_flags

    cfg = CapacityConfig(model="m", tp=2, threads=1)
    assert engine_config(cfg, "colocated").tensor_parallel_size == 2
    flags = serve_flags(cfg)
    assert flags[flags.index("--prefill-tp") + 1] == flags[flags.index("--decode-tp") + 1] == "2"
    assert flags[flags.index("--num-cpus") + 1] == "4"  # a core share per rank
    with pytest.raises(ValueError, match="tp"):
        CapacityConfig(model="m", tp=0)


def test_plan_writes_a_profile_of_a_tp_worker_and_serve_checks_it(tmp_path):
    from cluster import cli
    from cluster.settings import ServeSettings

    out = tmp_path / "tp4.json"
    argv = ["plan", "--model", "llama-3-70b", "--gpu", "h100", "--tp", "4", "--out", str(out)]
    assert cli.main(argv) == 0
    auto = {"autoscale": True, "capacity_profile": str(out), "planner": {"gpu_budget": 32}}
    s = ServeSettings(model="/m", prefill_tp=4, decode_tp=4, **auto)
    assert s.capacity_profile_data().gpus_per_worker == 4
    assert s.planner_config().budget_gpus({"prefill": 4, "decode": 4}) == 32
    with pytest.raises(ValueError, match="describes a worker of 4 GPU"):
        ServeSettings(model="/m", prefill_tp=2, decode_tp=1, **auto)
