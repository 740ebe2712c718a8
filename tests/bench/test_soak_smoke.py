"""benchmarks/soak.py: a short real soak (tandem serve 1P1D, ~150 mixed requests, ~40 s on an
idle 2-core box), and the checks it applies, fed answers and samples that must fail them.

The real run proves the whole loop: the server starts in its own session, every process of it
is sampled, the mix (streams, chats, n=2, logprobs, client aborts, bad requests, both prefill
paths) is answered as expected, KV blocks come back, the server shuts down clean, and the JSON
and the plot are written. The unit checks prove each check can fail."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(REPO))

from benchmarks.serve_session import FD_NOISE, growth, process_label  # noqa: E402
from benchmarks.soak import Progress, evaluate  # noqa: E402
from benchmarks.soak_workload import (  # noqa: E402
    Outcome,
    RequestSpec,
    WorkloadContext,
    build_multiturn_workload,
    build_workload,
    check_body,
    check_events,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHECKS = {
    "rss_growth_sum",
    "fd_growth_sum",
    "rss_growth_per_process",
    "fd_growth_per_process",
    "no_new_processes",
    "kv_blocks_returned",
    "no_5xx",
    "good_requests_ok",
    "bad_requests_4xx",
    "both_prefill_paths",
    "host_pool_bounded",
    "index_bounded",
    "clean_shutdown",
}


@pytest.mark.slow
def test_soak_smoke_holds_every_check(make_tiny_model, tmp_path: Path) -> None:
    model = make_tiny_model("llama")
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "soak.py"), "--model", str(model)]
    cmd += ["--requests", "150", "--rate", "50", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["passed"] is True
    assert set(result["checks"]) == CHECKS and all(result["checks"].values()), result["checks"]
    req = result["requests"]
    assert req["total"] == 150 and sum(req["by_result"].values()) == 150
    # The mix really ran: every kind was sent, clients aborted, bad requests were refused.
    assert set(req["by_kind"]) >= {"completion_stream", "chat", "n2", "logprobs", "bad"}
    assert req["by_result"]["aborted"] > 0 and req["by_result"]["refused"] == req["bad"] > 0
    assert req["ok_long_prompts"] > 0 and req["ok_short_prompts"] > 0
    assert result["paths"]["local"] > 0 and result["paths"]["remote"] > 0
    # Every process of the session was sampled at start, after warm-up and at the end.
    names = [p["name"] for p in result["growth"]["processes"]]
    assert "tandem serve (driver + router)" in names
    assert sum("WorkerActor" in n for n in names) == 2, names
    assert {"ray gcs_server", "ray raylet", "ray::Controller"} <= set(names)
    for p in result["growth"]["processes"]:
        assert all(p["rss"][k] > 0 for k in ("warm", "end")) and p["fds"]["end"] > 0
    assert {"start", "warm", "end", "load_end"} <= set(result["marks"])
    assert len(result["timeline"]) >= 3
    assert all(b["free"] == b["total"] > 0 for b in result["kv_blocks"].values())
    assert result["shutdown"] == {"exit_code": 0, "leftovers": []}
    assert result["machine"]["cpu"] and result["command"]
    assert Path(result["plot"]).read_bytes()[:8] == PNG_MAGIC


# ---- each check can fail -------------------------------------------------------------------


def _snap(rss: dict[int, int], fds: int = 50) -> dict[int, dict]:
    return {pid: {"name": f"p{pid}", "rss": r, "fds": fds} for pid, r in rss.items()}


def test_growth_names_the_process_over_the_limit_and_new_ones() -> None:
    mb = 1 << 20
    snaps = {
        "start": _snap({1: 100 * mb, 2: 100 * mb}),
        "warm": _snap({1: 100 * mb, 2: 100 * mb}),
        "end": _snap({1: 101 * mb, 2: 108 * mb, 3: 5 * mb}),
    }
    g = growth(snaps, 5.0)
    assert [(o["pid"], o["metric"]) for o in g["over"]] == [(2, "rss")]
    assert g["totals"]["rss"]["growth_pct"] == pytest.approx(4.5)
    assert [p["pid"] for p in g["appeared"]] == [3]
    fd_snaps = snaps | {"end": {pid: s | {"fds": 60} for pid, s in snaps["warm"].items()}}
    assert {o["metric"] for o in growth(fd_snaps, 5.0)["over"]} == {"fds"}
    # A few sockets open at the moment of the sample are not a leak (CI saw 50 -> 53, 6%, in
    # Ray's dashboard agent); one past the slack is.
    transient = snaps | {
        "end": {pid: s | {"fds": 50 + FD_NOISE} for pid, s in snaps["warm"].items()}
    }
    assert not [o for o in growth(transient, 5.0)["over"] if o["metric"] == "fds"]
    leak = snaps | {"end": {pid: s | {"fds": 51 + FD_NOISE} for pid, s in snaps["warm"].items()}}
    assert {o["metric"] for o in growth(leak, 5.0)["over"]} == {"fds"}


class _Snapshots:
    """Records when Progress asks for a snapshot (the real Sampler reads /proc)."""

    def __init__(self) -> None:
        self.taken: list[tuple[str, int]] = []
        self.done = 0

    def snapshot(self, mark: str) -> dict:
        self.taken.append((mark, self.done))
        return {}


def _feed(results: list[tuple[str, bool]], warm_at: int) -> list[tuple[str, int]]:
    snaps = _Snapshots()
    progress = Progress(len(results), 1000, warm_at, snaps)
    for i, (result, long) in enumerate(results):
        snaps.done = i + 1
        progress.record(Outcome(i, "chat", 200, result, long=long))
    return snaps.taken


def test_warm_waits_for_both_prefill_paths_to_answer() -> None:
    """The first remote prefill's one-time set-up (its NIXL connection: fds) belongs to the
    warm-up: "warm" waits until a long and a short prompt were answered ok."""
    short, long, aborted_long = ("ok", False), ("ok", True), ("aborted", True)
    assert _feed([short, short, aborted_long, short, long, short], warm_at=2) == [("warm", 5)]
    assert _feed([long, short, short, short], warm_at=3) == [("warm", 3)]  # both already
    assert _feed([short] * 4, warm_at=2) == [("warm", 4)]  # never both: at the last one


def _result(**over) -> dict:
    mb = 1 << 20
    snaps = {k: _snap({1: 100 * mb}) for k in ("start", "warm", "end")}
    base = {
        "growth": growth(snaps, 5.0),
        "requests": {"http_5xx": 0, "by_result": {"ok": 9, "failed": 0, "refused": 1}, "bad": 1},
        "kv_blocks": {"decode-0": {"free": 10.0, "total": 10.0}},
        "paths": {"local": 3.0, "remote": 2.0},
        "shutdown": {"exit_code": 0, "leftovers": []},
    }
    return base | over


def test_evaluate_fails_each_check_on_its_own_fault() -> None:
    assert all(evaluate(_result(), 5.0).values())
    faults = {
        "kv_blocks_returned": {"kv_blocks": {"decode-0": {"free": 9.0, "total": 10.0}}},
        "no_5xx": {
            "requests": {"http_5xx": 1, "by_result": {"ok": 9, "failed": 0, "refused": 1}, "bad": 1}
        },
        "good_requests_ok": {
            "requests": {"http_5xx": 0, "by_result": {"ok": 9, "failed": 1, "refused": 1}, "bad": 1}
        },
        "bad_requests_4xx": {
            "requests": {"http_5xx": 0, "by_result": {"ok": 9, "failed": 0, "refused": 0}, "bad": 1}
        },
        "both_prefill_paths": {"paths": {"local": 3.0, "remote": 0.0}},
        "clean_shutdown": {"shutdown": {"exit_code": 0, "leftovers": ["123 raylet"]}},
    }
    for check, fault in faults.items():
        checks = evaluate(_result(**fault), 5.0)
        assert [k for k, v in checks.items() if not v] == [check], (check, checks)
    # An attached server (not started here) has no shutdown to judge.
    assert "clean_shutdown" not in evaluate(_result(shutdown={"exit_code": None}), 5.0)


def _spec(**kw) -> RequestSpec:
    base = {"index": 0, "kind": "completion", "path": "/v1/completions", "body": {}}
    return RequestSpec(**(base | {"n": 2, "max_tokens": 3, "prompt_tokens": 5} | kw))


def _choice(i: int, reason: str = "length") -> dict:
    return {"index": i, "finish_reason": reason}


def test_answer_checks_catch_wrong_usage_choices_and_streams() -> None:
    spec = _spec()
    usage = {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    good = {"choices": [_choice(0), _choice(1)], "usage": usage}
    assert check_body(spec, good) == ""
    assert "usage" in check_body(spec, good | {"usage": usage | {"completion_tokens": 5}})
    assert "choice indexes" in check_body(spec, good | {"choices": [_choice(0)]})
    assert "finish_reason" in check_body(spec, good | {"choices": [_choice(0), _choice(1, "stop")]})
    lp = _spec(n=1, logprobs=True)
    one = {"usage": usage | {"completion_tokens": 3, "total_tokens": 8}}
    assert (
        check_body(lp, one | {"choices": [_choice(0) | {"logprobs": {"tokens": ["a"] * 3}}]}) == ""
    )
    assert "logprob" in check_body(lp, one | {"choices": [_choice(0) | {"logprobs": None}]})
    events = [{"choices": [_choice(0), _choice(1)]}, {"choices": [], "usage": usage}, "[DONE]"]
    assert check_events(spec, events) == ""
    assert "[DONE]" in check_events(spec, events[:-1])
    assert "error" in check_events(spec, [{"error": {"message": "x"}}, *events])
    assert "usage" in check_events(spec, [events[0], "[DONE]"])


def test_workload_is_seeded_and_mixes_every_kind() -> None:
    ctx = WorkloadContext("m", 1024, 64, 1024, lambda msgs: 10 + len(msgs[0]["content"]) // 5)
    a, b = build_workload(400, 3, ctx), build_workload(400, 3, ctx)
    assert a == b and a != build_workload(400, 4, ctx)
    kinds = {s.kind for s in a}
    assert kinds == {"completion", "completion_stream", "chat", "chat_stream", "n2", "logprobs",
                     "abort_stream", "abort_wait", "bad"}  # fmt: skip
    good = [s for s in a if s.good]
    assert any(s.long for s in good) and any(not s.long for s in good)
    assert all(s.body["ignore_eos"] and s.body["max_tokens"] == s.max_tokens for s in good)
    assert all(len(s.body["prompt"]) == s.prompt_tokens for s in good if "prompt" in s.body)
    assert any(s.n == 2 for s in good) and any(s.logprobs for s in good)
    assert all(s.abort_after_chunks and s.stream for s in a if s.kind == "abort_stream")


def test_multiturn_workload_extends_each_conversation() -> None:
    """--mix multiturn: each turn's prompt is an earlier turn's plus more tokens (so caches
    hit), a conversation has at most `turns` turns, and the answers' usage is checkable."""
    ctx = WorkloadContext("m", 1024, 64, 1024, lambda msgs: 10)
    a = build_multiturn_workload(300, 3, ctx, turns=4)
    assert a == build_multiturn_workload(300, 3, ctx, turns=4) and len(a) == 300
    by_first: dict[tuple, list[list[int]]] = {}
    for s in a:
        p = s.body["prompt"]
        assert s.good and s.prompt_tokens == len(p) and s.body["temperature"] == 0
        by_first.setdefault(tuple(p[:64]), []).append(p)
    assert max(len(v) for v in by_first.values()) == 4  # whole conversations, <= 4 turns
    for turns in by_first.values():
        assert all(
            b[: len(a)] == a and len(b) > len(a) for a, b in zip(turns, turns[1:], strict=False)
        )
    assert {s.kind for s in a} == {"multiturn", "multiturn_stream"}
    result = {"kv_bounds": {"host_blocks": {"d": {"used": 9, "total": 8}},
                            "index_entries": 3, "index_max_entries": 2}}  # fmt: skip
    checks = evaluate({**_result(), **result}, 5.0)
    assert not checks["host_pool_bounded"] and not checks["index_bounded"]


def test_process_labels() -> None:
    gcs = "/x/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray"
    assert process_label("python -m cluster.cli serve", 7, 7) == "tandem serve (driver + router)"
    assert process_label(gcs, 8, 7) == "ray gcs_server"
    assert process_label("python -u /x/ray/_private/log_monitor.py", 9, 7) == "ray log_monitor"
    assert process_label("ray::WorkerActor", 10, 7) == "ray::WorkerActor"
    named = "ray::tandem-worker-decode-0:WorkerActor.__init__"
    assert process_label(named, 11, 7) == "ray::tandem-worker-decode-0:WorkerActor"
