"""The engine benchmarks run end to end in `--quick` mode (tiny model) and write the
fields their reports are built from. No timing is asserted: the machine is shared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, out: Path, model_dir: Path) -> tuple[str, dict]:
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / script),
            "--quick",
            "--json",
            str(out),
            "--model-dir",
            str(model_dir),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_offline_throughput_quick(make_tiny_model, tmp_path):
    stdout, r = _run("offline_throughput.py", tmp_path / "ot.json", make_tiny_model("llama"))
    assert "ratio vs padded batches" in stdout and "ratio vs one at a time" in stdout
    for side in ("tandem", "hf_batched", "hf_single"):
        assert r[side]["output_tokens_per_s"] > 0
        assert r[side]["output_tokens"] > 0
    # The tandem run and the padded batches cover every request's requested tokens.
    assert r["tandem"]["output_tokens"] == r["config"]["total_output_tokens"]
    assert r["hf_batched"]["output_tokens"] == r["config"]["total_output_tokens"]
    assert r["ratio_vs_hf_batched"] == pytest.approx(
        r["tandem"]["output_tokens_per_s"] / r["hf_batched"]["output_tokens_per_s"]
    )
    assert r["ratio_vs_hf_single"] > 0
    assert isinstance(r["meets_goals"], bool)


@pytest.mark.timeout(300)
def test_roofline_quick(make_tiny_model, tmp_path):
    stdout, r = _run("roofline.py", tmp_path / "rf.json", make_tiny_model("llama"))
    assert "of the bandwidth bound" in stdout and "of the GEMM peak" in stdout
    assert r["read_bandwidth"]["best_bytes_per_s"] > 0
    assert r["gemm_peak"]["peak_flops"] > 0
    res = r["results"][r["config"]["dtype"]]
    for b in ("1", "16"):
        d = res["decode"][b]
        assert d["weight_bytes"] > 0 and d["kv_bytes"] > 0
        assert d["fraction_of_bound"] == pytest.approx(
            d["bound_seconds"] / d["step_seconds"]["median"]
        )
    assert res["prefill"]["tokens"] == 128 and res["prefill"]["fraction_of_peak"] > 0
    assert r["decode_b1_fraction"] == res["decode"]["1"]["fraction_of_bound"]


@pytest.mark.timeout(300)
def test_quant_accuracy_quick(make_tiny_model, tmp_path):
    """Random weights here (the accuracy bounds are tests/engine/test_quant_accuracy.py's on
    trained ones): only that every mode is measured and the table is printed."""
    stdout, r = _run("quant_accuracy.py", tmp_path / "qa.json", make_tiny_model("llama"))
    assert "| arch | mode | cos mean" in stdout and "issue bounds" in stdout
    modes = r["results"]["llama"]["modes"]
    assert set(modes) == {"bf16", "fp8", "fp8-weight-only", "int8", "int8-w8a8", "fp8+int8"}
    for mode in ("bf16", "fp8", "fp8-weight-only", "int8", "int8-w8a8"):
        row = modes[mode]
        assert -1.0 <= row["cos_min"] <= row["cos_mean"] <= 1.0 + 1e-6
        assert 0.0 <= row["top1"] <= 1.0 and row["kl"] >= 0.0
        assert row["by_group"]["corpus"]["positions"] == 400  # 2 windows of 200 in --quick
    assert modes["bf16"]["kl_ratio"] == pytest.approx(1.0)
    assert all(0.0 <= m["greedy"] <= 1.0 for m in modes.values())


@pytest.mark.timeout(300)
def test_quant_speed_quick(make_tiny_model, tmp_path):
    stdout, r = _run("quant_speed.py", tmp_path / "qs.json", make_tiny_model("llama"))
    assert "| fp8 (bfloat16) | fp8 |" in stdout
    rows = r["rows"]
    layouts = {name: row["quantization"] for name, row in rows.items()}
    assert layouts == {
        "bf16": "none",
        "fp32": "none",
        "int8 (bfloat16)": "int8",
        "fp8 (bfloat16)": "fp8",
        "fp8-weight-only (bfloat16)": "fp8-weight-only",
    }
    for name, row in rows.items():
        assert row["prefill_tok_s"] > 0 and row["decode_step_ms"] > 0, name
        # The quantized layouts hold 1-byte weights plus fp32 scales: about half of bf16's.
        if row["quantization"] != "none":
            assert row["projection_bytes_vs_bf16"] <= 0.55, name


@pytest.mark.timeout(300)
def test_cpu_decode_compares_the_routings_against_the_read_bound(make_tiny_model, tmp_path):
    from engine import kernels

    if kernels.ops() is None or kernels.ops().gemv is None:
        pytest.skip("engine.kernels' GEMV needs AVX-512 or AVX2+FMA")  # the benchmark refuses too
    sys.path.insert(0, str(REPO))
    from benchmarks import cpu_decode

    out = tmp_path / "cd.json"
    model = str(make_tiny_model("llama"))
    assert (
        cpu_decode.main(
            [
                "--model",
                model,
                "--rounds",
                "1",
                "--tokens",
                "4",
                "--bandwidth-mib",
                "64",
                "--threads",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    one = r["threads"]["1"]
    assert set(one["seconds_per_token"]) == {"torch", "kernel", "stack"}
    assert all(len(v) == 1 for v in one["speedup_vs_torch_per_round"].values())
    assert r["same_text_kernel_stack"]  # the C++ loop is the Python layers' twin
    # bf16 weights, every parameter once; an untied embedding table is only indexed, a tied
    # one is read once as the head: the bytes a step reads.
    from safetensors import safe_open

    with safe_open(str(Path(model) / "model.safetensors"), "pt") as f:
        sizes = {k: f.get_tensor(k).numel() for k in f.keys()}
    if "lm_head.weight" in sizes:
        sizes.pop("model.embed_tokens.weight")
    assert r["step_bytes"] == 2 * sum(sizes.values())
    bw = r["read_bandwidth_bytes_per_s"]
    assert bw["best"] == max(bw["plain_pages"], bw["huge_pages"])  # the strict bound
    assert r["bound_s"] == pytest.approx(r["step_bytes"] / bw["best"])


def test_cpu_ops_ab_times_every_op_of_a_tree():
    """The per-tree half of benchmarks/cpu_ops_ab.py (what each child process runs) on this
    tree; the A/B itself builds another commit's kernels (a minute), run by hand."""
    from engine.kernels import ops

    if ops() is None:
        pytest.skip("no CPU kernels on this machine (no compiler)")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import cpu_ops_ab
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    times = cpu_ops_ab.measure([1])
    ops_timed = {"silu_mul", "add_rms_norm", "rope_"} | {
        f"attention ctx {c}" for c in cpu_ops_ab.CONTEXTS
    }
    ops_timed |= {f"head {w}" for w in ("int8-w8a8", "int8", "bf16")}
    assert set(times) == {f"1T {op}" for op in ops_timed}
    assert all(t > 0 for t in times.values())
