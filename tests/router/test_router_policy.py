"""Routing policies (router.routing) as pure functions over a LoadView."""

from __future__ import annotations

import pytest

from engine.protocol import WorkerLoad
from router.directory import StaticDirectory, WorkerDirectory, WorkerInfo
from router.routing import (
    LOCAL,
    REMOTE,
    LoadView,
    NoWorkersError,
    choose_decode,
    choose_prefill,
    decide_path,
    plan_route,
    prefix_key,
)


def worker(wid: str, role: str, free=100, total=100, running=0, waiting=0, queued=0, **extra):
    load = WorkerLoad(wid, role, free, total, running, waiting, queued, extra=extra)
    return WorkerInfo(wid, role, f"tcp://127.0.0.1:{5000 + len(wid)}", load)


def test_decode_prefers_free_blocks_then_small_batch():
    view = LoadView([worker("a", "decode", free=20), worker("b", "decode", free=80)])
    assert choose_decode(view.decode_workers, 10).worker_id == "b"
    view = LoadView(
        [worker("a", "decode", free=50, running=30), worker("b", "decode", free=50, running=2)]
    )
    assert choose_decode(view.decode_workers, 10).worker_id == "b"
    # Waiting requests (a backlogged worker) weigh more than running ones.
    view = LoadView([worker("a", "decode", running=4, waiting=4), worker("b", "decode", running=9)])
    assert choose_decode(view.decode_workers, 10).worker_id == "b"


def test_decode_avoids_workers_without_room():
    # "a" is emptier by batch but cannot hold a 100-token prompt (16-token blocks -> 7 blocks).
    view = LoadView([worker("a", "decode", free=5), worker("b", "decode", free=60, running=20)])
    assert choose_decode(view.decode_workers, 100).worker_id == "b"
    # With a bigger block size reported by the worker, 5 blocks are enough.
    view = LoadView(
        [worker("a", "decode", free=5, block_size=32), worker("b", "decode", free=60, running=20)]
    )
    assert choose_decode(view.decode_workers, 100).worker_id == "a"


def test_burst_spreads_by_optimistic_updates():
    view = LoadView([worker(f"d{i}", "decode") for i in range(3)])
    chosen = []
    for _ in range(6):
        plan = plan_route(view, [1] * 20, disagg_threshold=1000)
        view.note_dispatch(plan, 20)
        chosen.append(plan.decode.worker_id)
    assert sorted(chosen) == ["d0", "d0", "d1", "d1", "d2", "d2"]


def test_prefill_least_queued_without_affinity():
    view = LoadView([worker("p0", "prefill", queued=5000), worker("p1", "prefill", queued=10)])
    assert choose_prefill(view.prefill_workers, [1, 2, 3], prefix_tokens=64).worker_id == "p1"


def test_prefill_prefix_affinity_is_sticky_while_load_is_comparable():
    prompts = [[i] * 64 + [7] * 10 for i in range(40)]
    view = LoadView([worker(f"p{i}", "prefill") for i in range(4)])
    first = {tuple(p): choose_prefill(view.prefill_workers, p, 64, 100).worker_id for p in prompts}
    # Different prefixes spread over the pool; the same prefix always goes to the same worker.
    assert len(set(first.values())) > 1
    for p in prompts:
        tail = p[:64] + [99] * 30  # same first block, different rest
        assert choose_prefill(view.prefill_workers, tail, 64, 100).worker_id == first[tuple(p)]
    # Once the preferred worker is far busier than the least loaded one, load wins.
    target = first[tuple(prompts[0])]
    view.states[target].queued_prefill_tokens = 1000
    assert choose_prefill(view.prefill_workers, prompts[0], 64, 100).worker_id != target
    assert choose_prefill(view.prefill_workers, prompts[0], 64, 5000).worker_id == target


def test_prefix_key():
    assert prefix_key([1, 2], 4) is None
    assert prefix_key([1, 2, 3, 4, 5], 4) == prefix_key([1, 2, 3, 4, 9], 4)
    assert prefix_key([1, 2, 3, 4], 4) != prefix_key([1, 2, 3, 5], 4)


def test_disaggregation_decision():
    assert decide_path(10, 64, num_prefill_workers=2) == LOCAL
    assert decide_path(64, 64, num_prefill_workers=2) == REMOTE
    assert decide_path(5000, 64, num_prefill_workers=0) == LOCAL  # colocated mode
    view = LoadView([worker("p", "prefill"), worker("d", "decode")])
    plan = plan_route(view, list(range(100)), disagg_threshold=64)
    assert plan.path == REMOTE and plan.prefill.worker_id == "p" and plan.decode.worker_id == "d"
    plan = plan_route(view, list(range(10)), disagg_threshold=64)
    assert plan.path == LOCAL and plan.prefill is None


def test_colocated_workers_decode_and_prefill_workers_never_do():
    view = LoadView([worker("p", "prefill"), worker("c", "colocated")])
    assert [s.worker_id for s in view.decode_workers] == ["c"]
    with pytest.raises(NoWorkersError):
        plan_route(LoadView([worker("p", "prefill")]), [1], disagg_threshold=1)


def test_worker_info_validation_and_static_directory():
    with pytest.raises(ValueError):
        worker("x", "router")
    with pytest.raises(ValueError):
        WorkerInfo("x", "decode", "not-an-endpoint", worker("x", "decode").load)
    d = StaticDirectory([worker("a", "decode")])
    assert isinstance(d, WorkerDirectory)


def test_decode_prefix_affinity_keeps_a_conversation_on_one_worker_while_load_allows():
    """A conversation's turns share their first tokens, so they hash to the same decode worker
    (whose prefix cache holds the earlier turns); load still wins beyond the slack, and a
    worker without room for the prompt is never preferred."""
    view = LoadView([worker(f"d{i}", "decode") for i in range(4)])
    turns = [[i] * 64 + list(range(100, 100 + 10 * t)) for i in range(20) for t in (1, 3)]
    chosen = {}
    for prompt in turns:
        plan = plan_route(view, prompt, disagg_threshold=1000, decode_slack=0.25)
        chosen.setdefault(prompt[0], set()).add(plan.decode.worker_id)
    assert all(len(w) == 1 for w in chosen.values())  # every turn of a chat on one worker
    assert len({next(iter(w)) for w in chosen.values()}) > 1  # different chats spread
    key = prefix_key(turns[0], 64)
    target = choose_decode(view.decode_workers, 70, key=key, slack=0.25).worker_id
    view.states[target].running = 16  # cost +0.5: beyond the slack
    assert choose_decode(view.decode_workers, 70, key=key, slack=0.25).worker_id != target
    assert choose_decode(view.decode_workers, 70, key=key, slack=1.0).worker_id == target
    view.states[target].running, view.states[target].free_blocks = 0, 2
    assert choose_decode(view.decode_workers, 70, key=key, slack=1.0).worker_id != target
    # Without affinity (slack 0 and a tie broken by id) load alone decides, as before.
    assert choose_decode(view.decode_workers, 70).worker_id != target
