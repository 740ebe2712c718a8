"""The autoscaler: runs the planner inside the controller and acts on its decisions with Ray.

Lifecycle (one per controller incarnation, started by `tandem serve --autoscale`):

    routers report windows   `report(router_id, window)` every few seconds (router signals)
    every interval_s         `tick()`: the windows since the last tick, per router
                             concatenated, across routers merged, worker-side numbers taken
                             from the registry -> `policy.decide(now, window, pools)`
    scale up                 `launch_worker` starts a named worker actor (Ray, or its
                             autoscaler on `ray up`/KubeRay, finds it a node: workers ask for
                             `tandem_prefill`/`tandem_decode`); once its constructor is done it
                             is registered READY like a launch-time worker
    scale down               a worker still starting is cancelled first; else the least loaded
                             READY worker is drained (Controller.drain: no new requests, what it
                             holds finishes, leases released, then the actor is killed)

Pool counts the policy sees: READY workers are `ready`; launched-but-unregistered ones and
DOWN ones (Ray is restarting them: they come back) are `starting`, so neither a slow start nor
a crash makes the planner ask twice for the same demand; DRAINING ones are `draining`.
`status()` is what routers export as tandem_planner_* metrics.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections import Counter
from dataclasses import asdict

from bench.capacity_profile import CapacityProfile
from cluster.planner.config import PlannerConfig
from cluster.planner.policy import Planner
from cluster.planner.types import DECODE_POOL, PREFILL_POOL, Decision, PoolCounts
from cluster.worker_launch import WorkerSpec, launch_worker, remove_worker_group
from engine.roles import DECODE, PREFILL
from router.signals import WindowSignals, concat_windows, merge_windows

log = logging.getLogger(__name__)
POOL_ROLES = {PREFILL_POOL: PREFILL, DECODE_POOL: DECODE}
# A drained worker finishes what it holds however long that takes (a request accepted is
# never cut short by a scaling decision); this bounds only a worker that never gets idle.
SCALE_DOWN_DRAIN_S = 600.0
_MAX_WINDOWS = 256  # per router between ticks: a router reporting too often cannot grow this


class Autoscaler:
    def __init__(self, controller, args: dict, policy=None) -> None:
        self.controller = controller  # cluster.controller.Controller (same event loop)
        self.spec = WorkerSpec.from_dict(args["spec"])
        self.config = PlannerConfig(**args["planner"])
        self.profile = CapacityProfile.from_dict(args["profile"])
        self.policy = policy or Planner(self.profile, self.config)
        self.windows: dict[str, list[WindowSignals]] = {}
        self.starting: dict[str, tuple[str, asyncio.Task]] = {}  # worker id -> (role, launch)
        self.draining: dict[str, asyncio.Task] = {}
        self.decisions: Counter[tuple[str, str, str]] = Counter()
        self.last: Decision | None = None
        self.observed: dict[str, float] = {}
        self._last_tick = time.time()
        self._task: asyncio.Task | None = None

    # -- inputs ----------------------------------------------------------------------------
    def report(self, router_id: str, window: dict) -> None:
        """One router's window of signals (a WindowSignals as a dict)."""
        try:
            w = WindowSignals.from_dict(window)
        except (TypeError, ValueError, KeyError) as e:
            log.warning("router %s sent a bad signal window: %s", router_id, e)
            return
        kept = self.windows.setdefault(str(router_id), [])
        kept.append(w)
        del kept[:-_MAX_WINDOWS]

    def pool_counts(self) -> PoolCounts:
        counts = PoolCounts(
            ready=dict.fromkeys(POOL_ROLES, 0),
            starting=dict.fromkeys(POOL_ROLES, 0),
            draining=dict.fromkeys(POOL_ROLES, 0),
        )
        pool_of = {role: pool for pool, role in POOL_ROLES.items()}
        for wid, w in self.controller.workers.items():
            pool = pool_of.get(w.get("role"))
            if pool is None:
                continue
            state = w.get("state")
            bucket = counts.ready if state == "ready" else counts.starting
            if state == "draining" or wid in self.draining:
                bucket = counts.draining
            bucket[pool] += 1
        for role, _ in self._unregistered_starts().values():
            counts.starting[pool_of[role]] += 1
        return counts

    def _unregistered_starts(self) -> dict[str, tuple[str, asyncio.Task]]:
        """Starts whose worker is not in the registry yet. A launch registers its worker and
        then awaits the controller's peer push and first poll before it leaves `starting`:
        in that window the worker is READY already, and counting it twice once made the
        planner see 3 of a 2-worker pool and cancel (kill) the worker it had just started."""
        return {w: s for w, s in self.starting.items() if w not in self.controller.workers}

    def window(self, now: float) -> WindowSignals:
        """The interval's traffic as the routers saw it; worker-side numbers from the
        registry (the controller's view is the freshest and counts every router's work)."""
        per_router = [concat_windows(ws) for ws in self.windows.values() if ws]
        self.windows = {}
        duration = max(now - self._last_tick, 1e-3)
        if per_router:
            w = merge_windows(per_router)
        else:
            w = WindowSignals(start_s=now - duration, duration_s=duration)
        workers = list(self.controller.workers.values())
        prefill = [x.get("load") or {} for x in workers if x.get("role") == PREFILL]
        decode = [x.get("load") or {} for x in workers if x.get("role") == DECODE]
        w.prefill_waiting = sum(ld.get("num_waiting", 0) for ld in prefill)
        w.decode_running = sum(ld.get("num_running", 0) for ld in decode)
        w.decode_waiting = sum(ld.get("num_waiting", 0) for ld in decode)
        w.kv_usage = max((_kv_usage(ld) for ld in decode), default=0.0)
        return w

    # -- the loop ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._last_tick = time.time()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.tick(time.time())
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one bad tick must not end autoscaling
                log.exception("planner tick failed")

    async def tick(self, now: float) -> Decision:
        window = self.window(now)
        self._last_tick = now
        pools = self.pool_counts()
        decision = self.policy.decide(now, window, pools)
        self.last, self.observed = decision, _observed(window)
        for pool in POOL_ROLES:
            current = pools.provisioned(pool)
            direction = decision.direction(pool, current)
            cause = decision.causes.get(pool, "steady")
            self.decisions[(pool, direction, cause)] += 1
            want = decision.desired.get(pool, current)
            if want != current:
                print(
                    f"tandem: planner {pool} {current} -> {want} ({cause}: "
                    f"{decision.reasons.get(pool, '')})",
                    flush=True,
                )
                self._resize(pool, current, want)
        return decision

    # -- acting ------------------------------------------------------------------------------
    def _resize(self, pool: str, current: int, want: int) -> None:
        role = POOL_ROLES[pool]
        for _ in range(want - current):
            wid = self._next_id(role)
            task = asyncio.get_running_loop().create_task(self._launch(wid, role))
            self.starting[wid] = (role, task)
        for _ in range(current - want):
            self._remove_one(role)

    def _next_id(self, role: str) -> str:
        taken = set(self.controller.workers) | set(self.starting) | set(self.draining)
        pattern = re.compile(rf"^{re.escape(role)}-(\d+)$")
        used = [int(m.group(1)) for t in taken if (m := pattern.match(t))]
        return f"{role}-{max(used, default=-1) + 1}"

    async def _launch(self, wid: str, role: str) -> None:
        t0 = time.monotonic()
        handle = None
        try:
            handle = launch_worker(self.spec, wid, role)
            info = await handle.info.remote()
            await self.controller.register(info, handle)
            print(
                f"tandem:   {wid:<10} {role:<9} started by the planner in "
                f"{time.monotonic() - t0:.1f}s  pid {info['pid']}",
                flush=True,
            )
        except asyncio.CancelledError:
            _kill(handle, wid)
            raise
        except Exception as e:  # noqa: BLE001 - no node, a bad start: the next tick decides
            log.error("planner could not start %s: %s", wid, e)
            _kill(handle, wid)
        finally:
            self.starting.pop(wid, None)

    def _remove_one(self, role: str) -> None:
        """Cancel the newest start of `role`, else drain its least loaded READY worker."""
        starting = [wid for wid, (r, _) in self._unregistered_starts().items() if r == role]
        if starting:
            wid = max(starting, key=_index)
            self.starting.pop(wid)[1].cancel()
            return
        ready = [
            (wid, w)
            for wid, w in self.controller.workers.items()
            if w.get("role") == role and w.get("state") == "ready" and wid not in self.draining
        ]
        if not ready:
            return
        wid, _ = min(ready, key=lambda item: (_busy(item[1]), -_index(item[0])))
        self.draining[wid] = asyncio.get_running_loop().create_task(self._drain(wid))

    async def _drain(self, wid: str) -> None:
        t0 = time.monotonic()
        try:
            result = await self.controller.drain(wid, SCALE_DOWN_DRAIN_S)
            print(
                f"tandem:   {wid:<10} drained by the planner in {time.monotonic() - t0:.1f}s "
                f"(idle: {result.get('idle')})",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - it is gone either way
            log.error("planner drain of %s: %s", wid, e)
        finally:
            self.draining.pop(wid, None)

    async def stop(self) -> None:
        """Stop deciding (a deployment shutting down); starts in progress are cancelled."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for _, task in list(self.starting.values()):
            task.cancel()

    # -- status ------------------------------------------------------------------------------
    def status(self) -> dict:
        pools = self.pool_counts()
        last = self.last
        desired = dict(last.desired) if last else {p: pools.provisioned(p) for p in POOL_ROLES}
        return {
            "enabled": True,
            "interval_s": self.config.interval_s,
            "desired": desired,
            "replicas": pools.ready,
            "starting": pools.starting,
            "draining": pools.draining,
            "decisions": [[p, d, c, n] for (p, d, c), n in sorted(self.decisions.items())],
            "predicted": {k: float(v) for k, v in (last.predicted if last else {}).items()},
            "observed": dict(self.observed),
            "last_reasons": dict(last.reasons) if last else {},
            "config": asdict(self.config),
        }


def _observed(w: WindowSignals) -> dict[str, float]:
    out = {
        "arrival_rate": w.arrival_rate,
        "prefill_tokens_per_s": w.uncached_prompt_tokens / w.duration_s,
        "decode_tokens_per_s": w.output_lengths.total / w.duration_s,
        "queued_prompt_tokens": float(w.queued_prompt_tokens),
        "kv_usage": w.kv_usage,
    }
    if w.ttft.count:
        out["ttft_p90_s"] = w.ttft.p90
    if w.tpot.count:
        out["tpot_p50_s"] = w.tpot.p50
    return {k: v for k, v in out.items() if math.isfinite(v)}


def _kv_usage(load: dict) -> float:
    total = load.get("num_total_blocks", 0)
    return 1.0 - load.get("num_free_blocks", 0) / total if total else 0.0


def _busy(w: dict) -> tuple[int, int]:
    load = w.get("load") or {}
    requests = load.get("num_running", 0) + load.get("num_waiting", 0)
    return requests, load.get("queued_prefill_tokens", 0)


def _index(wid: str) -> int:
    tail = wid.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _kill(handle, wid: str) -> None:
    """End a start that was cancelled or failed: the actor, and its TP group's reservation
    (which exists, pending or placed, even before the actor does)."""
    import ray

    if handle is not None:
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    remove_worker_group(wid)
