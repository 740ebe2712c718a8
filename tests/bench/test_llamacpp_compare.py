"""benchmarks/llamacpp_compare.py's own logic, without llama.cpp or a model: reading
llama-bench's JSON, greedy agreement counts, the per-round ratio summary and table, the
`--only` flag, and the build step's checks (missing tools named, ninja progress echoed, a
failed command's log tail raised)."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import llamacpp_build as lb
from benchmarks.llamacpp_compare import parse_args
from benchmarks.llamacpp_report import (
    agreement,
    format_table,
    parse_llama_bench,
    plot,
    round_line,
    summarize_section,
)

# Two rows as `llama-bench -o json` prints them (fields trimmed to a representative set).
BENCH_JSON = """[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "model_type": "llama ?B BF16",
    "n_threads": 2,
    "n_prompt": 512,
    "n_gen": 0,
    "n_depth": 0,
    "avg_ns": 560000000,
    "avg_ts": 914.285714,
    "stddev_ts": 0.0,
    "samples_ts": [914.285714]
  },
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "n_threads": 2,
    "n_prompt": 0,
    "n_gen": 128,
    "avg_ts": 84.5,
    "samples_ts": [84.5]
  }
]
"""


def test_parse_llama_bench_rows_and_leading_noise():
    rows = parse_llama_bench("build: 0c1e570 (1)\n" + BENCH_JSON)
    assert [(r["n_prompt"], r["n_gen"]) for r in rows] == [(512, 0), (0, 128)]
    assert rows[0]["avg_ts"] == pytest.approx(914.285714)
    assert rows[1]["build_commit"] == "0c1e570"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("no json here", "no JSON array"),
        ('[{"n_prompt": 0, "n_gen": 128}]', r"lacks \['avg_ts'\]"),
        ('[{"n_prompt": 0, "n_gen": 128, "avg_ts": 0}]', "avg_ts 0"),
        ("[1]", "lacks"),
    ],
)
def test_parse_llama_bench_rejects_bad_output(text, match):
    with pytest.raises(ValueError, match=match):
        parse_llama_bench(text)


def test_agreement_counts_equal_tokens_and_first_divergence():
    pairs = [
        ([1, 2, 3, 4], [1, 2, 3, 4]),  # identical
        ([1, 2, 9, 4], [1, 2, 3, 4]),  # diverges at 2, coincides again at 3
        ([5, 6], [5, 6, 7]),  # one ran shorter: diverges where it stopped
    ]
    result = agreement(pairs)
    assert result == {
        "equal": 4 + 3 + 2,
        "equal_prefix": 4 + 2 + 2,
        "total": 4 + 4 + 3,
        "first_divergence": [None, 2, 2],
    }


def _rounds() -> list[dict]:
    return [
        {"llama": 80.0, "tandem": 40.0, "ratio": 0.5, "load_avg_1m": 1.0},
        {"llama": 100.0, "tandem": 60.0, "ratio": 0.6, "load_avg_1m": 1.2},
        {"llama": 90.0, "tandem": 63.0, "ratio": 0.7, "load_avg_1m": 0.9},
    ]


def test_summary_and_table():
    summary = summarize_section(_rounds())
    assert summary["ratio"] == {"min": 0.5, "median": 0.6, "max": 0.7}
    assert summary["llama"] == {"min": 80.0, "median": 90.0, "max": 100.0}
    sections = {"decode": {"rounds": _rounds(), "summary": summary}}
    sections["prefill"] = {"rounds": [{"llama": 900.0, "tandem": 900.0, "ratio": 1.0}]}
    table = format_table(sections).splitlines()
    assert table[2] == (
        "| decode, batch 1, bf16 (tok/s) | 80-100 | 40-63 | **0.50-0.70** | 0.50, 0.60, 0.70 |"
    )
    # One round (or equal ends): a single figure, not "900-900".
    assert table[3] == (
        "| prefill, one 512-token prompt, bf16 (tok/s) | 900 | 900 | **1.00** | 1.00 |"
    )
    assert "tandem/llama.cpp 0.50 (load 1.00)" in round_line("decode", 1, _rounds()[0], "tok/s")
    with pytest.raises(ValueError):
        summarize_section([])


def test_plot_draws_every_section_as_a_png(tmp_path):
    sections = {"decode": {"rounds": _rounds()}, "int8": {"rounds": _rounds()[:1]}}
    out = tmp_path / "ratios.png"
    plot(sections, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_only_flag_accepts_sections_and_rejects_others(capsys):
    args = parse_args(["--only", "decode, int8", "--rounds", "1", "--skip-build"])
    assert args.only == ["decode", "int8"] and args.rounds == 1 and args.skip_build
    with pytest.raises(SystemExit):
        parse_args(["--only", "decode,bogus"])
    assert "bogus" in capsys.readouterr().err


def test_missing_build_tools_are_named(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(lb.BuildError, match="cmake, ninja, c\\+\\+"):
        lb.check_tools()


def test_build_progress_is_echoed_and_failures_raise(tmp_path, capsys):
    script = 'for i in 1 2 3 4; do echo "[$i/4] Building x$i.o"; done'
    lb._run_with_progress(["sh", "-c", script], tmp_path / "ok.log", every=2)
    assert capsys.readouterr().out.splitlines() == [
        "llama.cpp build: 2/4",
        "llama.cpp build: 4/4",
    ]
    assert (tmp_path / "ok.log").read_text().count("Building") == 4
    fail = [sys.executable, "-c", "print('error: no such target'); raise SystemExit(3)"]
    with pytest.raises(lb.BuildError, match="(?s)exit 3.*no such target"):
        lb._run_with_progress(fail, tmp_path / "bad.log")


def test_layout_is_built_only_with_every_target(tmp_path):
    layout = lb.Layout(tmp_path)
    assert not layout.built()
    (tmp_path / "build" / "bin").mkdir(parents=True)
    for name in lb.TARGETS[:-1]:
        layout.binary(name).write_text("")
    assert not layout.built()
    layout.binary(lb.TARGETS[-1]).write_text("")
    assert layout.built()
    json.dumps({"source": str(layout.source)})  # paths are plain strings in the result JSON
