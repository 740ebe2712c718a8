"""Reading a week-long trace: the whole file against one window of it, in the same run.

    PYTHONPATH=. .venv/bin/python benchmarks/trace_load.py --rows 2000000 --json OUT

Azure 2024's traces are a week each (17M and 27M rows, `TIMESTAMP` like `2024-05-10
00:00:00.009930+00:00`); `tandem simulate --trace-start-s/--duration-s` passes its window to
the CSV reader, which keeps only that window's rows. This writes a CSV of `--rows` rows in
that format (Poisson arrivals at `--rate` req/s, seeded lengths), then loads it twice, each
in a fresh child process: whole (`load_requests(path)`) and windowed (`load_requests(path,
start_s=..., duration_s=...)`), printing each load's seconds and the child's peak RSS, and
the windowed / whole ratios. The two must give the same requests for the window (checked).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, resource, sys, time
from cluster.simulator.traces import load_requests, shape_requests
path, start, duration = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
t0 = time.perf_counter()
if duration > 0:
    reqs = load_requests(path, start_s=start, duration_s=duration)
else:
    reqs = load_requests(path)
seconds = time.perf_counter() - t0
window = shape_requests(reqs, start_s=start, duration_s=abs(duration))
print(json.dumps({
    "seconds": seconds,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "loaded": len(reqs),
    "window": [[r.arrival_s, r.prompt_len, r.output_len] for r in window],
}))
"""


def write_trace(path: Path, rows: int, rate: float, seed: int) -> None:
    """`rows` rows in Azure 2024's format (microseconds where the arrival has them)."""
    rng = random.Random(seed)
    start, t = datetime.datetime(2024, 5, 10), 0.0
    with path.open("w") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for _ in range(rows):
            t += rng.expovariate(rate)
            stamp = start + datetime.timedelta(seconds=t)
            frac = f".{stamp.microsecond:06d}" if stamp.microsecond else ""
            prompt, output = rng.randint(1, 8000), rng.randint(1, 300)
            f.write(f"{stamp:%Y-%m-%d %H:%M:%S}{frac}+00:00,{prompt},{output}\n")


def load_in_child(path: Path, start_s: float, duration_s: float, windowed: bool) -> dict:
    duration = duration_s if windowed else -duration_s  # negative: load whole, cut after
    root = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), str(start_s), str(duration)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--rate", type=float, default=28.0, help="arrivals per second")
    p.add_argument("--start-s", type=float, default=36_000.0)
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "AzureLLMInferenceTrace_conv_1week.csv"
        write_trace(path, args.rows, args.rate, args.seed)
        runs = {
            kind: load_in_child(path, args.start_s, args.duration_s, kind == "windowed")
            for kind in ("whole", "windowed")
        }
    if runs["whole"]["window"] != runs["windowed"]["window"]:
        print("the windowed read kept other requests than a cut after the whole read")
        return 1
    for kind, r in runs.items():
        print(
            f"{kind:8s} read: {r['seconds']:6.2f} s, peak RSS {r['peak_rss_mb']:7.1f} MB, "
            f"{r['loaded']} requests held, {len(r['window'])} in the window"
        )
    ratio = {k: runs["windowed"][k] / runs["whole"][k] for k in ("seconds", "peak_rss_mb")}
    print(f"windowed / whole: time {ratio['seconds']:.2f}x, peak RSS {ratio['peak_rss_mb']:.2f}x")
    if args.json:
        summary = {k: {n: v for n, v in r.items() if n != "window"} for k, r in runs.items()}
        doc = {"rows": args.rows, "runs": summary, "ratio": ratio}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
