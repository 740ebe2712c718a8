"""The autoscaler's bookkeeping without Ray: what the policy is told about the pools, which
worker a scale-down takes, the ids new workers get, and the window it hands the policy.
(Acting on Ray is tests/autoscale/test_live_autoscale.py.)"""

from __future__ import annotations

import asyncio
from dataclasses import asdict

import pytest

from bench.capacity_profile import CapacityProfile
from cluster.autoscaler import Autoscaler
from cluster.planner.config import PlannerConfig
from cluster.planner.types import Decision
from router.signals import LengthHistogram, WindowSignals


class Registry:
    """The controller's side the autoscaler reads: its `workers` registry and `drain`."""

    def __init__(self, workers: dict[str, dict]) -> None:
        self.workers = workers
        self.drained: list[str] = []

    async def drain(self, wid: str, timeout_s: float) -> dict:
        self.drained.append(wid)
        self.workers.pop(wid)
        return {"idle": True}


def _worker(role: str, state: str = "ready", running: int = 0, waiting: int = 0) -> dict:
    load = {"num_running": running, "num_waiting": waiting, "queued_prefill_tokens": 0}
    load |= {"num_free_blocks": 50, "num_total_blocks": 100}
    return {"role": role, "state": state, "load": load}


def _args() -> dict:
    profile = CapacityProfile(
        model="m", hardware="h", source="measured", prefill_points=[(100, 0.1)],
        decode_fixed_s=0.01, decode_per_seq_s=0.001, decode_per_ctx_token_s=0.0,
        kv_bytes_per_token=1, transfer_latency_s=0.0, transfer_bytes_per_s=1.0,
        kv_capacity_tokens=1000, max_batch_tokens=100, max_num_seqs=8, startup_s=1.0,
    )  # fmt: skip
    spec = {
        "engine_kwargs": {}, "quantization": {}, "bind_host": "127.0.0.1", "use_gpu": False,
        "cpus_per_worker": 1.0, "lease_seconds": 1.0, "on_transfer_failure": "recompute",
        "log_level": "WARNING", "max_frame_bytes": 1, "kv_read_timeout_s": 1.0,
        "max_restarts": 0,
    }  # fmt: skip
    return {"spec": spec, "planner": asdict(PlannerConfig()), "profile": profile.to_dict()}


class Fixed:
    name = "fixed"

    def __init__(self, desired: dict[str, int]) -> None:
        self.desired = desired
        self.seen: list[tuple[WindowSignals, object]] = []

    def initial(self) -> dict[str, int]:
        return dict(self.desired)

    def decide(self, now, window, pools) -> Decision:
        self.seen.append((window, pools))
        return Decision(dict(self.desired), causes=dict.fromkeys(self.desired, "static"))


def test_pool_counts_treat_down_workers_as_coming_back():
    reg = Registry(
        {
            "prefill-0": _worker("prefill"),
            "prefill-1": _worker("prefill", "down"),
            "decode-0": _worker("decode"),
            "decode-1": _worker("decode", "draining"),
        }
    )
    counts = Autoscaler(reg, _args(), Fixed({})).pool_counts()
    assert counts.ready == {"prefill": 1, "decode": 1}
    assert counts.starting == {"prefill": 1, "decode": 0}  # Ray restarts it: do not add one
    assert counts.draining == {"prefill": 0, "decode": 1}


def test_a_start_that_has_registered_counts_once_and_is_not_cancelled():
    """A launch registers its worker, then awaits the controller's first poll before it
    leaves `starting`: the worker is READY and still starting in that window. Counted twice,
    a pool of 2 looked like 3 and the planner's bound (max 2) cancelled the start, killing the
    worker it had just started (the live autoscale test failed so)."""

    async def run() -> tuple[Autoscaler, asyncio.Task]:
        reg = Registry({"prefill-0": _worker("prefill"), "prefill-1": _worker("prefill")})
        reg.workers["decode-0"] = _worker("decode")
        scaler = Autoscaler(reg, _args(), Fixed({"prefill": 2, "decode": 1}))
        launch = asyncio.get_running_loop().create_task(asyncio.sleep(60))
        scaler.starting["prefill-1"] = ("prefill", launch)
        counts = scaler.pool_counts()
        assert counts.ready["prefill"] == 2 and counts.starting["prefill"] == 0
        await scaler.tick(100.0)
        assert not launch.cancelled() and reg.drained == []
        # Scaling that pool down drains a READY worker; the registered start is not cancelled.
        scaler.policy = Fixed({"prefill": 1, "decode": 1})
        await scaler.tick(200.0)
        await asyncio.gather(*scaler.draining.values())
        launch.cancel()
        return scaler, reg

    _, reg = asyncio.run(run())
    assert len(reg.drained) == 1 and reg.drained[0].startswith("prefill-")


def test_scale_down_drains_the_least_loaded_worker_and_new_ids_do_not_clash():
    async def run() -> Registry:
        reg = Registry(
            {
                "decode-0": _worker("decode", running=3),
                "decode-1": _worker("decode", running=0),
                "decode-4": _worker("decode", running=5),
                "prefill-0": _worker("prefill"),
            }
        )
        scaler = Autoscaler(reg, _args(), Fixed({"prefill": 1, "decode": 2}))
        assert scaler._next_id("decode") == "decode-5"
        assert scaler._next_id("prefill") == "prefill-1"
        await scaler.tick(100.0)
        await asyncio.gather(*scaler.draining.values())
        return reg

    reg = asyncio.run(run())
    assert reg.drained == ["decode-1"]


def test_window_merges_router_reports_and_takes_worker_numbers_from_the_registry():
    reg = Registry(
        {
            "prefill-0": _worker("prefill", waiting=2),
            "decode-0": _worker("decode", running=4, waiting=1),
        }
    )
    policy = Fixed({"prefill": 1, "decode": 1})
    scaler = Autoscaler(reg, _args(), policy)
    for router, start in (("a", 0.0), ("a", 1.0), ("b", 0.0)):
        hist = LengthHistogram()
        hist.add(100, 3)
        w = WindowSignals(start_s=start, duration_s=1.0, arrivals=3, prompt_lengths=hist)
        scaler.report(router, w.to_dict())
    scaler.report("c", {"start_s": 0, "duration_s": -1})  # a bad report is dropped
    asyncio.run(scaler.tick(2.0))
    window, pools = policy.seen[-1]
    assert window.arrivals == 9 and window.prompt_lengths.count == 9
    assert window.duration_s == pytest.approx(2.0)  # router a's two windows, end to end
    assert (window.prefill_waiting, window.decode_running, window.decode_waiting) == (2, 4, 1)
    assert window.kv_usage == pytest.approx(0.5)
    assert pools.ready == {"prefill": 1, "decode": 1}
    status = scaler.status()
    assert status["decisions"] == [
        ["decode", "hold", "static", 1],
        ["prefill", "hold", "static", 1],
    ]
    assert status["observed"]["arrival_rate"] == pytest.approx(4.5)
