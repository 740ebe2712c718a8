"""`tandem serve`: start (or attach to) a Ray cluster, the controller, the worker pools and
the router, and serve until Ctrl-C / SIGTERM.

Lifecycle: Ray up -> controller (named actor) -> N prefill + M decode actors (or K colocated
replicas), each loading the model and binding its sockets -> registered with the controller ->
router listening -> serving -> on a signal: router stops accepting, workers stop their loops,
actors are killed, and a Ray cluster we started is shut down, leaving no process behind.
`Deployment` is the same thing as a Python object, for the demo, tests and benchmarks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from decode_worker.server import FAILURE_POLICIES
from engine.config_flags import add_flags, field_default, setting, values_from_args
from engine.llm_engine import EngineConfig
from engine.quantization import QUANTIZATIONS
from engine.quantization import validate as validate_quantization
from engine.roles import COLOCATED, DECODE, PREFILL
from router.config import RouterConfig

log = logging.getLogger("tandem.serve")
MODES = ("disagg", "colocated")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


# RouterConfig fields that `tandem serve` sets itself (from its own settings or the engine's),
# so they are not offered again in the router flag group.
_ROUTER_FIELDS_FROM_SERVE = frozenset(
    {
        "model_path",
        "served_model_name",
        "host",
        "port",
        "bind_host",
        "api_key",
        "disagg_threshold",
        "max_frame_bytes",
        "max_model_len",
        "default_block_size",
    }
)
# EngineConfig fields a deployment sets per worker, never from the command line.
_ENGINE_FIELDS_FROM_SERVE = frozenset({"model", "role", "device", "quantization"})


def _router_default(name: str):
    return field_default(RouterConfig, name)


@dataclass(slots=True)
class ServeSettings:
    """Everything `tandem serve` needs. Its flags are generated from these fields, from
    `RouterConfig`'s (group "router") and from `EngineConfig`'s (group "engine"), so every
    setting and default is written once. `engine` and `router` hold overrides of those two
    configs' fields (by name) beyond what this class sets itself.

    Quantization is per pool: `prefill_quantization` and `decode_quantization` (the decode pool
    and colocated replicas) take the names of engine/quantization/__init__.py, and `quantized`
    switches on the quantized profile (FP8 W8A8 prefill, weight-only decode, FP8 KV) for what
    is left at "auto"."""

    model: str = setting(help="local Hugging Face model directory (config.json + safetensors)")
    mode: str = setting("disagg", "prefill + decode pools, or colocated replicas", choices=MODES)
    prefill: int = setting(1, "prefill actors (disagg)")
    decode: int = setting(1, "decode actors (disagg)")
    replicas: int = setting(2, "engine replicas (colocated)")
    host: str = setting(_router_default("host"), "HTTP listen address")
    port: int = setting(_router_default("port"), "HTTP port (0: any free port)")
    address: str | None = setting(
        None, "Ray cluster to attach to ('auto' or HOST:PORT); default: start a local one"
    )
    api_key: str | None = setting(
        None,
        "require 'Authorization: Bearer KEY' on every route but /health (or set TANDEM_API_KEY)",
    )
    served_model_name: str | None = setting(None, "model name in the API (default: --model)")
    bind_host: str = setting(
        _router_default("bind_host"),
        "address internal ZMQ/NIXL sockets bind to; 'auto' = this node's IP",
    )
    prefill_resource: str | None = setting(
        None, "custom Ray resource every prefill actor requires (1 unit)"
    )
    decode_resource: str | None = setting(
        None, "custom Ray resource every decode actor requires (1 unit)"
    )
    num_cpus: int | None = setting(None, "CPUs of a local Ray cluster (default: all)")
    disagg_threshold: int = setting(
        _router_default("disagg_threshold"),
        "prompts shorter than this many tokens are prefilled on the decode worker",
    )
    lease_seconds: float = setting(30.0, "how long a prefill worker holds KV for its decode peer")
    on_transfer_failure: str = setting(
        "recompute",
        "when KV cannot be fetched: recompute the prompt on the decode worker, or fail",
        choices=FAILURE_POLICIES,
    )
    log_level: str = setting(
        "WARNING", "log level of the workers and the router", parse=str.upper, choices=LOG_LEVELS
    )
    max_frame_mb: float = setting(
        16.0, "largest ZMQ frame a worker or the router accepts; larger ones are dropped"
    )
    # Projection weights per pool (names and what each means: engine/quantization/__init__.py).
    # "auto" keeps what the checkpoint has: full weights, or an FP8 checkpoint's own.
    prefill_quantization: str = setting(
        "auto",
        "projection weights of the prefill pool: fp8 is W8A8 (FP8 weights and activations)",
        choices=QUANTIZATIONS,
    )
    decode_quantization: str = setting(
        "auto",
        "projection weights of the decode pool and colocated replicas (weight-only: FP8 on "
        "GPUs with FP8, CUDA 8.9+; int8 elsewhere)",
        choices=QUANTIZATIONS,
    )
    # The quantized profile in one switch; see `_apply_quantized_profile`.
    quantized: bool = setting(
        False,
        "quantized profile: fp8 (W8A8) prefill, weight-only decode, FP8 KV (--kv-dtype "
        "fp8_e4m3); a per-pool quantization or --kv-dtype other than auto wins",
    )
    engine: dict = setting(default_factory=dict, cli=False)  # EngineConfig overrides
    router: dict = setting(default_factory=dict, cli=False)  # RouterConfig overrides

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("prefill", "decode", "replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.on_transfer_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_transfer_failure must be one of {FAILURE_POLICIES}")
        if not self.max_frame_mb > 0:
            raise ValueError(f"max_frame_mb must be > 0, got {self.max_frame_mb}")
        self.prefill_quantization = validate_quantization(self.prefill_quantization)
        self.decode_quantization = validate_quantization(self.decode_quantization)
        for what, overrides, owned in (
            ("engine", self.engine, _ENGINE_FIELDS_FROM_SERVE),
            ("router", self.router, _ROUTER_FIELDS_FROM_SERVE),
        ):
            clash = sorted(set(overrides) & owned)
            if clash:
                raise ValueError(f"{what} overrides {clash} are set by ServeSettings itself")
        if self.quantized:
            self._apply_quantized_profile()

    def _apply_quantized_profile(self) -> None:
        """`quantized`: FP8 W8A8 prefill ("fp8": FP8 e4m3 weights with per-channel scales,
        activations scaled per token at run time, `torch._scaled_mm`), weight-only decode
        ("weight-only": FP8 weights where the GPU has FP8, int8 on CPU and older GPUs) and FP8
        KV (kv_dtype "fp8_e4m3"). It fills in only what is still at "auto" (or, for the KV,
        absent from `engine`), so a setting given explicitly wins; an explicit "auto" cannot be
        told from the default and is overridden too."""
        if self.prefill_quantization == "auto":
            self.prefill_quantization = "fp8"
        if self.decode_quantization == "auto":
            self.decode_quantization = "weight-only"
        if self.engine.get("kv_dtype", "auto") == "auto":
            self.engine = {**self.engine, "kv_dtype": "fp8_e4m3"}

    @property
    def max_frame_bytes(self) -> int:
        return int(self.max_frame_mb * 2**20)

    def pools(self) -> list[tuple[str, str]]:
        """(worker id, role) for every worker to start."""
        if self.mode == "colocated":
            return [(f"replica-{i}", COLOCATED) for i in range(self.replicas)]
        return [(f"prefill-{i}", PREFILL) for i in range(self.prefill)] + [
            (f"decode-{i}", DECODE) for i in range(self.decode)
        ]

    def router_config(self, bind_host: str) -> RouterConfig:
        """The router's settings; `bind_host` is `self.bind_host` with 'auto' resolved."""
        return RouterConfig(
            **self.router,
            model_path=self.model,
            served_model_name=self.served_model_name,
            host=self.host,
            port=self.port,
            bind_host=bind_host,
            api_key=self.api_key,
            # Colocated replicas prefill everything themselves.
            disagg_threshold=self.disagg_threshold if self.mode == "disagg" else 1 << 30,
            max_frame_bytes=self.max_frame_bytes,
            default_block_size=self.engine.get(
                "block_size", field_default(EngineConfig, "block_size")
            ),
            max_model_len=self.engine.get("max_model_len"),
        )


class Deployment:
    def __init__(self, settings: ServeSettings):
        self.s = settings
        self.actors: dict[str, object] = {}
        self.controller = None
        self.router = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started_ray = False

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.s.host in ("0.0.0.0", "::") else self.s.host
        return f"http://{host}:{self.router.port}"

    # -- start -----------------------------------------------------------------------------
    def _quantization(self, role: str) -> str:
        """The quantization setting of a worker of `role` (EngineConfig.quantization)."""
        return self.s.prefill_quantization if role == PREFILL else self.s.decode_quantization

    def start(self) -> Deployment:
        import ray

        from cluster.controller import CONTROLLER_NAME, Controller

        self._init_ray()
        t0 = time.perf_counter()
        self.controller = (
            ray.remote(Controller)
            .options(name=CONTROLLER_NAME, num_cpus=0, get_if_exists=True, max_concurrency=64)
            .remote()
        )
        self._start_workers()
        infos = ray.get([a.info.remote() for a in self.actors.values()])
        for info, actor in zip(infos, self.actors.values(), strict=True):
            ray.get(self.controller.register.remote(info, actor))
            print(
                f"tandem:   {info['worker_id']:<10} {info['role']:<9} "
                f"requests {info['request_endpoint']}  kv {info['kv_endpoint'] or '-'}  "
                f"weights {info.get('weights', '?')}",
                flush=True,
            )
        self._start_router()
        print(
            f"tandem: serving {self.s.served_model_name or self.s.model} on {self.url} "
            f"({time.perf_counter() - t0:.1f}s to start)",
            flush=True,
        )
        return self

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

    def _start_workers(self) -> None:
        import ray

        from cluster.worker_actor import WorkerActor

        s = self.s
        pools = s.pools()
        resources = ray.cluster_resources()
        use_gpu = resources.get("GPU", 0) > 0
        cpu_share = max(resources.get("CPU", 1) / len(pools), 0.01)
        engine_kwargs = {"model": s.model, **s.engine}
        for wid, role in pools:
            opts: dict = {"name": f"tandem-{wid}", "max_concurrency": 4, "max_restarts": 0}
            opts.update({"num_gpus": 1, "num_cpus": 1} if use_gpu else {"num_cpus": cpu_share})
            resource = {PREFILL: s.prefill_resource, DECODE: s.decode_resource}.get(role)
            if resource:
                opts["resources"] = {resource: 1}
            self.actors[wid] = (
                ray.remote(WorkerActor)
                .options(**opts)
                .remote(
                    wid,
                    role,
                    {**engine_kwargs, "quantization": self._quantization(role)},
                    s.bind_host,
                    max(1, int(cpu_share)),
                    s.lease_seconds,
                    s.on_transfer_failure,
                    s.log_level,
                    s.max_frame_bytes,
                )
            )
        print(
            f"tandem: starting {len(pools)} workers ({', '.join(r for _, r in pools)})", flush=True
        )

    def _start_router(self) -> None:
        from cluster.directory import ControllerDirectory
        from router.server import RouterServer

        s = self.s
        bind = s.bind_host
        if bind == "auto":
            import ray

            bind = ray.util.get_node_ip_address()
        config = s.router_config(bind)
        self.router = RouterServer(config, ControllerDirectory(self.controller))
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

    # -- introspection -----------------------------------------------------------------------
    def worker_loads(self) -> dict[str, dict]:
        import ray

        return {wid: ray.get(a.load.remote()) for wid, a in self.actors.items()}

    # -- stop ------------------------------------------------------------------------------
    def stop(self) -> None:
        import ray

        if self.router is not None and self._loop is not None:
            fut = asyncio.run_coroutine_threadsafe(self.router.stop(), self._loop)
            try:
                fut.result(timeout=10)
            except Exception as e:  # shutting down anyway
                log.warning("router stop: %s", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        stops = [a.stop.remote() for a in self.actors.values()]
        try:
            ray.get(stops, timeout=15)
        except Exception as e:
            log.warning("worker stop: %s", e)
        for a in [*self.actors.values(), self.controller]:
            if a is not None:
                try:
                    ray.kill(a)
                except Exception:
                    pass
        self.actors.clear()
        if self._started_ray:
            ray.shutdown()

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, ServeSettings)
    add_flags(p, RouterConfig, title="router", exclude=_ROUTER_FIELDS_FROM_SERVE)
    add_flags(p, EngineConfig, title="engine", exclude=_ENGINE_FIELDS_FROM_SERVE)
    p.add_argument("--ready-file", default=None, help="write {url, pid} as JSON here when serving")


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    values = values_from_args(ServeSettings, args)
    values["api_key"] = values["api_key"] or os.environ.get("TANDEM_API_KEY") or None
    return ServeSettings(
        **values,
        engine=values_from_args(EngineConfig, args, exclude=_ENGINE_FIELDS_FROM_SERVE),
        router=values_from_args(RouterConfig, args, exclude=_ROUTER_FIELDS_FROM_SERVE),
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    try:
        settings = settings_from_args(args)
    except ValueError as e:
        print(f"tandem serve: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    dep = Deployment(settings)
    try:
        dep.start()
        # Installed after ray.init, which sets handlers of its own that would abort us.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        if args.ready_file:
            with open(args.ready_file, "w") as f:
                json.dump({"url": dep.url, "pid": os.getpid()}, f)
        while not stop.wait(0.5):
            pass
        print("tandem: shutting down", flush=True)
    finally:
        dep.stop()
    print("tandem: stopped", flush=True)
    return 0
