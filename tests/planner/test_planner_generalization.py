"""benchmarks/planner_generalization.py: the planner on cases outside the committed rows,
each against static sweeps run fresh in the same run."""

from __future__ import annotations

import json

import pytest

from benchmarks import planner_generalization as pg


@pytest.fixture(scope="module")
def longctx_case(tmp_path_factory) -> dict:
    """The long-context shape at a seed no committed row uses (a few seconds to simulate)."""
    path = tmp_path_factory.mktemp("generalization") / "cases.json"
    argv = ["--cases", "syn-longctx:1:3", "--jobs", "1", "--json", str(path)]
    assert pg.main(argv) == 0
    return json.loads(path.read_text())


def test_a_case_is_judged_against_the_cheapest_static_split_at_its_own_attainment(longctx_case):
    (case,) = longctx_case["cases"]
    planner, static = case["planner"], case["static_at_planner_attainment"]
    assert static is not None
    # The sweep's split reaches the planner's attainment (rounded down to 0.01%) ...
    assert static["attainment"] >= int(planner["attainment"] * 1e4) / 1e4
    # ... and the ratio and verdict are read from the two runs, against the case's goal.
    assert case["ratio"] == pytest.approx(planner["gpu_hours"] / static["gpu_hours"])
    assert case["goal"] == pg.ar.goal_for(case["peak_over_mean_per_minute"])
    assert case["met"] == (case["ratio"] <= case["goal"] + 5e-4)
    # The 99% split is the cheapest at its target, so never dearer than one reaching more.
    at_99 = case["static_at_99"]
    assert at_99["attainment"] >= 0.99
    if static["attainment"] >= 0.99:
        assert at_99["gpu_hours"] <= static["gpu_hours"]
    assert case["slo_ms"] == {"ttft": 30000.0, "tpot": 100.0}


def test_the_goal_is_stricter_on_traces_whose_load_swings():
    assert pg.ar.goal_for(1.49) == 1.0
    assert pg.ar.goal_for(1.5) == 0.8


def test_a_case_carries_its_trace_rate_seed_and_target():
    case = pg.Case.parse("mc-conv:2:1:20000")
    assert case == pg.Case("mc-conv", 2, 1, 20000.0)
    argv = case.argv()
    assert argv[argv.index("--rate-scale") + 1] == "mc-conv=2"
    assert argv[argv.index("--seed") + 1] == "1"
    assert argv[argv.index("--slo-ttft-ms") + 1] == "20000.0"
    assert "--slo-ttft-ms" not in pg.Case.parse("mc-conv:2:1").argv()


@pytest.mark.parametrize("text", ["nope:1:0", "mc-conv:0:1", "mc-conv:1", "mc-conv:x:1"])
def test_a_malformed_case_is_refused_by_name_before_any_run(text):
    with pytest.raises(SystemExit, match="TRACE:COPIES:SEED"):
        pg.main(["--cases", text, "--jobs", "1"])


def test_an_absent_trace_is_skipped_with_its_path(monkeypatch):
    monkeypatch.setitem(pg.ar.TRACES, "conv", ("/nonexistent/conv.csv", 20, 1000.0, 50.0))
    out = pg.run_case(("conv:5:2", {}, "benchmarks/results/profile-llama3-8b-h100.json"))
    assert out == {"case": "conv:5:2", "skipped": "/nonexistent/conv.csv is not on this machine"}
