"""The router alone, old commit vs this working tree, against a fake worker that streams tokens.

`python benchmarks/router_overhead.py [--old-ref 53e8895] [--rounds 2] [--out FILE]`

What it measures: requests/s (wall) and router CPU seconds per output token of `python -m
router` in front of one fake decode worker (benchmarks/router_overhead_worker.py, no model:
canned token ids that detokenize to English text, one `TokenMessage` per token by default),
for 1,000 streamed chat completions of 64 tokens each at concurrency 32, from one aiohttp
client in this process. Router CPU is utime+stime of the router process from
/proc/<pid>/stat, read just before and just after the load (start-up and warm-up excluded).

Lifecycle: materialize the old tree (`git archive <old-ref>` into a temporary directory;
`--old-ref WORKTREE` uses this working tree, so the smoke test needs no git history) and the
new one (`--new-ref`, default WORKTREE: this working tree; a commit is archived too), make or
reuse the model directory (the router reads only config.json and the tokenizer), then per
tree start a fake worker and a router, each with that tree first on sys.path (PYTHONPATH and
cwd = the tree; each child checks that `engine` / `router` really come from it and exits
otherwise, and this process checks the paths they print), wait for `/ready`, warm up, and
run the measured load alternately (old, new, old, new, ... for `--rounds` rounds). Every
response is checked: status 200, a stream ending in `[DONE]`, finish_reason "length",
usage.completion_tokens == max_tokens and the text equal to the tokenizer's decoding of the
tokens sent. Failures are counted and printed; any failure exits 1. Then both trees' processes
are stopped (SIGTERM) and the temporary tree removed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # allow `python benchmarks/router_overhead.py` from anywhere
    sys.path.insert(0, str(REPO))

from benchmarks.common import CACHE_DIR  # noqa: E402

WORKER_SCRIPT = Path(__file__).resolve().with_name("router_overhead_worker.py")
WORKTREE = "WORKTREE"
# Words the small model's tokenizer was trained on, so they are whole tokens with real text.
TEXT = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his "
    "daughter. Every morning they walked down to the harbour before the sun came up, and every "
    "evening they came back with a basket of silver fish. The neighbours said the girl could "
    "read the weather in the colour of the water."
)
# Runs `python -m router` after checking where `router` and `engine` come from: the venv has
# an editable install of /work/main, which must not stand in for the tree under test.
ROUTER_LAUNCHER = """
import os, runpy, sys
tree = os.path.realpath(sys.argv[1]) + os.sep
import engine.protocol, router
for mod in (router, engine.protocol):
    path = os.path.realpath(mod.__file__)
    if not path.startswith(tree):
        sys.exit(f"TREE MISMATCH: {mod.__name__} from {path}, wanted under {tree}")
print("ROUTER", router.__file__, flush=True)
sys.argv = ["router", *sys.argv[2:]]
runpy.run_module("router", run_name="__main__", alter_sys=True)
"""


# ---------------------------------------------------------------------------- processes


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and parens
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(tree: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
    env.pop("PYTHONSTARTUP", None)
    return env


def wait_for_line(proc: subprocess.Popen, log: Path, prefix: str, timeout_s: float) -> str:
    """The rest of the first line of `log` starting with `prefix`; raises if the process dies
    or the line does not come in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(prefix + " "):
                return line[len(prefix) + 1 :].strip()
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    tail = log.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"no {prefix!r} line from {proc.args[:3]} (exit {proc.poll()}):\n{tail}")


def check_under(path: str, tree: Path, what: str) -> None:
    real = os.path.realpath(path)
    if not real.startswith(os.path.realpath(tree) + os.sep):
        raise RuntimeError(f"{what} came from {real}, not from {tree}")


@dataclass
class Side:
    """One tree under test: its fake worker and its router."""

    name: str
    tree: Path
    commit: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    unclean_exits: list[dict] = field(default_factory=list)
    router_pid: int = 0
    worker_pid: int = 0
    url: str = ""
    model: str = ""

    def start(self, args, model_dir: Path, tokens: list[int], logdir: Path) -> None:
        env = child_env(self.tree)
        wlog = logdir / f"{self.name}-worker.log"
        wcmd = [sys.executable, str(WORKER_SCRIPT), "--tree", str(self.tree)]
        wcmd += ["--tokens", ",".join(map(str, tokens)), "--chunk", str(args.chunk)]
        wcmd += ["--max-output", str(args.max_tokens)]
        worker = self._spawn(wcmd, env, wlog)
        endpoint = wait_for_line(worker, wlog, "ENDPOINT", 60)
        check_under(wait_for_line(worker, wlog, "ENGINE", 10), self.tree, "worker's codec module")
        self.worker_pid = worker.pid
        workers_json = logdir / f"{self.name}-workers.json"
        entry = {"worker_id": f"fake-{self.name}", "role": "decode", "request_endpoint": endpoint}
        workers_json.write_text(json.dumps([entry]))
        port = free_port()
        rcmd = [sys.executable, "-c", ROUTER_LAUNCHER, str(self.tree), str(model_dir)]
        rcmd += ["--workers", str(workers_json), "--host", "127.0.0.1", "--port", str(port)]
        rlog = logdir / f"{self.name}-router.log"
        router = self._spawn(rcmd, env, rlog)
        check_under(wait_for_line(router, rlog, "ROUTER", 60), self.tree, "router package")
        self.router_pid = router.pid
        self.url = f"http://127.0.0.1:{port}"

    def _spawn(self, cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
        # A file, not a pipe: a router logging every request must never block on a full pipe.
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, cwd=self.tree, env=env, stdout=out, stderr=subprocess.STDOUT
            )
        self.procs.append(proc)
        self.logs.append(log)
        return proc

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def stop(self) -> list[int | None]:
        """SIGTERM every process; their exit codes, in reverse start order. A process that
        did not end cleanly has its log's tail kept in `unclean_exits` for the report."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = []
        for p in reversed(self.procs):
            try:
                codes.append(p.wait(timeout=15))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
            if codes[-1] not in (0, -signal.SIGTERM):
                log = self.logs[self.procs.index(p)]
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                self.unclean_exits.append({"cmd": p.args[:3], "code": codes[-1], "log": tail})
        return codes


def materialize(ref: str, workdir: Path) -> tuple[Path, str]:
    """(tree, commit) for `ref`: this working tree for WORKTREE, else `git archive` of the
    commit unpacked under `workdir`."""
    if ref == WORKTREE:
        return REPO, git_describe_worktree()
    commit = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    tree = workdir / f"tree-{commit[:12]}"
    tree.mkdir(parents=True)  # `workdir` differs per side: the same commit twice is allowed
    archive = subprocess.Popen(["git", "-C", str(REPO), "archive", commit], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {commit} failed")
    return tree, commit


def git(*argv: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), *argv], capture_output=True, text=True, check=True
    ).stdout.strip()


def git_describe_worktree() -> str:
    try:
        head = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "worktree (no git)"
    return f"{head} + working tree changes" if dirty else head


# ---------------------------------------------------------------------------- load


@dataclass
class Load:
    route: str  # "chat" | "completions"
    model: str
    max_tokens: int
    expected_text: str

    def body(self, i: int) -> dict:
        body = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.route == "chat":
            body["messages"] = [{"role": "user", "content": f"Tell me story number {i}."}]
        else:
            body["prompt"] = f"Story number {i}:"
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.route == "chat" else "/v1/completions"


async def one_request(session, url: str, load: Load, i: int) -> str:
    """'' when the streamed answer is whole and right, else what was wrong."""
    async with session.post(url + load.path, json=load.body(i)) as resp:
        if resp.status != 200:
            return f"HTTP {resp.status}: {(await resp.text())[:200]}"
        text, finish, usage, done = [], None, None, False
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return f"stream error: {chunk['error']}"
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") or choice.get("text")
                text.append(piece or "")
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    got = (usage or {}).get("completion_tokens")
    if not done:
        return "stream ended without [DONE]"
    if got != load.max_tokens or finish != "length":
        return f"completion_tokens {got}, finish_reason {finish!r}"
    if "".join(text) != load.expected_text:
        return f"text differs: {''.join(text)[:80]!r}"
    return ""


async def run_load(side: Side, load: Load, n: int, concurrency: int, label: str) -> dict:
    """n requests, `concurrency` at a time; wall time, router and worker CPU, failures."""
    import aiohttp

    failures: list[str] = []
    latencies: list[float] = []
    todo = iter(range(n))
    step = max(n // 4, 1)
    timeout = aiohttp.ClientTimeout(total=120)

    async def client(session) -> None:
        for i in todo:
            t0 = time.perf_counter()
            try:
                why = await one_request(session, side.url, load, i)
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                why = f"{type(e).__name__}: {e}"
            latencies.append(time.perf_counter() - t0)
            if why:
                failures.append(f"{label} request {i}: {why}")
            if len(latencies) % step == 0 and label:
                print(f"  {label}: {len(latencies)}/{n} done", flush=True)

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        r0, w0, c0 = cpu_seconds(side.router_pid), cpu_seconds(side.worker_pid), time.process_time()
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        r1, w1, c1 = cpu_seconds(side.router_pid), cpu_seconds(side.worker_pid), time.process_time()
    ok = n - len(failures)
    tokens = ok * load.max_tokens
    return {
        "requests": n,
        "ok": ok,
        "failures": len(failures),
        "failure_samples": failures[:20],
        "wall_s": wall,
        "req_per_s": n / wall,
        "output_tokens": tokens,
        "router_cpu_s": r1 - r0,
        "router_cpu_us_per_token": 1e6 * (r1 - r0) / max(tokens, 1),
        "worker_cpu_s": w1 - w0,
        "client_cpu_s": c1 - c0,
        "latency_p50_ms": 1e3 * statistics.median(latencies),
        "latency_p99_ms": 1e3 * sorted(latencies)[int(0.99 * (len(latencies) - 1))],
    }


async def wait_ready(side: Side, timeout_s: float = 90) -> str:
    """Waits for the router's /ready; returns the served model id from /v1/models."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if not side.alive():
                break
            try:
                async with session.get(side.url + "/ready") as resp:
                    if resp.status == 200:
                        async with session.get(side.url + "/v1/models") as models:
                            return (await models.json())["data"][0]["id"]
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{side.name} router at {side.url} not ready (alive: {side.alive()})")


# ---------------------------------------------------------------------------- report


def summarize(runs: list[dict]) -> dict:
    wall = sum(r["wall_s"] for r in runs)
    tokens = sum(r["output_tokens"] for r in runs)
    cpu = sum(r["router_cpu_s"] for r in runs)
    return {
        "rounds": len(runs),
        "requests": sum(r["requests"] for r in runs),
        "failures": sum(r["failures"] for r in runs),
        "req_per_s": sum(r["requests"] for r in runs) / wall,
        "router_cpu_us_per_token": 1e6 * cpu / max(tokens, 1),
        "worker_cpu_us_per_token": 1e6 * sum(r["worker_cpu_s"] for r in runs) / max(tokens, 1),
        "latency_p50_ms": statistics.median(r["latency_p50_ms"] for r in runs),
    }


def print_table(rounds: list[dict], summary: dict) -> None:
    head = f"{'round':>5} {'tree':<4} {'req/s':>8} {'router us/tok':>14} {'worker us/tok':>14}"
    head += f" {'p50 ms':>8} {'fail':>5}"
    print(head)
    for r in rounds:
        tok = max(r["output_tokens"], 1)
        print(
            f"{r['round']:>5} {r['tree']:<4} {r['req_per_s']:>8.1f}"
            f" {r['router_cpu_us_per_token']:>14.1f} {1e6 * r['worker_cpu_s'] / tok:>14.1f}"
            f" {r['latency_p50_ms']:>8.1f} {r['failures']:>5}"
        )
    for name in ("old", "new"):
        s = summary[name]
        print(
            f"{'all':>5} {name:<4} {s['req_per_s']:>8.1f} {s['router_cpu_us_per_token']:>14.1f}"
            f" {s['worker_cpu_us_per_token']:>14.1f} {s['latency_p50_ms']:>8.1f}"
            f" {s['failures']:>5}"
        )
    print(
        f"new/old: req/s x{summary['ratio_req_per_s']:.3f}, router CPU per token"
        f" x{summary['ratio_router_cpu_per_token']:.3f}"
        f" (old/new CPU per token: {1 / summary['ratio_router_cpu_per_token']:.2f}x)"
    )


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old-ref", default="53e8895", help=f"git ref of the old tree, or {WORKTREE}")
    p.add_argument("--new-ref", default=WORKTREE, help="the new tree (default: this working tree)")
    p.add_argument("--model", type=Path, help="model dir (default: the cached small llama)")
    p.add_argument("--route", choices=("chat", "completions"), default="chat")
    p.add_argument("--requests", type=int, default=1000, help="measured requests per round")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chunk", type=int, default=1, help="tokens per TokenMessage from the worker")
    p.add_argument("--warmup", type=int, default=32, help="unmeasured requests per router")
    p.add_argument("--rounds", type=int, default=2, help="old+new pairs, alternating")
    p.add_argument("--quick", action="store_true", help="64 requests, concurrency 8, 1 round")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.concurrency, args.rounds, args.warmup = 64, 8, 1, 8
    return args


def prepare_model(args) -> tuple[Path, list[int], str]:
    """(model dir, output token ids, the text they decode to)."""
    from transformers import AutoTokenizer

    if args.model is None:
        from tools.make_model import cached_model

        args.model = cached_model("llama", "small", 0, cache_dir=CACHE_DIR)
    tok = AutoTokenizer.from_pretrained(str(args.model))
    ids = tok.encode(TEXT, add_special_tokens=False)
    out = [ids[i % len(ids)] for i in range(args.max_tokens)]
    return args.model.resolve(), ids, tok.decode(out, skip_special_tokens=True)


async def measure(args, sides: dict[str, Side], expected: str) -> list[dict]:
    loads = {}
    for name, side in sides.items():
        side.model = await wait_ready(side)
        loads[name] = Load(args.route, side.model, args.max_tokens, expected)
        warm = await run_load(
            side, loads[name], args.warmup, min(args.concurrency, args.warmup), ""
        )
        if warm["failures"]:
            raise RuntimeError(f"{name} warm-up failed: {warm['failure_samples'][:3]}")
        print(f"{name}: ready at {side.url}, warmed up ({args.warmup} requests)", flush=True)
    rounds = []
    for rnd in range(1, args.rounds + 1):
        for name, side in sides.items():
            label = f"round {rnd}/{args.rounds} {name}"
            print(f"{label}: {args.requests} requests, concurrency {args.concurrency}", flush=True)
            r = await run_load(side, loads[name], args.requests, args.concurrency, label)
            rounds.append({"round": rnd, "tree": name, **r})
            for f in r["failure_samples"]:
                print("  FAIL", f, flush=True)
    return rounds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_at_start = list(os.getloadavg())
    model_dir, tokens, expected = prepare_model(args)
    workdir = Path(tempfile.mkdtemp(prefix="router-overhead-"))
    sides: dict[str, Side] = {}
    exit_codes = {}
    try:
        for name, ref in (("old", args.old_ref), ("new", args.new_ref)):
            sides[name] = Side(name, *materialize(ref, workdir / name))
        for side in sides.values():
            print(f"{side.name}: {side.commit} at {side.tree}", flush=True)
            side.start(args, model_dir, tokens, workdir)
        rounds = asyncio.run(measure(args, sides, expected))
    except BaseException:
        for name in ("old", "new"):
            for log in sorted(workdir.glob(f"{name}-*.log")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}", file=sys.stderr)
        raise
    finally:
        for name, side in sides.items():
            exit_codes[name] = side.stop()
            for bad in side.unclean_exits:
                print(
                    f"--- {name}: {bad['cmd']} exited {bad['code']}\n{bad['log']}", file=sys.stderr
                )
        shutil.rmtree(workdir, ignore_errors=True)
    summary = {name: summarize([r for r in rounds if r["tree"] == name]) for name in sides}
    summary["ratio_req_per_s"] = summary["new"]["req_per_s"] / summary["old"]["req_per_s"]
    summary["ratio_router_cpu_per_token"] = (
        summary["new"]["router_cpu_us_per_token"] / summary["old"]["router_cpu_us_per_token"]
    )
    print_table(rounds, summary)
    failures = summary["old"]["failures"] + summary["new"]["failures"]
    if args.out:
        result = {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": machine() | {"load_avg_at_start": load_at_start},
            "trees": {n: {"commit": s.commit, "path": str(s.tree)} for n, s in sides.items()},
            "rounds": rounds,
            "summary": summary,
            "exit_codes": exit_codes,
            "unclean_exits": {n: s.unclean_exits for n, s in sides.items()},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if failures:
        print(f"{failures} requests failed", file=sys.stderr)
    return 1 if failures else 0


def machine() -> dict:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "load_avg_1_5_15": list(os.getloadavg()),
        "python": sys.version.split()[0],
    }


if __name__ == "__main__":
    raise SystemExit(main())
