"""benchmarks/planner_ablation.py: the planner run twice per row (as configured, and with
settings changed) against the static sweeps a results JSON recorded."""

from __future__ import annotations

import json

import pytest

from benchmarks import planner_ablation


@pytest.fixture(scope="module")
def flat_floor_raised(tmp_path_factory) -> dict:
    """syn-flat with the prefill pool's floor raised to 6 (the planner holds 4 there)."""
    path = tmp_path_factory.mktemp("ablation") / "rows.json"
    argv = ["--rows", "syn-flat", "--set", "min_prefill=6", "--jobs", "1", "--json", str(path)]
    assert planner_ablation.main(argv) == 0
    return json.loads(path.read_text())


def test_a_changed_setting_is_run_beside_the_baseline_and_both_meet_the_recorded_sweep(
    flat_floor_raised,
):
    assert flat_floor_raised["settings"] == {"min_prefill": 6}
    (row,) = flat_floor_raised["rows"]
    base, changed = row["baseline"], row["changed"]
    # Six prefill workers for the hour cost at least 6 GPU-h where the baseline holds 4.
    assert changed["gpu_hours"] > base["gpu_hours"] + 1.5
    recorded = json.loads(
        (planner_ablation.RESULTS / "synthetic/autoscale_results.json").read_text()
    )["traces"]["syn-flat"]
    points = [p for s in recorded["sweeps"].values() for p in s["points"]]
    for run in (base, changed):
        best = planner_ablation.cheapest_static(points, run["attainment"])
        assert run["static"] == f"{best['prefill']}:{best['decode']}"
        assert run["ratio"] == pytest.approx(run["gpu_hours"] / best["gpu_hours"])


def test_the_cheapest_static_split_is_read_at_the_runs_attainment_rounded_down():
    points = [
        {"prefill": 3, "decode": 2, "attainment": 0.98, "gpu_hours": 5.0},
        {"prefill": 4, "decode": 2, "attainment": 0.99, "gpu_hours": 6.0},
        {"prefill": 2, "decode": 2, "attainment": 0.999, "gpu_hours": 4.0, "aborted": "x"},
    ]
    assert planner_ablation.cheapest_static(points, 0.98009)["prefill"] == 3
    assert planner_ablation.cheapest_static(points, 0.985)["prefill"] == 4
    assert planner_ablation.cheapest_static(points, 0.995) is None  # aborted points are out


@pytest.mark.parametrize("item", ["no_such_setting=1", "min_prefill"])
def test_a_setting_that_is_not_a_planner_field_is_refused(item):
    with pytest.raises(SystemExit, match="PlannerConfig field"):
        planner_ablation.parse_settings([item])


def test_a_value_the_planner_config_refuses_is_refused_before_any_run():
    with pytest.raises(SystemExit, match="down_fraction must be in"):
        planner_ablation.parse_settings(["down_fraction=1.0"])


def test_a_second_ten_times_the_minute_before_stands_at_ten():
    from types import SimpleNamespace

    steady = [SimpleNamespace(arrival_s=s + 0.5, prompt_len=100) for s in range(130)]
    burst = [SimpleNamespace(arrival_s=104.2, prompt_len=900)]
    ratios = planner_ablation.peak_ratios(steady + burst)
    assert ratios["p50"] == pytest.approx(1.0)
    assert ratios["max"] == pytest.approx(10.0)
    assert planner_ablation.peak_ratios([]) == {}
