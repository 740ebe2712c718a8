"""benchmarks/compare_disagg.py --quick against the tiny llama: three of its four deployments
(1P+1D disagg, the same with --quantized, 2 colocated replicas with chunked prefill; the fourth,
colocated without chunked prefill, is the same deployment with one flag off and costs a
deployment start) start on a local Ray cluster, serve real streamed requests, and the run
writes its JSON, markdown table and plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_compare_quick_writes_table_json_and_plot(make_tiny_model, tmp_path):
    model = make_tiny_model("llama", "tiny", 0)
    out = tmp_path / "compare"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "compare_disagg.py"),
            "--quick",
            "--modes",
            "disagg,disagg-quantized,colocated-chunked",
            "--model",
            str(model),
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "compare.json").read_text())
    modes = {p["mode"] for p in doc["points"]}
    assert modes == {"disagg", "disagg-quantized", "colocated-chunked"}
    for p in doc["points"]:
        assert p["completed"] == 4 and p["failed"] == 0, p
        assert p["ttft_p50_ms"] > 0 and p["tpot_p99_ms"] > 0 and p["output_tok_s"] > 0
        raw = json.loads((out / p["raw_json"]).read_text())
        assert len(raw["requests"]) == 4
        # ignore_eos makes every output exactly as long as asked.
        assert all(r["output_len"] == r["target_output_len"] for r in raw["requests"])
    # In disagg every prompt went through the prefill actor (threshold 0).
    for mode in ("disagg", "disagg-quantized"):
        disagg = next(p for p in doc["points"] if p["mode"] == mode)
        assert disagg["worker_stats"]["decode-0"].get("local_prefills", 0) == 0
    # The quantized deployment really ran quantized pools (int8: weight-only decode on CPU).
    quant = next(p for p in doc["points"] if p["mode"] == "disagg-quantized")["worker_stats"]
    assert (quant["prefill-0"]["weights"], quant["decode-0"]["weights"]) == ("fp8", "int8")
    plain = next(p for p in doc["points"] if p["mode"] == "disagg")["worker_stats"]
    assert plain["prefill-0"]["weights"] == plain["decode-0"]["weights"] != "int8"
    ratios = doc["tpot_p99_ratio_disagg_over_colocated"]
    assert sorted(r["mode"] for r in ratios) == ["disagg", "disagg-quantized"]
    assert all(r["colocated-chunked"] > 0 for r in ratios)
    md = (out / "compare.md").read_text()
    assert "| chat | 2 | disagg |" in md and "TPOT p99 ratio" in md
    assert "| chat | 2 | disagg-quantized |" in md
    assert (out / "compare_chat.png").read_bytes().startswith(PNG_MAGIC)
    assert "| chat | 2 | colocated-chunked |" in proc.stdout
