"""The pure parts of benchmarks/llamacpp_compare.py: reading llama-bench's JSON, greedy
agreement counts, per-section summaries of the per-round ratios, and the printed table.
Nothing here runs an engine (tests/bench/test_llamacpp_compare.py checks it on fixed input)."""

from __future__ import annotations

import json
import statistics

# Section -> (what is measured, unit), in the order they run and print.
SECTIONS = ("decode", "prefill", "concurrent", "int8", "w8a8")
LABELS = {
    "decode": ("decode, batch 1, bf16", "tok/s"),
    "prefill": ("prefill, one 512-token prompt, bf16", "tok/s"),
    "concurrent": ("32 concurrent requests, output tokens/s", "tok/s"),
    "int8": ("decode, batch 1, llama.cpp Q8_0 vs tandem int8", "tok/s"),
    "w8a8": ("decode, batch 1, llama.cpp Q8_0 vs tandem int8-w8a8", "tok/s"),
}
_BENCH_KEYS = ("n_prompt", "n_gen", "avg_ts")


def parse_llama_bench(text: str) -> list[dict]:
    """The result rows of `llama-bench -o json` (a JSON array; anything printed before it is
    skipped). Each row must carry n_prompt, n_gen and avg_ts (tokens/s); ValueError otherwise."""
    start = text.find("[")
    if start < 0:
        raise ValueError("llama-bench printed no JSON array")
    rows = json.loads(text[start:])
    if not isinstance(rows, list):
        raise ValueError("llama-bench JSON is not an array")
    for row in rows:
        missing = [k for k in _BENCH_KEYS if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"llama-bench row lacks {missing}")
        if not row["avg_ts"] > 0:
            raise ValueError(f"llama-bench row has avg_ts {row['avg_ts']!r}")
    return rows


def agreement(pairs: list[tuple[list[int], list[int]]]) -> dict:
    """Greedy agreement over (tandem, llama.cpp) token lists of one prompt each: tokens equal
    position by position, and where each prompt first diverges (None: never). After a
    divergence the two continue from different text, so `equal` counts later coincidences
    too; `equal_prefix` counts only tokens before the first divergence."""
    equal = total = prefix = 0
    first: list[int | None] = []
    for ours, theirs in pairs:
        n = min(len(ours), len(theirs))
        total += max(len(ours), len(theirs))
        equal += sum(a == b for a, b in zip(ours[:n], theirs[:n], strict=True))
        div = next((i for i in range(n) if ours[i] != theirs[i]), None)
        if div is None and len(ours) != len(theirs):
            div = n
        first.append(div)
        prefix += n if div is None else div
    return {"equal": equal, "equal_prefix": prefix, "total": total, "first_divergence": first}


def summarize_section(rounds: list[dict]) -> dict:
    """Min/median/max of each engine's figure and of the per-round ratio tandem / llama.cpp."""
    if not rounds:
        raise ValueError("no rounds to summarize")
    out = {}
    for key in ("llama", "tandem", "ratio"):
        values = [r[key] for r in rounds]
        out[key] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    return out


def round_line(name: str, index: int, row: dict, unit: str) -> str:
    return (
        f"{name} round {index}: llama.cpp {row['llama']:.1f} {unit}, tandem "
        f"{row['tandem']:.1f} {unit}, tandem/llama.cpp {row['ratio']:.2f} "
        f"(load {row['load_avg_1m']:.2f})"
    )


def _span(stats: dict, fmt: str) -> str:
    lo, hi = format(stats["min"], fmt), format(stats["max"], fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def format_table(sections: dict) -> str:
    """The markdown table of issue 25: each engine's range over the rounds, the ratio's range,
    and every round's ratio."""
    lines = [
        "| measure | llama.cpp | tandem | tandem / llama.cpp | per round |",
        "|---|---|---|---|---|",
    ]
    for name in SECTIONS:
        if name not in sections:
            continue
        s = sections[name]
        summary = s.get("summary") or summarize_section(s["rounds"])
        label, unit = LABELS[name]
        per_round = ", ".join(f"{r['ratio']:.2f}" for r in s["rounds"])
        lines.append(
            f"| {label} ({unit}) | {_span(summary['llama'], '.0f')} | "
            f"{_span(summary['tandem'], '.0f')} | **{_span(summary['ratio'], '.2f')}** | "
            f"{per_round} |"
        )
    return "\n".join(lines)


def plot(sections: dict, path: str) -> None:
    """Per-round tandem / llama.cpp ratios of each section as bars, a line at parity (1.0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in SECTIONS if n in sections]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.8 / max(len(sections[n]["rounds"]) for n in names)
    for i, name in enumerate(names):
        for r, row in enumerate(sections[name]["rounds"]):
            ax.bar(i + (r - 1) * width, row["ratio"], width, color=f"C{r}", label=f"round {r + 1}")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[: len(set(labels))], labels[: len(set(labels))], fontsize=8)
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xticks(range(len(names)), [LABELS[n][0] for n in names], fontsize=7, rotation=12)
    ax.set_ylabel("tandem / llama.cpp")
    ax.set_title("SmolLM2-135M-Instruct, 2 threads each (higher is better for tandem)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":  # re-plot a saved run: python llamacpp_report.py RESULT.json OUT.png
    import sys

    plot(json.load(open(sys.argv[1]))["sections"], sys.argv[2])
