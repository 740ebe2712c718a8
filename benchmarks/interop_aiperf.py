"""NVIDIA's aiperf (Dynamo's benchmark client) against a live `tandem serve`, on its chat,
completions and Responses endpoint types and on multi-turn chat conversations: every request
must succeed, with the answer length asked for (`--extra-inputs ignore_eos:true`) and the prompt
length it built, and the conversations' later turns must find their history in the prefix
cache (aiperf's `usage_prompt_cache_read_tokens`, from the server's usage).

aiperf cannot share the project's environment (it pins pyzmq~=26.4, rich, pandas and more
against what tandem's own packages need), so it runs from its own virtual environment, made
on first use (`--venv`, default .venv-aiperf; `pip install aiperf==0.13.0` from the package
registry, about a minute), and this check is not part of `make test` (tests/interop/
test_guidellm.py runs guidellm there, the other benchmark client).

    PYTHONPATH=. .venv/bin/python benchmarks/interop_aiperf.py          # ~2 min the first time
    ... --json benchmarks/results/interop_aiperf.json

Token counts: with `--use-server-token-count` aiperf reads the server's usage. On the
Responses endpoint it reads usage only from a `response.completed` event, and a response cut
at `max_output_tokens` ends, as OpenAI's does, with `response.incomplete`, so there it would
count nothing: that run counts with the tokenizer instead (re-tokenized text may count a few
tokens more or fewer than were generated, so only the chat and completions answers are held
to the exact length).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.live_server import LiveServer  # noqa: E402
from benchmarks.common import log, machine_info, write_json  # noqa: E402

AIPERF = "aiperf==0.13.0"
CONVERSATIONS, TURNS = 8, 3  # the multi-turn run: each turn sends the history back
MULTITURN = ("--conversation-num", str(CONVERSATIONS), "--conversation-turn-mean", str(TURNS),
             "--conversation-turn-stddev", "0")  # fmt: skip
# run -> (aiperf's endpoint type, its extra arguments)
RUNS = {
    "chat": ("chat", ()),
    "completions": ("completions", ()),
    "responses": ("responses", ()),
    "chat-multiturn": ("chat", MULTITURN),
}
SERVE_FLAGS = ("--dtype", "float32", "--prefill", "1", "--decode", "1",
               "--disagg-threshold", "24")  # fmt: skip


def ensure_venv(venv: Path) -> Path:
    """The aiperf executable of `venv`, made and installed there first if missing."""
    exe = venv / "bin" / "aiperf"
    if not exe.exists():
        log(f"making {venv} and installing {AIPERF} (once)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", AIPERF]
        subprocess.run(pip, check=True)
    return exe


def expected_requests(run: str, args) -> int:
    return CONVERSATIONS * TURNS if run == "chat-multiturn" else args.requests


def profile(exe: Path, url: str, model: Path, run: str, out: Path, args) -> dict:
    """One aiperf run; its summary JSON."""
    endpoint, extra = RUNS[run]
    count = () if extra else ("--request-count", str(args.requests))
    cmd = [
        str(exe), "profile", "--model", model.name, "--url", url, "--endpoint-type", endpoint,
        "--streaming", "--concurrency", str(args.concurrency), *count, *extra,
        "--synthetic-input-tokens-mean", str(args.prompt_tokens),
        "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(args.output_tokens), "--output-tokens-stddev", "0",
        "--tokenizer", str(model), "--extra-inputs", "ignore_eos:true",
        "--ui-type", "none", "--artifact-dir", str(out),
    ]  # fmt: skip
    if endpoint != "responses":  # see the module doc
        cmd.append("--use-server-token-count")
    # (HF_HUB_OFFLINE=1 would make aiperf 0.13 read the local tokenizer path as a hub id.)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf {run} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads((out / "profile_export_aiperf.json").read_text())


def judge(run: str, summary: dict, args) -> dict:
    """The run's counts, and whether it passed: every request answered, none failed, the
    answer length exact where the server's usage is read, and on the multi-turn run some
    prompt tokens read from the prefix cache (the history each turn sends back)."""
    count = int(summary["request_count"]["avg"])
    errors = int((summary.get("error_request_count") or {}).get("avg", 0))
    osl = summary.get("output_sequence_length") or {}
    isl = summary.get("input_sequence_length") or {}
    cached = (summary.get("overall_usage_prompt_cache_read_pct") or {}).get("avg")
    want = expected_requests(run, args)
    exact = run != "responses"  # see the module doc
    ok = count == want and errors == 0 and osl.get("count") == want
    if exact:
        ok = ok and osl.get("min") == osl.get("max") == args.output_tokens
    if run == "chat-multiturn":
        ok = ok and (cached or 0) > 0
    return {
        "run": run,
        "requests": count,
        "errors": errors,
        "output_tokens": [osl.get("min"), osl.get("max")],
        "input_tokens": [isl.get("min"), isl.get("max")],
        "ttft_ms_p50": (summary.get("time_to_first_token") or {}).get("p50"),
        "requests_per_s": (summary.get("request_throughput") or {}).get("avg"),
        "exact_output_length": exact,
        "prompt_cache_read_pct": cached,
        "ok": bool(ok),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", type=Path, default=REPO / ".venv-aiperf")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=64)  # over the threshold: remote path
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    exe = ensure_venv(args.venv)
    with tempfile.TemporaryDirectory(prefix="tandem-aiperf-") as tmp:
        work = Path(tmp)
        model = work / "tiny-llama"
        make = [sys.executable, "-m", "cluster.cli", "make-model", str(model)]
        make += ["--train-steps", "50"]
        subprocess.run(make, check=True, cwd=REPO, capture_output=True)
        server = LiveServer(model, work / "serve", *SERVE_FLAGS).start()
        try:
            rows = [
                judge(r, profile(exe, server.url, model, r, work / r, args), args) for r in RUNS
            ]
            busy = server.wait_blocks_free()  # every KV block back after aiperf's requests
        finally:
            exit_code = server.stop()
    for r in rows:
        print(json.dumps(r))
    print(json.dumps({"kv_blocks_in_use_after": busy, "serve_exit_code": exit_code}))
    if args.json:
        command = " ".join(["benchmarks/interop_aiperf.py", *(argv or sys.argv[1:])])
        doc = {"client": AIPERF, "command": command, "machine": machine_info(2), "rows": rows,
               "kv_blocks_in_use_after": busy, "serve_exit_code": exit_code}  # fmt: skip
        write_json(args.json, doc)
    return 0 if all(r["ok"] for r in rows) and busy == 0 and exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
