"""The controller: a named Ray actor holding the registry of workers.

Registry entry lifecycle (one per worker id):

    register(info, handle)            READY (routers route to it)
      watch call fails (process died)   DOWN at once: routers fail its requests and stop
      load poll fails or times out      routing to it (a hung worker: after health_timeout_s)
      answers again, same incarnation   READY (it was only slow)
      answers with a new incarnation    READY again as the replacement: endpoints and KV
                                        metadata re-read (`info()`), restarts counted, and
                                        every KV worker told the new allowed peer set
    drain(worker_id)                  DRAINING (routers stop sending it new requests; what
                                        it holds finishes), then removed and killed

Liveness has two signals. Each worker has a `watch` call outstanding at all times: it returns
every few seconds while the process lives and fails as soon as Ray sees the process die, so a
killed worker is DOWN within about a second, not after a timeout. A hung process (SIGSTOP, a
stuck driver) keeps its call open, so the load poll every `health_interval_s` with a
`health_timeout_s` limit catches it (each worker is polled in its own loop). Ray restarts a
dead worker actor (`max_restarts`), whose constructor builds a new engine, new sockets and a
new KV agent: a new incarnation.

The registry lives in memory. A restarted controller (it is a restartable actor too) rebuilds
it before answering anything, from the named worker actors in its namespace.

Only peers in the registry may exchange KV: after any change of a KV worker's incarnation the
controller sends every KV worker the map name -> current KV agent instance
(`WorkerActor.set_peers`), and a handshake or hand-off naming anything else is refused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import ray

from cluster.worker_launch import WORKER_PREFIX, remove_worker_group

log = logging.getLogger(__name__)
CONTROLLER_NAME = "tandem-controller"
NAMESPACE = "tandem"
READY, DOWN, DRAINING = "ready", "down", "draining"
_WATCH_S = 5.0  # a watch call returns this often while the worker lives


class Controller:
    def __init__(
        self,
        health_interval_s: float = 0.25,
        health_timeout_s: float = 5.0,
        autoscale: dict | None = None,
    ):
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        # `tandem serve --autoscale`: the planner's settings (cluster/autoscaler.py). Ray
        # constructs a restarted controller with them again, so its planner comes back too.
        self._autoscale_args = autoscale
        self.autoscaler = None
        self.workers: dict[str, dict] = {}
        self._tasks: dict[str, list[asyncio.Task]] = {}  # per worker: watch, polls
        self._recovered: asyncio.Task | None = None
        self.num_restarts = 0

    async def pid(self) -> int:
        """This process's id (fault tests kill it); also rebuilds the registry first."""
        await self._ready()
        return os.getpid()

    # -- registry ----------------------------------------------------------------------------
    async def register(self, info: dict, handle) -> None:
        await self._ready()
        self._add(info, handle)
        await self._push_peers()
        await self._poll_one(info["worker_id"])

    def _add(self, info: dict, handle) -> None:
        wid = info["worker_id"]
        self.workers[wid] = {
            **info,
            "handle": handle,
            "load": None,
            "state": READY,
            "restarts": 0,
            "last_seen": time.time(),
        }
        for task in self._tasks.pop(wid, ()):
            task.cancel()
        loop = asyncio.get_running_loop()
        self._tasks[wid] = [loop.create_task(self._watch(wid)), loop.create_task(self._polls(wid))]

    async def deregister(self, worker_id: str) -> None:
        await self._ready()
        self._forget(worker_id)
        await self._push_peers()

    def _forget(self, worker_id: str) -> dict | None:
        for task in self._tasks.pop(worker_id, ()):
            task.cancel()
        return self.workers.pop(worker_id, None)

    @ray.method(enable_task_events=False)  # every router asks twice a second
    async def snapshot(self) -> list[dict]:
        """Every worker the routers should know: READY and DRAINING ones with a load report,
        and DOWN ones (so that routers fail their requests at once)."""
        await self._ready()
        return [
            _public(w) for w in self.workers.values() if w["state"] == DOWN or w["load"] is not None
        ]

    async def all_workers(self) -> list[dict]:
        await self._ready()
        return [_public(w) for w in self.workers.values()]

    # -- drain -------------------------------------------------------------------------------
    async def drain(self, worker_id: str, timeout_s: float = 60.0, settle_s: float = 1.5) -> dict:
        """Take a worker out of service without losing a request: routers stop sending it new
        ones (DRAINING in the next snapshot), it finishes or hands off what it holds (leases
        included) up to `timeout_s`, then it is removed and its actor killed for good.
        `settle_s` is how long it must stay idle (longer than a router's snapshot period, so
        a request routed just before the router saw DRAINING is still served)."""
        await self._ready()
        w = self.workers.get(worker_id)
        if w is None:
            raise KeyError(f"no worker {worker_id!r}")
        w["state"] = DRAINING
        log.warning("draining worker %s", worker_id)
        try:
            result = await w["handle"].drain.remote(timeout_s, settle_s)
        except Exception as e:  # noqa: BLE001 - it died while draining: removed all the same
            result = {"idle": False, "error": str(e)}
        self._forget(worker_id)
        await self._push_peers()
        ray.kill(w["handle"], no_restart=True)
        remove_worker_group(worker_id)  # a TP group's node resources are free again
        return {"worker_id": worker_id, **result}

    # -- autoscaling -------------------------------------------------------------------------
    async def start_autoscaler(self) -> bool:
        """Start the planner loop (once the launch-time workers are registered)."""
        await self._ready()
        self._start_autoscaler()
        return self.autoscaler is not None

    def _start_autoscaler(self) -> None:
        if self._autoscale_args is None or self.autoscaler is not None:
            return
        from cluster.autoscaler import Autoscaler

        self.autoscaler = Autoscaler(self, self._autoscale_args)
        self.autoscaler.start()

    @ray.method(enable_task_events=False)  # every router, every few seconds
    async def report_signals(self, router_id: str, window: dict) -> None:
        """A router's window of traffic signals, for the planner (dropped when it is off)."""
        if self.autoscaler is not None:
            self.autoscaler.report(router_id, window)

    @ray.method(enable_task_events=False)
    async def planner_status(self) -> dict:
        """What routers export as tandem_planner_* metrics."""
        await self._ready()
        return self.autoscaler.status() if self.autoscaler else {"enabled": False}

    async def stop_autoscaler(self) -> None:
        if self.autoscaler is not None:
            await self.autoscaler.stop()

    # -- liveness ----------------------------------------------------------------------------
    async def _watch(self, worker_id: str) -> None:
        """Keep one `watch` call outstanding: its failure is the fast death signal, and its
        return after a restart the fast recovery signal."""
        while worker_id in self.workers:
            w = self.workers[worker_id]
            t0 = time.monotonic()
            try:
                incarnation = await w["handle"].watch.remote(_WATCH_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - RayActorError and kin: the process died
                self._mark_down(worker_id, f"its process died ({type(e).__name__})")
                await asyncio.sleep(0.2)
                continue
            if incarnation != w.get("incarnation"):
                await self._reregister(worker_id)
            elif time.monotonic() - t0 < _WATCH_S / 2:
                await asyncio.sleep(1.0)  # a stopped worker answers at once: do not spin

    async def _poll_one(self, worker_id: str) -> None:
        w = self.workers.get(worker_id)
        if w is None:
            return
        try:
            load = await asyncio.wait_for(w["handle"].load.remote(), self.health_timeout_s)
        except Exception as e:  # died, hung past the timeout, or raised
            self._mark_down(worker_id, f"its health check failed ({type(e).__name__}: {e})")
            return
        if load.get("incarnation") != w.get("incarnation"):
            await self._reregister(worker_id)
            return
        w.update(load=load, last_seen=time.time())
        if w["state"] == DOWN:
            log.warning("worker %s answers again", worker_id)
            w["state"] = READY

    def _mark_down(self, worker_id: str, why: str) -> None:
        w = self.workers.get(worker_id)
        if w is not None and w["state"] != DOWN:
            log.error("worker %s is down: %s", worker_id, why)
            w["state"] = DOWN
            w["down_since"] = time.time()

    async def _reregister(self, worker_id: str) -> None:
        """The worker answered as a new incarnation (Ray restarted its actor): read its new
        endpoints and KV metadata, then let peers know before routers see it READY."""
        w = self.workers.get(worker_id)
        if w is None:
            return
        try:
            info = await asyncio.wait_for(w["handle"].info.remote(), self.health_timeout_s)
            load = await asyncio.wait_for(w["handle"].load.remote(), self.health_timeout_s)
        except Exception as e:  # noqa: BLE001 - not up yet: the next round tries again
            self._mark_down(worker_id, f"its restart is not complete ({type(e).__name__})")
            return
        if info.get("incarnation") == w.get("incarnation"):
            return
        down_for = time.time() - w.get("down_since", time.time())
        log.warning(
            "worker %s restarted: incarnation %s -> %s (down %.1fs) pid %s",
            worker_id,
            w.get("incarnation"),
            info.get("incarnation"),
            down_for,
            info.get("pid"),
        )
        state = DRAINING if w["state"] == DRAINING else READY
        w.update(info, load=None, last_seen=time.time())
        w["restarts"] += 1
        self.num_restarts += 1
        await self._push_peers()
        w.update(load=load, state=state)

    async def _polls(self, worker_id: str) -> None:
        """One worker's load polls (its own loop: a hung worker never delays the others')."""
        while worker_id in self.workers:
            await asyncio.sleep(self.health_interval_s)
            await self._poll_one(worker_id)

    # -- KV peers ----------------------------------------------------------------------------
    def allowed_peers(self) -> dict[str, str]:
        """KV agent name -> the instance id of its current incarnation."""
        return {
            w["kv_name"]: w["kv_instance_id"]
            for w in self.workers.values()
            if w.get("kv_name") and w.get("kv_instance_id")
        }

    async def _push_peers(self) -> None:
        peers = self.allowed_peers()
        calls = [
            w["handle"].set_peers.remote(peers)
            for w in self.workers.values()
            if w.get("kv_name") and w["state"] != DOWN
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, Exception):
                log.warning("could not send the KV peer set to a worker: %s", r)

    # -- restart recovery --------------------------------------------------------------------
    async def _ready(self) -> None:
        """On the first call of this incarnation, rebuild the registry from the named worker
        actors (empty on a fresh start; the workers of a cluster after a controller restart)."""
        if self._recovered is None:
            self._recovered = asyncio.get_running_loop().create_task(self._recover())
        await asyncio.shield(self._recovered)

    async def _recover(self) -> None:
        names = [
            n["name"] if isinstance(n, dict) else n
            for n in ray.util.list_named_actors(all_namespaces=False)
        ]
        found = await asyncio.gather(
            *(self._find(n) for n in sorted(names) if n.startswith(WORKER_PREFIX))
        )
        for info, handle in (f for f in found if f is not None):
            self._add(info, handle)
        if self.workers:
            log.warning("controller recovered %d workers from the cluster", len(self.workers))
            await self._push_peers()
            await asyncio.gather(*(self._poll_one(wid) for wid in list(self.workers)))
            self._start_autoscaler()  # a restart: the deployment will not ask again

    async def _find(self, name: str) -> tuple[dict, object] | None:
        try:
            handle = ray.get_actor(name)
            info = await asyncio.wait_for(handle.info.remote(), self.health_timeout_s)
        except Exception as e:  # noqa: BLE001 - gone or not up: it registers when it is
            log.warning("controller recovery: %s did not answer: %s", name, e)
            return None
        return info, handle


def _public(w: dict) -> dict:
    return {k: v for k, v in w.items() if k != "handle"}
