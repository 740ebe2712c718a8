"""Which files of the serving packages one streamed remote chat completion passes through.

`python benchmarks/request_path.py [--model DIR] [--max-tokens 8] [--json OUT]`

What it measures: in ONE process, a router (`router.server.RouterServer` on this thread's
asyncio loop, workers from a `router.directory.StaticDirectory`), a prefill worker and a decode
worker (engine servers with real KV agents, built as cluster/worker_actor.py builds them) on a
tiny model (`tools.make_model.cached_model("llama", "tiny")`, chat template included), with
`disagg_threshold` low enough that the prompt is prefilled on the prefill worker and its KV
read over NIXL by the decode worker. After one warm-up request of the same kind (so lazy
imports and first-use set-up do not count) and once both workers are idle again, the tracer is
armed, ONE streamed chat completion is sent with aiohttp and checked (`X-Tandem-Path: remote`,
`max_tokens` tokens, `[DONE]`), and the tracer is disarmed once both workers are idle again (the
request's end on the workers, the prefill lease released and the decode blocks freed, counts).

The tracer records, per thread, each code object's `co_filename` the first time a frame of it
runs while armed, with the time; the threads' records are merged in first-seen time order and
each file kept at its first sighting. Files are kept when they lie in router/, prefill_worker/,
decode_worker/, kv_transfer/ or engine/ of the tree the serving packages were imported from;
the ones under engine/models, engine/attention and engine/kernels (the model forward) are
counted apart as well.

Why the tracer is installed before the threads start but records only while armed: on Python
3.11 `threading.settrace` reaches only threads started after it and `sys.settrace` only the
calling thread, so a tracer installed after start-up would miss the worker loops. Until armed
it returns at once and records nothing, so start-up and warm-up code still do not count.

What "passes through" includes: any code of those packages that runs in the process while the
request is in flight, on any thread: the router's handler and stream, both workers' loops
(their idle iterations included: they are the loops that serve the request) and the KV agents.
The router's periodic directory refresh and planner-signal push are turned off (not part of a
request). `--ref` is not offered: to measure another commit, materialize it (`git archive REV
| tar -x -C DIR`) and run this script with PYTHONPATH=DIR and cwd=DIR; the small shims marked
"53e8895 compatibility" below cover that commit's older names.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if "PYTHONPATH" not in os.environ:  # `python benchmarks/request_path.py` measures this tree;
    sys.path.insert(0, str(REPO))  # with PYTHONPATH set, the tree it names is measured

SERVING = ("router", "prefill_worker", "decode_worker", "kv_transfer", "engine")
FORWARD = ("engine/models/", "engine/attention/", "engine/kernels/")
SERVED = "tiny-llama"
# Two prompts that differ in their first words, so the measured request shares no full KV
# block with the warm-up one (a prefix-cache hit would take a different path).
WARMUP_TEXT = "Every morning they walked down to the harbour before the sun came up and back."
MEASURED_TEXT = "Once upon a time, in a small village by the sea, there lived an old fisherman."


class PathTracer:
    """Records (time, thread, file) the first time each code object runs while armed."""

    def __init__(self) -> None:
        self.armed = False
        self._seen: dict[int, set] = {}  # thread ident -> code objects seen while armed
        self.records: list[tuple[int, str, str]] = []  # (perf_counter_ns, thread name, file)

    def install(self) -> None:
        threading.settrace(self._trace)
        sys.settrace(self._trace)

    def remove(self) -> None:
        self.armed = False
        threading.settrace(None)  # type: ignore[arg-type]
        sys.settrace(None)

    def _trace(self, frame, event, arg):
        if not self.armed:
            return None
        code = frame.f_code
        seen = self._seen.setdefault(threading.get_ident(), set())
        if code not in seen:
            seen.add(code)
            name = threading.current_thread().name
            self.records.append((time.perf_counter_ns(), name, code.co_filename))
        return None  # call events only: no per-line tracing inside the frame

    def files_in_order(self) -> list[tuple[str, str]]:
        """(file, thread that ran it first), merged over threads in first-seen order."""
        first: dict[str, str] = {}
        for _, thread, path in sorted(self.records):
            first.setdefault(path, thread)
        return list(first.items())


def serving_root() -> Path:
    """The tree the serving packages come from; all five must come from the same one."""
    import importlib

    roots = {Path(importlib.import_module(p).__file__).resolve().parents[1] for p in SERVING}
    if len(roots) != 1:
        raise SystemExit(f"serving packages come from several trees: {sorted(map(str, roots))}")
    return roots.pop()


def serving_files(files: list[tuple[str, str]], root: Path) -> list[tuple[str, str]]:
    """(path relative to `root`, thread) of the files inside the serving packages."""
    out = []
    for path, thread in files:
        try:
            rel = Path(path).resolve().relative_to(root).as_posix()
        except ValueError:
            continue
        if rel.split("/", 1)[0] in SERVING:
            out.append((rel, thread))
    return out


# ---------------------------------------------------------------------------- the system


def make_model_dir(cache_dir: Path) -> Path:
    try:
        from tools.make_model import cached_model
    except ImportError:  # 53e8895 compatibility: make_model lived in engine/
        from engine.make_model import cached_model
    return cached_model("llama", "tiny", 0, cache_dir=cache_dir)


def build_workers(model: Path, dtype: str) -> tuple:
    """A prefill and a decode engine server with real KV agents (not started)."""
    from engine.llm_engine import EngineConfig, LLMEngine
    from kv_transfer.agent import KVTransferAgent

    try:
        from decode_worker.server import decode_server
        from prefill_worker.server import prefill_server
    except ImportError:  # 53e8895 compatibility: the servers were classes of these names
        from decode_worker.server import DecodeServer as decode_server
        from prefill_worker.server import PrefillServer as prefill_server

    kw = dict(model=str(model), dtype=dtype, max_num_batched_tokens=256, num_kv_blocks=64)
    pe = LLMEngine(EngineConfig(**kw, role="prefill"))
    de = LLMEngine(EngineConfig(**kw, role="decode"))
    p = prefill_server("p0", pe, KVTransferAgent("p0", pe.cache))
    d = decode_server("d0", de, KVTransferAgent("d0", de.cache))
    return p, d


def make_router(model: Path, servers: tuple):
    from router.config import RouterConfig
    from router.directory import StaticDirectory, WorkerInfo
    from router.server import RouterServer

    infos = [WorkerInfo(s.worker_id, s.role, s.endpoint, s.latest_load()) for s in servers]
    config = RouterConfig(
        model_path=str(model),
        served_model_name=SERVED,
        port=0,
        disagg_threshold=8,  # every chat prompt here is longer: prefilled remotely
        refresh_interval_s=3600.0,  # the periodic refresh is not part of one request
        signal_interval_s=0.0,  # nor the planner-signal push
    )
    return RouterServer(config, StaticDirectory(infos))


async def one_chat(session, url: str, text: str, max_tokens: int) -> dict:
    """Sends one streamed chat completion; returns its path header, pieces and usage."""
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": text}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        raw = await resp.read()
        status, path = resp.status, resp.headers.get("X-Tandem-Path", "")
    events = [ln[6:] for ln in raw.decode().splitlines() if ln.startswith("data: ")]
    if status != 200 or not events or events[-1] != "[DONE]":
        raise RuntimeError(f"bad answer: HTTP {status}: {raw[-500:]!r}")
    chunks = [json.loads(e) for e in events[:-1]]
    for c in chunks:
        if "error" in c:
            raise RuntimeError(f"stream error: {c['error']}")
    pieces = [ch["delta"].get("content") or "" for c in chunks for ch in c.get("choices", [])]
    usage = next((c["usage"] for c in chunks if c.get("usage")), {})
    return {"path": path, "text": "".join(pieces), "usage": usage}


def check_answer(answer: dict, max_tokens: int, what: str) -> None:
    if answer["path"] != "remote":
        raise RuntimeError(f"{what}: X-Tandem-Path is {answer['path']!r}, wanted 'remote'")
    got = answer["usage"].get("completion_tokens")
    if got != max_tokens:
        raise RuntimeError(f"{what}: {got} completion tokens, wanted {max_tokens}")


async def wait_idle(servers: tuple, timeout_s: float = 30.0) -> None:
    """Until both workers hold nothing (no request, lease or READ), then a few loop turns."""
    deadline = time.monotonic() + timeout_s
    while not all(s.is_idle() for s in servers):
        if time.monotonic() > deadline:
            raise RuntimeError("workers still busy after a request")
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)


async def measure(router, servers: tuple, tracer: PathTracer, max_tokens: int) -> dict:
    import aiohttp

    await router.start()
    try:
        url = f"http://127.0.0.1:{router.port}"
        async with aiohttp.ClientSession() as session:
            check_answer(await one_chat(session, url, WARMUP_TEXT, max_tokens), max_tokens, "warm")
            await wait_idle(servers)
            tracer.armed = True
            try:
                answer = await one_chat(session, url, MEASURED_TEXT, max_tokens)
                # The request ends on the workers too: the prefill worker's lease released
                # after the decode worker's READ, the decode worker's blocks freed.
                await wait_idle(servers)
            finally:
                tracer.armed = False
        check_answer(answer, max_tokens, "measured request")
        return answer
    finally:
        await router.stop()


# ---------------------------------------------------------------------------- entry point


def report(files: list[tuple[str, str]], answer: dict, root: Path) -> dict:
    forward = [f for f, _ in files if f.startswith(FORWARD)]
    width = max((len(f) for f, _ in files), default=0)
    print(f"tree: {root}")
    print(f"request: X-Tandem-Path {answer['path']}, {answer['usage']['completion_tokens']} tokens")
    for i, (f, thread) in enumerate(files, 1):
        mark = "  (forward)" if f.startswith(FORWARD) else ""
        print(f"{i:3d}. {f:<{width}}  [{thread}]{mark}")
    print(
        f"files: {len(files)} in {', '.join(p + '/' for p in SERVING)}"
        f" ({len(forward)} of them the model forward: {', '.join(FORWARD)})"
    )
    return {
        "tree": str(root),
        "path": answer["path"],
        "completion_tokens": answer["usage"]["completion_tokens"],
        "count": len(files),
        "files": [f for f, _ in files],
        "first_thread": {f: t for f, t in files},
        "forward_count": len(forward),
        "forward_files": forward,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: the tiny llama, made if needed)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", dest="json_out", help="write the list and counts here")
    # float32 by default: plain torch paths, no CPU-kernel build (`tandem serve` defaults to
    # bfloat16, whose CPU GEMMs and attention may add engine/kernels files to the list).
    ap.add_argument("--dtype", default="float32", help="model dtype of both workers")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (per process)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    root = serving_root()
    cache = root / "benchmarks" / ".cache"  # per tree: each tree's own make-model
    model = Path(args.model) if args.model else make_model_dir(cache)
    servers = build_workers(model, args.dtype)
    tracer = PathTracer()
    tracer.install()  # before the worker threads start; it records only while armed
    try:
        for s in servers:
            s.start()
        answer = asyncio.run(measure(make_router(model, servers), servers, tracer, args.max_tokens))
    finally:
        tracer.remove()
        for s in servers:
            s.stop()
    result = report(serving_files(tracer.files_in_order(), root), answer, root)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
