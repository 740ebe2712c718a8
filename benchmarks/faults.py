"""Fault injection on a live 1P1D `tandem serve`, under both `--on-transfer-failure` policies.

For each policy it starts one cluster (decode steps slowed so that streams can be cut, KV
READs held back so that a fault can land during one, the first READs failing on purpose) and
one whose decode worker never reads, and runs every case of bench/fault_cases.py on it:
injected READ errors, the prefill worker killed and hung during the READ, the decode worker
killed mid-stream and hung past its lease, the controller killed, a storm of client
disconnects, a router killed and restarted while the workers live, a receiver that never
reads. It prints, per case, requests sent / correct / clear errors / wrong (must be 0) /
leaked KV blocks (must be 0) / recovery time, and writes them as JSON and a markdown table.

    python benchmarks/faults.py --requests 16 --out benchmarks/results/faults.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import fault_cases as fc  # noqa: E402
from bench.live_server import LiveServer  # noqa: E402

# Affinity routing: every case prompt (8+ tokens) takes the KV hand-off, which the faults
# target; kv-events would prefill them on a decode worker holding their shared first block.
BASE = (
    "--dtype", "float32", "--disagg-threshold", "8", "--log-level", "WARNING",
    "--routing", "affinity",
)  # fmt: skip


def _faults(fail_reads: int) -> str:
    knobs = {"step_delay_s": 0.01, "read_delay_s": 1.5, "fail_reads": fail_reads}
    return json.dumps({"decode": knobs})


def _server(model: Path, tmp: Path, policy: str, *extra: str) -> LiveServer:
    flags = (*BASE, "--on-transfer-failure", policy, *extra)
    return LiveServer(model, tmp / f"{policy}-{len(extra)}", *flags).start()


async def _main_cases(server: LiveServer, policy: str, n: int, tmp: Path, fail: int) -> list:
    rows = []

    async def case(coro) -> None:
        t0 = time.monotonic()
        tally = await coro
        row = {**tally.row(), "seconds": round(time.monotonic() - t0, 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)

    await case(fc.plain_load(server, f"injected READ errors ({fail})", policy, n, 24))
    await case(fc.kill_worker(server, "prefill-0", policy, n, 40, after_s=0.7))
    await case(fc.stop_worker(server, "prefill-0", policy, n, 40, 6.0, after_s=0.7))
    await case(fc.kill_worker(server, "decode-0", policy, n, 150))
    await case(fc.stop_worker(server, "decode-0", policy, n, 150, 7.0))
    await case(fc.kill_controller(server, n, 150))
    await case(fc.abort_storm(server, 100))
    await case(fc.restart_router(server, tmp / f"router-{policy}", n, 300))
    return rows


def run_policy(model: Path, tmp: Path, policy: str, n: int) -> list[dict]:
    fail = max(2, n // 4)
    server = _server(model, tmp, policy, "--lease-seconds", "4", "--inject-faults", _faults(fail))
    try:
        rows = asyncio.run(_main_cases(server, policy, n, tmp, fail))
        # References for the never-read cluster, whose hand-offs all fail under "error".
        refs = asyncio.run(fc.references(server.url, fc.prompts(n), 12))
    finally:
        code = server.stop()
    rows.append({"case": "clean exit after the cases", "policy": policy, "exit_code": code})
    never = json.dumps({"decode": {"never_read": True}})
    flags = ("--lease-seconds", "2", "--kv-read-timeout-s", "3", "--inject-faults", never)
    server = _server(model, tmp, policy, *flags)
    try:
        load = fc.plain_load(server, "receiver never reads", policy, n, 12, refs)
        tally = asyncio.run(load)
        rows.append(tally.row())
        print(json.dumps(tally.row()), flush=True)
    finally:
        server.stop()
    return rows


def markdown(rows: list[dict]) -> str:
    head = "| case | policy | sent | correct | clear errors | wrong | leaked blocks | recovery s |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "sent" not in r:
            continue
        rec = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.1f}"
        lines.append(
            f"| {r['case']} | {r['policy'] or '-'} | {r['sent']} | {r['correct']} | "
            f"{r['clear_errors']} | {r['wrong']} | {r['leaked_blocks']} | {rec} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16, help="requests per case")
    p.add_argument("--model", default=None, help="model dir (default: a tiny random llama)")
    p.add_argument("--policies", nargs="+", default=["recompute", "error"])
    p.add_argument("--out", default=None, help="write the rows as JSON here (and .md beside)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-faults-") as tmp_name:
        tmp = Path(tmp_name)
        model = Path(args.model) if args.model else _tiny_model(tmp)
        rows = []
        for policy in args.policies:
            rows += run_policy(model, tmp, policy, args.requests)
    table = markdown(rows)
    print(table)
    if args.out:
        meta = {"machine": _cpu(), "python": platform.python_version(), "rows": rows}
        Path(args.out).write_text(json.dumps(meta, indent=1))
        Path(args.out).with_suffix(".md").write_text(table + "\n")
    bad = [r for r in rows if r.get("wrong") or r.get("leaked_blocks") or r.get("exit_code")]
    return 1 if bad else 0


def _tiny_model(tmp: Path) -> Path:
    from tools.make_model import cached_model

    return cached_model("llama", "tiny", 0, cache_dir=tmp / "models")


def _cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line]
    return names[0] if names else platform.processor()


if __name__ == "__main__":
    sys.exit(main())
