"""The ServeGen slice reader: requests drawn per client at the published rate, burstiness and
lengths, seeded; the committed slices load; anything else is refused by name."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import statistics
from pathlib import Path

import pytest
from sim_fakes import make_profile

from cluster.cli import main
from cluster.simulator.servegen import SLICE_FORMAT, draw_servegen
from cluster.simulator.traces import detect_format, load_requests

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "benchmarks/traces"


def write_slice(path: Path, clients: list[dict], start_s: int = 600, window_s: int = 600) -> Path:
    source = {"start_s": start_s, "duration_s": window_s * 2, "window_s": window_s}
    doc = {"format": SLICE_FORMAT, "source": source, "clients": clients}
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


def client(windows, prompts=((100, 0.5), (300, 0.5)), answers=((20, 1.0),)) -> dict:
    lengths = {str(w[0]): {"input": list(prompts), "output": list(answers)} for w in windows}
    return {"client": 0, "windows": [list(w) for w in windows], "lengths": lengths}


def test_counts_follow_the_rate_per_window_and_lengths_the_pdfs(tmp_path):
    path = write_slice(
        tmp_path / "t.servegen.json.gz",
        [client([(600, 2.0, 1.0, "Gamma", 1.0, 0.5), (1200, 0.5, 1.0, "Weibull", 1.0, 2.0)])],
    )
    assert detect_format(path) == "servegen"
    reqs = load_requests(path, seed=3)
    first = [r for r in reqs if r.arrival_s < 600]
    second = [r for r in reqs if 600 <= r.arrival_s < 1200]
    # rate x window exactly (whole numbers here), arrivals relative to the slice's start
    assert (len(first), len(second), len(reqs)) == (1200, 300, 1500)
    assert reqs == sorted(reqs, key=lambda r: r.arrival_s)
    assert {r.prompt_len for r in reqs} == {100, 300} and {r.output_len for r in reqs} == {20}
    assert 0.4 < sum(r.prompt_len == 100 for r in reqs) / len(reqs) < 0.6
    assert load_requests(path, seed=3) == reqs and load_requests(path, seed=4) != reqs


def test_a_bursty_client_arrives_in_bursts_a_smooth_one_does_not(tmp_path):
    def gap_cv(shape: float) -> float:
        windows = [(600, 5.0, 0.0, "Gamma", shape, 1.0 / (5.0 * shape))]
        path = write_slice(tmp_path / f"{shape}.servegen.json.gz", [client(windows)])
        times = [t for t, _, _ in draw_servegen(path, seed=1)]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        return statistics.pstdev(gaps) / statistics.mean(gaps)

    # ServeGen's fits: shape 0.04 is a CV of 5 (a client sending in bursts), 1 is Poisson.
    assert gap_cv(0.04) > 3.0
    assert 0.8 < gap_cv(1.0) < 1.2


def test_the_committed_slices_load_and_match_their_checksums():
    readme = (TRACES / "README.md").read_text()
    for name, low, high in (("servegen_m_large_h10", 70, 76), ("servegen_m_large_h20", 205, 225)):
        path = TRACES / f"{name}.servegen.json.gz"
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert re.search(rf"`{name}\.servegen\.json\.gz`.*`{digest}`", readme), name
        reqs = load_requests(path)
        assert low < len(reqs) / 3600 < high  # the published mean rate of the kept clients
        assert all(0 <= r.arrival_s <= 3600 for r in reqs)


def test_a_file_that_is_not_a_slice_is_refused_by_name(tmp_path):
    plain = tmp_path / "x.servegen.json.gz"
    plain.write_bytes(gzip.compress(b'{"format": "other"}'))
    with pytest.raises(ValueError, match="x.servegen.json.gz: not a tandem-servegen-slice/1"):
        load_requests(plain)
    plain.write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="x.servegen.json.gz: not a gzip JSON"):
        load_requests(plain)
    empty = write_slice(tmp_path / "e.servegen.json.gz", [client([(600, 1.0, 1.0, "Gamma", 1, 1)])])
    doc = json.loads(gzip.decompress(empty.read_bytes()))
    doc["clients"][0]["lengths"]["600"]["input"] = []
    empty.write_bytes(gzip.compress(json.dumps(doc).encode()))
    with pytest.raises(ValueError, match="e.servegen.json.gz: bad ServeGen slice .*PDF is empty"):
        load_requests(empty)


def test_tandem_simulate_draws_a_slice_with_its_seed(tmp_path):
    windows = [(600, 1.0, 1.0, "Gamma", 0.5, 2.0), (1200, 0.2, 1.0, "Weibull", 0.7, 1.0)]
    trace = str(write_slice(tmp_path / "t.servegen.json.gz", [client(windows)]))
    profile = str(make_profile(max_num_seqs=32, startup_s=5.0).save(tmp_path / "p.json"))
    counts = []
    for seed in ("1", "1", "2"):
        out = tmp_path / f"out{len(counts)}"
        argv = ["simulate", "--trace", trace, "--profile", profile, "--out", str(out), "--quiet"]
        assert main([*argv, "--policy", "static:1:1", "--seed", seed]) == 0
        summary = json.loads((out / "simulation.json").read_text())["summary"]
        counts.append((summary["requests"], summary["ttft_ms"]["p50"]))
    assert counts[0][0] == 720 and counts[0] == counts[1] and counts[2] != counts[0]
