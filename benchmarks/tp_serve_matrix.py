"""`tandem serve` at every pairing of prefill and decode tensor-parallel sizes that issue 23
asks for, each answer checked against transformers and each hand-off proved to have moved the
KV (too slow for `make test`, which serves (P2, D2); the rest are proved there at the worker
level).

    .venv/bin/python benchmarks/tp_serve_matrix.py --json benchmarks/results/tp_serve_matrix.json

Model: the tiny llama of the tests (`tools.make_model`, 2 KV heads, so TP 4 replicates each
head on two ranks), fp32. Per pairing, a fresh `tandem serve --prefill 1 --decode 1
--prefill-tp P --decode-tp D --routing affinity --disagg-threshold 16` (bench/live_server.py),
then 3 remote prompts (20, 37, 64 tokens, no leading block shared) and 1 local one, greedy,
8 tokens, `ignore_eos`.
Checked, per pairing:
- the texts equal transformers' greedy fp32 texts (FP8 KV: equal to the (P1, D1) FP8 run's,
  since an FP8 cache is not the fp32 model);
- the decode pool's counters moved exactly: 3 remote prefills, 0 recomputes, 0 transfer
  failures, the prompts' blocks READ, and bytes READ = those blocks x the bytes a block holds
  per KV head x the KV heads the decode ranks hold together (a replicated head is read once
  per rank holding it), the per-head bytes measured by the (P1, D1) run of the same KV dtype;
- every KV block back, and `tandem serve` exits 0.
Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.live_server import LiveServer  # noqa: E402

PAIRS = [(1, 1, "auto"), (2, 1, "auto"), (1, 2, "auto"), (2, 2, "auto"), (4, 1, "auto"),
         (1, 4, "auto"), (1, 1, "fp8_e4m3"), (2, 1, "fp8_e4m3")]  # fmt: skip
# No two share a leading block: the decode worker's own cache holds none of the next one's.
REMOTE = [list(range(start, start + n)) for start, n in ((3, 20), (100, 37), (200, 64))]
LOCAL = [[5, 9, 11, 2]]
MAX_TOKENS, BLOCK, KV_HEADS = 8, 16, 2
COUNTERS = ("kv_remote_prefills", "kv_recomputes", "kv_transfer_failures", "kv_read_blocks",
            "kv_transfer_bytes")  # fmt: skip


def _decode_counters(server: LiveServer) -> dict[str, float]:
    m = server.metrics()
    out = dict.fromkeys(COUNTERS, 0.0)
    for key, value in m.items():
        for c in COUNTERS:
            if key.startswith(f"tandem_{c}_total{{") and 'role="decode"' in key:
                out[c] += value
    return out


def _settled(server: LiveServer, want_remote: int, timeout_s: float = 30.0) -> dict:
    """The decode pool's counters once the remote prefills arrived and stopped moving."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        now = _decode_counters(server)
        if now["kv_remote_prefills"] >= want_remote and now == last:
            return now
        last = now
        time.sleep(1.0)
    return last or {}


def _hf_texts(model: Path) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # full length, as ignore_eos asks
    tok = AutoTokenizer.from_pretrained(model)
    with torch.no_grad():
        ids = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0]
               for p in REMOTE + LOCAL]  # fmt: skip
    return [tok.decode(x[len(p) :].tolist()) for x, p in zip(ids, REMOTE + LOCAL, strict=True)]


def run_pair(model: Path, workdir: Path, ptp: int, dtp: int, kv: str) -> dict:
    flags = ["--dtype", "float32", "--prefill", "1", "--decode", "1", "--prefill-tp", str(ptp),
             "--decode-tp", str(dtp), "--kv-dtype", kv, "--disagg-threshold", "16",
             "--routing", "affinity", "--log-level", "WARNING"]  # fmt: skip
    server = LiveServer(model, workdir / f"p{ptp}d{dtp}-{kv}", *flags)
    t0 = time.monotonic()
    server.start(timeout_s=300)
    try:
        started = time.monotonic() - t0
        texts = []
        for prompt in REMOTE + LOCAL:
            status, body = server.post("/v1/completions", {
                "model": Path(model).name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True})  # fmt: skip
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {body}")
            texts.append(body["choices"][0]["text"])
        counters = _settled(server, len(REMOTE))
        leaked = server.wait_blocks_free()
    except Exception:
        server.stop()
        raise
    code = server.stop()
    return {"prefill_tp": ptp, "decode_tp": dtp, "kv_dtype": kv, "texts": texts,
            "counters": counters, "start_s": round(started, 1), "exit_code": code,
            "leaked_blocks": leaked}  # fmt: skip


def check(row: dict, want_texts: list[str], per_head_bytes: float) -> list[str]:
    """What failed for one pairing (empty: every check passed)."""
    c, bad = row["counters"], []
    blocks = sum(-(-len(p) // BLOCK) for p in REMOTE)
    heads_read = max(row["decode_tp"], KV_HEADS)  # replicated heads: one per decode rank
    want = {
        "kv_remote_prefills": len(REMOTE),
        "kv_recomputes": 0,
        "kv_transfer_failures": 0,
        "kv_read_blocks": blocks,
        "kv_transfer_bytes": blocks * per_head_bytes * heads_read,
    }
    for k, v in want.items():
        if abs(c.get(k, -1) - v) > 1e-6 * max(1.0, v):
            bad.append(f"{k}: {c.get(k)} != {v}")
    if row["texts"] != want_texts:
        bad.append(f"texts differ: {row['texts']} != {want_texts}")
    if row["leaked_blocks"] != 0:
        bad.append(f"KV blocks not back: {row['leaked_blocks']}")
    if row["exit_code"] != 0:
        bad.append(f"tandem serve exited {row['exit_code']}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from tools.make_model import cached_model

    rows, failures = [], {}
    with tempfile.TemporaryDirectory(prefix="tandem-tp-matrix-") as tmp:
        model = cached_model("llama", "tiny", 0, cache_dir=Path(tmp) / "models")
        hf = _hf_texts(model)
        baseline: dict[str, tuple[list[str], float]] = {}
        for ptp, dtp, kv in PAIRS:
            row = run_pair(model, Path(tmp), ptp, dtp, kv)
            if (ptp, dtp) == (1, 1):  # the same run's per-head bytes and (FP8) texts
                c = row["counters"]
                per_head = c["kv_transfer_bytes"] / max(1.0, c["kv_read_blocks"]) / KV_HEADS
                baseline[kv] = (row["texts"] if kv != "auto" else hf, per_head)
            want_texts, per_head = baseline[kv]
            row["failures"] = check(row, want_texts, per_head)
            rows.append(row)
            name = f"P{ptp} D{dtp} {kv}"
            print(f"{name:>16}: start {row['start_s']} s, counters {row['counters']}, "
                  f"{'ok' if not row['failures'] else row['failures']}", flush=True)  # fmt: skip
            if row["failures"]:
                failures[name] = row["failures"]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"pairs": rows, "failures": failures}, indent=1) + "\n")
    print("all pairings exact, KV moved" if not failures else f"FAILED: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
