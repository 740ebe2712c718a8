"""Cut a slice of ServeGen's production characterization into one committed file.

ServeGen (github.com/alibaba/ServeGen, Apache-2.0; arXiv 2505.09999) publishes two weeks of
Alibaba Cloud Model Studio traffic to one language model, per client: each client's request
rate, inter-arrival CV and fitted inter-arrival distribution (Gamma or Weibull) per 10-minute
window (`chunk-<client>-trace.csv`), and its prompt and answer length distributions every 6
hours (`chunk-<client>-dataset.json`, PDFs over token counts). It is not a per-request log:
`cluster/simulator/servegen.py` draws requests from it (each client's own renewal process at
its own rate and burstiness, lengths from its own PDFs), seeded.

This script keeps the windows of [start, start + duration) for every client whose length
PDFs are there (clients without them are counted in the file's provenance, not invented),
with each client's latest length PDFs at or before each window, exactly as published
(probabilities as JSON floats). Run on a ServeGen checkout:

    python benchmarks/traces/servegen_slice.py /path/ServeGen/data/language/m-large \\
        --start-s 36000 --duration-s 3600 --source-commit <sha> \\
        --out benchmarks/traces/servegen_m_large_h10.servegen.json.gz
"""

from __future__ import annotations

import argparse
import ast
import csv
import gzip
import json
from pathlib import Path

WINDOW_S = 600


def read_windows(path: Path, start_s: int, end_s: int) -> list[list]:
    """[t, rate, cv, pattern, p1, p2] for the windows of [start_s, end_s); rate-0 windows keep
    their row (an idle client is part of the load's shape)."""
    rows = []
    for row in csv.reader(path.open()):
        t = int(row[0])
        if start_s <= t < end_s:
            rate, cv = float(row[1]), float(row[2])
            p1 = float(row[4]) if row[4] else 0.0
            p2 = float(row[5]) if row[5] else 0.0
            rows.append([t, rate, cv, row[3], p1, p2])
    return rows


def read_pdfs(path: Path, times: list[int]) -> dict[str, dict[str, list]]:
    """{window start: {"input": [[tokens, p], ...], "output": [...]}} with the latest PDFs at or
    before each window that hold any mass; windows with none are left out."""
    published = json.loads(path.read_text())
    pdfs = {}  # stamp -> both PDFs, parsed once; stamps with an empty PDF are left out
    for stamp in sorted(int(k) for k in published):
        fields = published[str(stamp)]
        both = {"input": _pairs(fields["input_tokens"]), "output": _pairs(fields["output_tokens"])}
        if both["input"] and both["output"]:
            pdfs[stamp] = both
    out: dict[str, dict[str, list]] = {}
    for t in times:
        usable = [s for s in pdfs if s <= t]
        if usable:
            out[str(t)] = pdfs[usable[-1]]
    return out


def _pairs(text: str) -> list[list]:
    pdf = ast.literal_eval(text)  # the published PDFs are Python dict literals in strings
    return [[int(k), float(v)] for k, v in sorted(pdf.items())]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path, help="ServeGen data/<category>/<model> directory")
    p.add_argument("--start-s", type=int, required=True)
    p.add_argument("--duration-s", type=int, default=3600)
    p.add_argument("--source-commit", required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    end_s = args.start_s + args.duration_s
    clients, dropped_rate = [], 0.0
    for trace in sorted(args.model_dir.glob("chunk-*-trace.csv")):
        cid = int(trace.name.split("-")[1])
        windows = read_windows(trace, args.start_s, end_s)
        dataset = args.model_dir / f"chunk-{cid}-dataset.json"
        pdfs = read_pdfs(dataset, [w[0] for w in windows]) if dataset.exists() else {}
        kept = [w for w in windows if str(w[0]) in pdfs]
        dropped_rate += sum(w[1] for w in windows if str(w[0]) not in pdfs)
        if kept:
            clients.append({"client": cid, "windows": kept, "lengths": pdfs})
    doc = {
        "format": "tandem-servegen-slice/1",
        "source": {
            "repository": "github.com/alibaba/ServeGen (mirror read: github.com/azaj01/ServeGen)",
            "commit": args.source_commit,
            "directory": "/".join(args.model_dir.parts[-3:]),
            "license": "Apache-2.0",
            "start_s": args.start_s,
            "duration_s": args.duration_s,
            "window_s": WINDOW_S,
            "dropped_mean_rate_rps": round(dropped_rate * WINDOW_S / args.duration_s, 3),
        },
        "clients": clients,
    }
    data = json.dumps(doc, separators=(",", ":")).encode()
    args.out.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    kept_rate = sum(w[1] for c in clients for w in c["windows"]) * WINDOW_S / args.duration_s
    print(
        f"{args.out}: {len(clients)} clients, mean {kept_rate:.1f} req/s kept, "
        f"{doc['source']['dropped_mean_rate_rps']} req/s without length PDFs"
    )


if __name__ == "__main__":
    main()
