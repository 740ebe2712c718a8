"""`Deployment`: a running tandem (Ray, controller, worker pools, router) as a Python object.

Lifecycle: Ray up -> controller (named, restartable actor; its registry is rebuilt from the
named worker actors if Ray restarts it) -> N prefill + M decode actors (or K colocated
replicas), each loading the model and binding its sockets, restartable by Ray (a replacement
is a new incarnation the controller re-registers) -> registered with the controller -> router
listening -> serving. The router's tokenizer and model info are read on a thread of their own
from the start, while Ray and the workers come up (`_read_model_info_meanwhile`).

Ending it: `drain()` first (the router refuses new requests with 503 and `/ready` says so,
in-flight requests finish up to a timeout, then every worker gets idle: leases read or
released), then `stop()` (router closed, worker loops stopped, actors killed, a Ray cluster we
started shut down, no process left behind). `drain_worker()` takes one worker out of service
the same way while the rest keep serving (the planner's scale-down).

`router_only`: attach to the controller of a running deployment and add a router (several
routers can front one set of pools; a router can be restarted while the workers live).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict

from cluster.settings import ServeSettings
from cluster.worker_launch import WORKER_PREFIX, WorkerSpec, launch_worker, remove_worker_group
from engine.roles import COLOCATED, DECODE, PREFILL

log = logging.getLogger("tandem.serve")


class Deployment:
    def __init__(self, settings: ServeSettings):
        self.s = settings
        self.actors: dict[str, object] = {}
        self.controller = None
        self.router = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started_ray = False
        self._model_info: Future | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.s.host in ("0.0.0.0", "::") else self.s.host
        return f"http://{host}:{self.router.port}"

    # -- start -----------------------------------------------------------------------------
    def _quantization(self, role: str) -> str:
        """The quantization setting of a worker of `role` (EngineConfig.quantization)."""
        return self.s.prefill_quantization if role == PREFILL else self.s.decode_quantization

    def start(self) -> Deployment:
        if self.s.address:
            # Attaching: authenticate with the token (~/.ray/auth_token, or RAY_AUTH_TOKEN)
            # rather than leave it to Ray's guess, which may try without one. Read when Ray's
            # config first loads, so it is set before `import ray`.
            os.environ.setdefault("RAY_AUTH_MODE", "token")
        import ray

        from cluster.controller import CONTROLLER_NAME, Controller

        if not self.s.router_only:
            self.s.check_tp()  # a TP size the model cannot split: refused before Ray starts
        self._model_info = self._read_model_info_meanwhile()
        self._init_ray()
        t0 = time.perf_counter()
        if self.s.router_only:
            self.controller = ray.get_actor(CONTROLLER_NAME)
        else:
            spec = self.worker_spec()
            self.controller = (
                ray.remote(Controller)
                .options(
                    name=CONTROLLER_NAME,
                    num_cpus=0,
                    get_if_exists=True,
                    max_concurrency=64,
                    max_restarts=-1,
                )
                # A restarted controller is constructed with these again: the planner too.
                .remote(autoscale=self._autoscale_args(spec))
            )
            print(f"tandem: controller pid {ray.get(self.controller.pid.remote())}", flush=True)
            self._start_workers(spec)
            self._register_workers()
            if self.s.autoscale:
                ray.get(self.controller.start_autoscaler.remote())
        self._start_router()
        print(
            f"tandem: serving {self.router.config.served_model_name} on {self.url} "
            f"({time.perf_counter() - t0:.1f}s to start)",
            flush=True,
        )
        return self

    def _read_model_info_meanwhile(self) -> Future:
        """The router's tokenizer and model info, read on a thread of its own while Ray and
        the workers start: reading them (transformers' import, AutoTokenizer, AutoConfig)
        takes seconds of this process's CPU, which the start otherwise spends waiting on
        other processes. A reading error surfaces where the router starts, as before."""
        from router.server import load_model_info

        config = self.s.router_config(bind_host="127.0.0.1")  # the bind plays no part here
        future: Future = Future()

        def read() -> None:
            try:
                future.set_result(load_model_info(config))
            except BaseException as e:  # handed to the router's start below
                future.set_exception(e)

        threading.Thread(target=read, name="tandem-model-info", daemon=True).start()
        return future

    def _autoscale_args(self, spec: WorkerSpec) -> dict | None:
        """What the controller's autoscaler needs (plain dicts), or None without --autoscale."""
        if not self.s.autoscale:
            return None
        return {
            "spec": spec.to_dict(),
            "planner": asdict(self.s.planner_config()),
            "profile": self.s.capacity_profile_data().to_dict(),
            "drain_timeout_s": self.s.drain_timeout_s,
        }

    def _register_workers(self) -> None:
        import ray

        infos = ray.get([a.info.remote() for a in self.actors.values()])
        for info, actor in zip(infos, self.actors.values(), strict=True):
            ray.get(self.controller.register.remote(info, actor))
            print(
                f"tandem:   {info['worker_id']:<10} {info['role']:<9} "
                f"requests {info['request_endpoint']}  kv {info['kv_endpoint'] or '-'}  "
                f"weights {info.get('weights', '?')}  pid {info['pid']}",
                flush=True,
            )

    def _init_ray(self) -> None:
        import ray

        from cluster.controller import NAMESPACE

        # Token authentication stays on (Ray's default for new clusters); never turn it off.
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
            raise RuntimeError("RAY_AUTH_MODE=disabled: tandem keeps Ray token auth on")
        # Worker log lines (e.g. a dropped bad frame) reach the driver at once, not batched.
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        if ray.is_initialized():
            return
        kwargs = {"namespace": NAMESPACE, "logging_level": logging.WARNING}
        if self.s.address:
            ray.init(address=self.s.address, **kwargs)
        else:
            ray.init(num_cpus=self.s.num_cpus or os.cpu_count(), include_dashboard=False, **kwargs)
            self._started_ray = True
            print(f"tandem: ray {ray.get_runtime_context().gcs_address}", flush=True)

    def worker_spec(self) -> WorkerSpec:
        """How every worker of this deployment is built (the autoscaler builds more alike)."""
        import ray

        s = self.s
        resources = ray.cluster_resources()
        # Each rank's CPU share: of the largest fleet (in ranks) the deployment may grow to.
        fleet = max(sum(s.tp_size(role) for _, role in s.pools()), s.max_ranks())
        return WorkerSpec(
            engine_kwargs={"model": s.model, **s.engine},
            quantization={r: self._quantization(r) for r in (PREFILL, DECODE, COLOCATED)},
            bind_host=s.bind_host,
            use_gpu=resources.get("GPU", 0) > 0,
            cpus_per_worker=max(resources.get("CPU", 1) / fleet, 0.01),
            lease_seconds=s.lease_seconds,
            on_transfer_failure=s.on_transfer_failure,
            log_level=s.log_level,
            max_frame_bytes=s.max_frame_bytes,
            kv_read_timeout_s=s.kv_read_timeout_s,
            max_restarts=s.max_worker_restarts,
            resources={
                role: name
                for role, name in ((PREFILL, s.prefill_resource), (DECODE, s.decode_resource))
                if name
            },
            faults=s.fault_plans(),
            tp={role: s.tp_size(role) for role in (PREFILL, DECODE, COLOCATED)},
        )

    def _start_workers(self, spec: WorkerSpec) -> None:
        pools = self.s.pools()
        if self._started_ray and spec.use_gpu:
            self._check_local_gpus(spec, {role for _, role in pools})
        for wid, role in pools:
            self.actors[wid] = launch_worker(spec, wid, role)
        print(
            f"tandem: starting {len(pools)} workers ({', '.join(r for _, r in pools)})", flush=True
        )

    def _check_local_gpus(self, spec: WorkerSpec, roles: set[str]) -> None:
        """On the one-node Ray this deployment started (no autoscaler to add a node), a TP
        group needing more GPUs than the node has would wait forever: refuse it now."""
        import ray

        from cluster.settings import ServeSettings

        gpus = int(ray.cluster_resources().get("GPU", 0))
        for role in sorted(roles):
            n = spec.tp_size(role)
            if n > gpus:
                flag = ServeSettings.tp_flag(role)
                raise ValueError(f"{flag} {n} needs {n} GPUs on one node; this machine has {gpus}")

    def _start_router(self) -> None:
        from cluster.directory import ControllerDirectory
        from router.server import RouterServer

        s = self.s
        bind = s.bind_host
        if bind == "auto":
            import ray

            bind = ray.util.get_node_ip_address()
        config = s.router_config(bind)
        info = self._model_info.result() if self._model_info is not None else None
        self.router = RouterServer(config, ControllerDirectory(self.controller), info)
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self.router.start())
            except BaseException as e:  # surfaced to the caller below
                errors.append(e)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="tandem-router", daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]
        # What start-up allocated (tokenizer, model info, imports) lives as long as the
        # router: out of the collector's view, so a full collection under load scans only
        # what serving allocates (a long pause there delays every response, 429s included).
        import gc

        gc.collect()
        gc.freeze()

    # -- introspection -----------------------------------------------------------------------
    def worker_loads(self) -> dict[str, dict]:
        import ray

        return {wid: ray.get(a.load.remote()) for wid, a in self.actors.items()}

    def _on_router_loop(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- drain -----------------------------------------------------------------------------
    def drain(self, timeout_s: float | None = None) -> bool:
        """Stop admission (503 + Retry-After, `/ready` 503) and wait, up to `timeout_s` in
        all, for in-flight requests to finish and then for every worker to hold nothing (its
        leases read or released). Returns whether everything finished in time."""
        import ray

        timeout_s = self.s.drain_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        idle = True
        if self.router is not None and self._loop is not None:
            self.router.begin_drain()
            print(f"tandem: draining (up to {timeout_s:.0f}s)", flush=True)
            idle = self._on_router_loop(self.router.wait_idle(timeout_s), timeout_s + 5)
        if not self.s.router_only:
            self._adopt_planner_workers()
        if self.actors and not self.s.router_only:
            left = max(0.0, deadline - time.monotonic())
            calls = [a.drain.remote(left, 0.1) for a in self.actors.values()]
            try:
                results = ray.get(calls, timeout=left + 10)
                idle = idle and all(r["idle"] for r in results)
            except Exception as e:  # noqa: BLE001 - a dead worker holds nothing
                log.warning("worker drain: %s", e)
        return idle

    def drain_worker(self, worker_id: str, timeout_s: float = 60.0) -> dict:
        """Take one worker out of service without losing a request (see Controller.drain)."""
        import ray

        result = ray.get(self.controller.drain.remote(worker_id, timeout_s))
        self.actors.pop(worker_id, None)
        return result

    # -- stop ------------------------------------------------------------------------------
    def stop(self) -> None:
        import ray

        if self.router is not None and self._loop is not None:
            try:
                self._on_router_loop(self.router.stop(), 10)
            except Exception as e:  # shutting down anyway
                log.warning("router stop: %s", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self.s.router_only:
            self._stop_actors()
        if self._started_ray:
            ray.shutdown()

    def _adopt_planner_workers(self) -> None:
        """Add the workers the planner started (named actors) to `actors`, so that drain and
        stop reach them too; the planner is stopped first, so that it starts no more."""
        import ray

        if self.controller is None or not self.s.autoscale:
            return
        try:
            ray.get(self.controller.stop_autoscaler.remote(), timeout=10)
        except Exception as e:  # noqa: BLE001 - a dead controller starts nothing either
            log.warning("stopping the planner: %s", e)
        for entry in ray.util.list_named_actors(all_namespaces=False):
            name = entry["name"] if isinstance(entry, dict) else entry
            wid = name.removeprefix(WORKER_PREFIX)
            if name.startswith(WORKER_PREFIX) and wid not in self.actors:
                try:
                    self.actors[wid] = ray.get_actor(name)
                except ValueError:  # drained and gone meanwhile
                    pass

    def _stop_actors(self) -> None:
        import ray

        self._adopt_planner_workers()
        stops = [a.stop.remote() for a in self.actors.values()]
        try:
            ray.get(stops, timeout=15)
        except Exception as e:
            log.warning("worker stop: %s", e)
        # The controller first, so that it does not report the workers' ends as failures.
        for a in [self.controller, *self.actors.values()]:
            if a is not None:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:
                    pass
        for wid in self.actors:  # TP groups are detached: they would outlive a shared cluster
            try:
                remove_worker_group(wid)
            except Exception as e:  # noqa: BLE001 - shutting down anyway
                log.warning("placement group of %s: %s", wid, e)
        self.actors.clear()

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
