"""How long `tandem serve` takes to start, this tree against another commit, in the same run.

Every live test, every `make demo` and every replacement worker pays a start: Ray up, the
controller, each worker's imports, model and KV agent, the router's tokenizer. This starts
`tandem serve --prefill 1 --decode 1` (fp32, CPU, `--num-cpus 2`) on the tiny llama, or with
`--model smollm2` on SmolLM2-135M-Instruct's GGUF file (`tandem fetch-model`), for this
tree and for `--ref` (materialized with `git archive` into a temporary folder, run with
`PYTHONPATH` and cwd naming it), rounds alternated and the order flipped each round, and
times from the process start to its ready file (`--ready-file`), then stops it (SIGTERM) and
checks it exited 0. One unmeasured start per tree first (files cached, kernels built).
Prints each tree's times, the medians and new / ref per round.

Usage: `python benchmarks/serve_startup.py [--ref REV] [--model tiny|smollm2] [--rounds 5]
[--json OUT]`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import load_avg, machine_info, write_json  # noqa: E402

FLAGS = ("--dtype", "float32", "--prefill", "1", "--decode", "1", "--num-cpus", "2")


def start_once(tree: Path, model: str, workdir: Path, timeout_s: float = 180.0) -> float:
    """Seconds from starting `tandem serve` of `tree` to its ready file; stopped after."""
    ready = workdir / "ready.json"
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--model", model, "--port", "0"]
    cmd += ["--ready-file", str(ready), *FLAGS]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with open(workdir / "serve.log", "a") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        while not ready.exists():
            if proc.poll() is not None or time.perf_counter() - t0 > timeout_s:
                proc.kill()
                raise RuntimeError(f"{tree}: tandem serve did not start (see {workdir})")
            time.sleep(0.05)
        elapsed = time.perf_counter() - t0
    json.loads(ready.read_text())  # written whole (atomically) by either tree
    proc.send_signal(signal.SIGTERM)
    if proc.wait(timeout=60) != 0:
        raise RuntimeError(f"{tree}: tandem serve exited with {proc.returncode}")
    return elapsed


def materialize(ref: str, into: Path) -> Path:
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", ref], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="64ee8d3", help="the commit to compare against")
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.model == "smollm2":
        from tools.real_model import fetch_model

        model = str(fetch_model("smollm2"))
    else:
        from tools.make_model import cached_model

        model = str(cached_model("llama", "tiny"))
    with tempfile.TemporaryDirectory(prefix="tandem-startup-") as tmp:
        trees = {"new": REPO, "ref": materialize(args.ref, Path(tmp) / "ref")}
        work = {name: Path(tmp) / f"run-{name}" for name in trees}
        for name, tree in trees.items():
            work[name].mkdir()
            start_once(tree, model, work[name])  # unmeasured: caches warm, kernels built
        times: dict[str, list[float]] = {name: [] for name in trees}
        for r in range(args.rounds):
            order = ["new", "ref"] if r % 2 == 0 else ["ref", "new"]
            for name in order:
                times[name].append(start_once(trees[name], model, work[name]))
            print(
                f"round {r + 1}: new {times['new'][-1]:.2f} s, ref {times['ref'][-1]:.2f} s, "
                f"new/ref {times['new'][-1] / times['ref'][-1]:.2f} (load {load_avg():.1f})",
                flush=True,
            )
    med = {name: statistics.median(t) for name, t in times.items()}
    ratios = [n / r for n, r in zip(times["new"], times["ref"], strict=True)]
    print(
        f"median start: new {med['new']:.2f} s, ref ({args.ref}) {med['ref']:.2f} s; "
        f"new/ref per round {min(ratios):.2f}-{max(ratios):.2f}, of medians "
        f"{med['new'] / med['ref']:.2f}"
    )
    if args.json:
        result = {"ref": args.ref, "model": model, "flags": FLAGS, "seconds": times}
        result["median_s"] = med
        write_json(args.json, {**result, "ratios": ratios, "machine": machine_info(2)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
