"""The GPU run's results against the issue's goals, as one bar chart next to the numbers.

python -m benchmarks.gpu.plot benchmarks/results/gpu     # writes gpu_goals.png there
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def measures(out: Path) -> list[tuple[str, float, float]]:
    """(label, measured, goal) with larger = better for every row."""

    def load(name):
        return json.loads((out / name).read_text())

    dec, pre, nx = load("decode.json"), load("prefill.json"), load("nixl.json")
    b1, b32 = dec["rows"][0], dec["rows"][-1]
    rows = [
        # The steady step (decode-ahead, no sync per step) where the run measured one.
        ("decode b1 MBU", b1.get("mbu_step_steady") or b1["mbu_step_graphs"], 0.70),
        (
            f"decode b{b32['batch']}\nbound / step",
            b32["bound_s"] / (b32.get("step_steady_s") or b32["step_graphs_s"]),
            1 / 1.3,
        ),
        ("prefill 8k MFU", pre["bf16"]["rows"][-1]["mfu"], 0.60),
    ]
    rows += [(f"FP8 / bf16\n{r['tokens']} tok", r["ratio"], 1.5) for r in pre["fp8_speedup"]]
    rows.append(("NIXL / copy", nx["ratio"], 0.70))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    out = ap.parse_args(argv).results
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = measures(out)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    x = range(len(rows))
    ax.bar(
        x,
        [m / g for _, m, g in rows],
        color=["tab:green" if m >= g else "tab:red" for _, m, g in rows],
    )
    ax.axhline(1.0, color="black", lw=1, ls="--", label="goal")
    for i, (_, m, g) in enumerate(rows):
        ax.text(i, m / g + 0.03, f"{m:.3g}\n(goal {g:.2g})", ha="center", fontsize=7)
    ax.set_xticks(list(x), [r[0] for r in rows], fontsize=8)
    ax.set_ylabel("measured / goal")
    ax.set_ylim(0, 1.5)
    env = out / "env.json"
    card = json.loads(env.read_text())["gpu"]["name"] if env.exists() else "GPU"
    ax.set_title(f"tandem on one {card} (benchmarks/gpu/run.sh)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "gpu_goals.png", dpi=110)
    print(out / "gpu_goals.png")


if __name__ == "__main__":
    main()
