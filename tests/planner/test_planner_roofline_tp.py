"""`tandem plan`'s roofline of a TP-N worker: the weights and the KV split over N GPUs, and two
all-reduces per layer per step (the row-parallel projections), as cluster/planner/roofline.py
states them; the profile says how many GPUs the worker holds."""

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
