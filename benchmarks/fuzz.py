"""Long fuzzing of a live router: the strategies of tests/fuzz, many more examples.

    .venv/bin/python benchmarks/fuzz.py                      # starts a tandem serve (tiny llama)
    .venv/bin/python benchmarks/fuzz.py --url http://127.0.0.1:8000 --model-name NAME
    .venv/bin/python benchmarks/fuzz.py --examples 20000 --frames 4000 --json out.json

HTTP: `--examples` requests drawn from the router's OpenAPI document (router/openapi.py) and
its hostile variations (tests/fuzz/hostile.py): valid bodies, one hostile field, damaged bytes
and content types, paths and methods; each answer judged by tests/fuzz/live.Checker. Frames
(only for a server this script started, whose log names the worker endpoints): `--frames`
messages to the workers' request sockets and the KV side channels (tests/fuzz/frames.py).
Nothing stops at the first problem: problems are counted by kind with one example each.

Prints the answers by status code, the 5xx count, the problem kinds, the time taken, and the
server's state after (GET /health, a plain completion, every KV block free).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # allow `python benchmarks/fuzz.py` from anywhere
    sys.path.insert(0, str(REPO))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from bench.live_server import LiveServer, kv_block_counts, parse_metrics  # noqa: E402
from router.openapi import openapi_document  # noqa: E402
from tests.fuzz import hostile  # noqa: E402
from tests.fuzz.live import Checker, Request, send, still_serving  # noqa: E402
from tests.fuzz.schema_gen import SchemaGen  # noqa: E402

# Share of --examples per HTTP strategy.
MIX = {"valid": 0.3, "hostile_field": 0.35, "damaged_bytes": 0.25, "paths": 0.1}
SERVE_FLAGS = (
    "--dtype", "float32", "--disagg-threshold", "8", "--max-frame-mb", "1",
    "--max-body-bytes", str(1 << 20),
)  # fmt: skip


@dataclass(slots=True)
class Tally:
    """Outcomes of one fuzz run: answers by status, problems by kind (first example kept)."""

    statuses: Counter = field(default_factory=Counter)
    problems: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)
    sent: Counter = field(default_factory=Counter)
    slowest: list = field(default_factory=list)  # (seconds, example), the 5 slowest

    def add(self, strategy: str, problems: list[str], example: str, seconds: float = 0.0) -> None:
        self.sent[strategy] += 1
        self.slowest = sorted([*self.slowest, (round(seconds, 2), example[:200])])[-5:]
        for p in problems:
            kind = _kind(p)
            self.problems[kind] += 1
            self.examples.setdefault(kind, f"{example[:300]} -> {p[:300]}")


def _kind(problem: str) -> str:
    """A problem with its ids and numbers blanked, so repeats count as one kind."""
    text = re.sub(r"(cmpl|chatcmpl)-[0-9a-f]+", r"\1-*", problem)
    return re.sub(r"\d+", "N", text)[:160]


def _settings(n: int) -> settings:
    return settings(
        max_examples=max(n, 1),
        deadline=None,
        database=None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
    )


def fuzz_http(url: str, doc: dict, examples: int, rng_seed: int, tally: Tally) -> Checker:
    gen = SchemaGen(doc, hostile.LIVE_LIMITS)
    checker = Checker(doc)
    strategies = {
        "valid": hostile.valid_requests(gen),
        "hostile_field": hostile.wrong_field_requests(gen),
        "damaged_bytes": hostile.raw_body_requests(gen),
        "paths": hostile.path_requests(),
    }
    for name, strategy in strategies.items():
        _runner(url, checker, tally, name, strategy, int(examples * MIX[name]), rng_seed)()
    tally.statuses.update(checker.counts)
    return checker


def _runner(url, checker: Checker, tally: Tally, name: str, strategy, n: int, rng_seed: int):
    @seed(rng_seed)
    @_settings(n)
    @given(req=strategy)
    def run(req):
        t0 = time.monotonic()
        ans = send(url, req)
        tally.add(name, checker.problems(req, ans), req.short(), time.monotonic() - t0)

    return run


def fuzz_frames(serve, frames: int, rng_seed: int, tally: Tally) -> dict:
    """Worker request sockets, then KV side channels; returns the bad-frame counter check."""
    import zmq

    from tests.fuzz.frames import bad_frame_counts, worker_counts, worker_messages

    endpoints = serve.endpoints()
    before = bad_frame_counts(serve.metrics())
    ctx = zmq.Context()
    expected: Counter = Counter()
    pushes = {}
    for name, (request_ep, _) in endpoints.items():
        pushes[name] = ctx.socket(zmq.PUSH)
        pushes[name].connect(request_ep)

    @seed(rng_seed)
    @_settings(frames // 2)
    @given(worker=st.sampled_from(sorted(endpoints)), parts=worker_messages())
    def to_workers(worker, parts):
        pushes[worker].send_multipart(parts)
        expected[worker] += sum(bool(worker_counts(p)) for p in parts)
        tally.sent["worker_frames"] += 1

    to_workers()
    _side_channels(ctx, endpoints, frames // 2, rng_seed, tally)()
    want = {w: before.get(w, 0) + expected[w] for w in endpoints}
    deadline = time.monotonic() + 30
    while bad_frame_counts(serve.metrics()) != want and time.monotonic() < deadline:
        time.sleep(0.5)
    ctx.destroy(linger=0)
    return {"refused": want, "counted": bad_frame_counts(serve.metrics())}


def _side_channels(ctx, endpoints: dict, n: int, rng_seed: int, tally: Tally):
    """A run over the KV side channels: each message must get its one answer."""
    import zmq

    from engine.protocol import decode
    from tests.fuzz.frames import MESSAGES, side_channel_answer

    dealers = {}
    for name, (_, kv_ep) in endpoints.items():
        dealers[name] = ctx.socket(zmq.DEALER)
        dealers[name].connect(kv_ep)
    dead: set[str] = set()

    @seed(rng_seed)
    @_settings(n)
    @given(worker=st.sampled_from(sorted(endpoints)), parts=MESSAGES)
    def to_side_channels(worker, parts):
        if worker in dead:  # waiting 5 s per frame on a dead channel would prove nothing more
            tally.add("side_channel_frames", [f"{worker}: side channel dead"], "")
            return
        dealers[worker].send_multipart(parts)
        problems = []
        if not dealers[worker].poll(5000):
            dead.add(worker)
            problems = [f"{worker}: side channel stopped answering"]
        else:
            answer = type(decode(dealers[worker].recv_multipart()[-1]))
            if answer is not side_channel_answer(parts):
                problems = [f"{worker}: side channel answered {answer.__name__}"]
        tally.add("side_channel_frames", problems, f"{worker} {parts!r:.200}")

    return to_side_channels


def _metric_values(url: str) -> dict[str, float]:
    return parse_metrics(send(url, Request("GET", "/metrics")).body.decode())


def blocks_free(url: str) -> bool:
    blocks = kv_block_counts(_metric_values(url))
    return bool(blocks) and all(free == total for free, total in blocks.values())


def remote_handoff(url: str, model: str) -> dict:
    """A prompt long enough for the prefill worker: how long it took and whether its KV was
    recomputed on the decode worker (a broken side channel shows here, not in /health)."""

    def recomputes() -> float:
        values = _metric_values(url)
        return sum(float(v) for k, v in values.items() if k.startswith("tandem_kv_recomputes"))

    before, t0 = recomputes(), time.monotonic()
    body = {"model": model, "prompt": list(range(300, 340)), "max_tokens": 4}
    ans = send(url, Request("POST", "/v1/completions", json.dumps(body).encode()), 120)
    seconds = round(time.monotonic() - t0, 2)
    time.sleep(2)  # the counters come with the next load report
    return {"status": ans.status, "seconds": seconds, "recomputed": recomputes() - before}


def _start(model: str | None, served_name: str) -> LiveServer:
    from tools.make_model import cached_model

    path = (
        Path(model)
        if model
        else cached_model("llama", "tiny", 0, cache_dir=REPO / "benchmarks" / ".cache")
    )
    tmp = REPO / "benchmarks" / ".cache" / f"fuzz-serve-{int(time.time())}"
    tmp.mkdir(parents=True)
    return LiveServer(path, tmp, *SERVE_FLAGS, "--served-model-name", served_name).start()


def report(tally: Tally, frames: dict | None, after: dict, seconds: float) -> dict:
    n = sum(tally.statuses.values())
    out = {
        "requests": n,
        "by_status": dict(sorted(tally.statuses.items())),
        "server_errors_5xx": sum(v for k, v in tally.statuses.items() if k >= 500),
        "no_answer": tally.statuses.get(0, 0),
        "sent": dict(tally.sent),
        "problems": dict(tally.problems.most_common()),
        "problem_examples": tally.examples,
        "slowest": tally.slowest,
        "frames": frames,
        "after": after,
        "seconds": round(seconds, 1),
    }
    print(f"\nHTTP requests: {n} in {seconds:.1f}s; by status: {out['by_status']}")
    print(f"5xx: {out['server_errors_5xx']}, no answer: {out['no_answer']}, sent: {out['sent']}")
    if frames is not None:
        print(
            f"frames in {frames['seconds']}s; worker bad frames refused by the decoder "
            f"{frames['refused']}, counted by the workers {frames['counted']}"
        )
    print(f"problems ({sum(tally.problems.values())}):")
    for kind, count in tally.problems.most_common():
        print(f"  {count:6d}  {kind}\n          e.g. {tally.examples[kind][:400]}")
    print(f"slowest: {tally.slowest}")
    print(f"after: {after}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running router (default: start a tandem serve)")
    ap.add_argument("--model", help="model dir for the started server (default: tiny llama)")
    ap.add_argument("--model-name", default="fuzz-model", help="the served model name")
    ap.add_argument("--examples", type=int, default=5000, help="HTTP requests")
    ap.add_argument("--frames", type=int, default=1000, help="ZMQ messages (started server)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    name = args.model_name
    serve = None if args.url else _start(args.model, name)
    url = args.url or serve.url
    tally, frames, after, seconds = Tally(), None, {}, 0.0
    try:
        t0 = time.monotonic()
        fuzz_http(url, openapi_document(name), args.examples, args.seed, tally)
        seconds = time.monotonic() - t0
        if serve is not None and args.frames:
            t0 = time.monotonic()
            frames = fuzz_frames(serve, args.frames, args.seed, tally)
            frames["seconds"] = round(time.monotonic() - t0, 1)
        time.sleep(2)  # load reports reach /metrics a refresh after the last request
        after["still_serving"] = still_serving(url, name) or "ok"
        after["remote_handoff"] = remote_handoff(url, name)
        after["blocks_free"] = blocks_free(url)
    finally:
        code = serve.stop() if serve is not None else None
    after["serve_exit_code"] = code
    if serve is not None:
        after["serve_log"] = str(serve.log_path)  # the workers' tracebacks are in it
    out = report(tally, frames, after, seconds)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 1 if tally.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
