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
from dataclasses import dataclass, field

log = logging.getLogger("tandem.serve")


@dataclass(slots=True)
class ServeSettings:
    model: str
    mode: str = "disagg"
    prefill: int = 1
    decode: int = 1
    replicas: int = 2
    host: str = "127.0.0.1"
    port: int = 8000
    address: str | None = None  # None: start a local Ray cluster
    api_key: str | None = None
    served_model_name: str | None = None
    bind_host: str = "127.0.0.1"
    prefill_resource: str | None = None
    decode_resource: str | None = None
    num_cpus: int | None = None
    disagg_threshold: int = 256
    lease_seconds: float = 30.0
    on_transfer_failure: str = "recompute"
    log_level: str = "WARNING"
    max_frame_bytes: int = 16 << 20
    # Weight-only quantization of the workers that decode (decode pool, colocated replicas);
    # the prefill pool keeps full weights (it is compute-bound, not weight-bandwidth-bound).
    decode_quantization: str = "none"
    engine: dict = field(default_factory=dict)  # EngineConfig fields except model/role

    def __post_init__(self) -> None:
        if self.mode not in ("disagg", "colocated"):
            raise ValueError(f"mode must be disagg or colocated, got {self.mode!r}")
        for name in ("prefill", "decode", "replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        from engine.quantization import validate

        self.decode_quantization = validate(self.decode_quantization)

    def pools(self) -> list[tuple[str, str]]:
        """(worker id, role) for every worker to start."""
        if self.mode == "colocated":
            return [(f"replica-{i}", "colocated") for i in range(self.replicas)]
        return [(f"prefill-{i}", "prefill") for i in range(self.prefill)] + [
            (f"decode-{i}", "decode") for i in range(self.decode)
        ]


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
        return "none" if role == "prefill" else self.s.decode_quantization

    def start(self) -> Deployment:
        import ray

        from cluster.controller import CONTROLLER_NAME, NAMESPACE, Controller
        from cluster.worker_actor import WorkerActor

        s = self.s
        # Token authentication stays on (Ray's default for new clusters); never turn it off.
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
            raise RuntimeError("RAY_AUTH_MODE=disabled: tandem keeps Ray token auth on")
        # Worker log lines (e.g. a dropped bad frame) reach the driver at once, not batched.
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        if not ray.is_initialized():
            kwargs = {"namespace": NAMESPACE, "logging_level": logging.WARNING}
            if s.address:
                ray.init(address=s.address, **kwargs)
            else:
                ray.init(num_cpus=s.num_cpus or os.cpu_count(), include_dashboard=False, **kwargs)
                self._started_ray = True
        t0 = time.perf_counter()
        self.controller = (
            ray.remote(Controller)
            .options(name=CONTROLLER_NAME, num_cpus=0, get_if_exists=True, max_concurrency=64)
            .remote()
        )
        pools = s.pools()
        total_cpus = ray.cluster_resources().get("CPU", 1)
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        cpu_share = max(total_cpus / len(pools), 0.01)
        engine_kwargs = {"model": s.model, **s.engine}
        for wid, role in pools:
            opts: dict = {"name": f"tandem-{wid}", "max_concurrency": 4, "max_restarts": 0}
            if use_gpu:
                opts.update(num_gpus=1, num_cpus=1)
            else:
                opts.update(num_cpus=cpu_share)
            resource = {"prefill": s.prefill_resource, "decode": s.decode_resource}.get(role)
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
            f"tandem: serving {s.served_model_name or s.model} on {self.url} "
            f"({time.perf_counter() - t0:.1f}s to start)",
            flush=True,
        )
        return self

    def _start_router(self) -> None:
        from cluster.directory import ControllerDirectory
        from router.config import RouterConfig
        from router.server import RouterServer

        s = self.s
        bind = s.bind_host
        if bind == "auto":
            import ray

            bind = ray.util.get_node_ip_address()
        config = RouterConfig(
            max_frame_bytes=s.max_frame_bytes,
            model_path=s.model,
            served_model_name=s.served_model_name,
            host=s.host,
            port=s.port,
            bind_host=bind,
            api_key=s.api_key,
            disagg_threshold=s.disagg_threshold if s.mode == "disagg" else 1 << 30,
            default_block_size=s.engine.get("block_size", 16),
            max_model_len=s.engine.get("max_model_len"),
        )
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
    p.add_argument("--model", required=True, help="local HF model directory")
    p.add_argument("--mode", choices=["disagg", "colocated"], default="disagg")
    p.add_argument("--prefill", type=int, default=1, help="prefill actors (disagg)")
    p.add_argument("--decode", type=int, default=1, help="decode actors (disagg)")
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (colocated)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster to attach to ('auto' or HOST:PORT); default: start one",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (or set TANDEM_API_KEY)",
    )
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--bind-host",
        default="127.0.0.1",
        help="address internal ZMQ/NIXL sockets bind to; 'auto' = this node's IP",
    )
    p.add_argument(
        "--prefill-resource",
        default=None,
        help="custom Ray resource every prefill actor requires (1 unit)",
    )
    p.add_argument(
        "--decode-resource",
        default=None,
        help="custom Ray resource every decode actor requires (1 unit)",
    )
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray cluster")
    p.add_argument(
        "--disagg-threshold",
        type=int,
        default=256,
        help="prompts shorter than this many tokens are prefilled on the decode worker",
    )
    p.add_argument("--lease-seconds", type=float, default=30.0)
    p.add_argument("--on-transfer-failure", choices=["recompute", "error"], default="recompute")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-dtype", choices=["auto", "fp8_e4m3"], default="auto")
    p.add_argument(
        "--decode-quantization",
        choices=["none", "int8"],
        default="none",
        help="weight-only quantization of the decode pool (and colocated replicas)",
    )
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-frame-mb",
        type=float,
        default=16.0,
        help="largest ZMQ frame a worker accepts; larger ones are logged and dropped",
    )
    p.add_argument("--ready-file", default=None, help="write {url} as JSON here when serving")
    p.add_argument("--log-level", default="WARNING")


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    engine = {
        "dtype": args.dtype,
        "kv_dtype": args.kv_dtype,
        "load_format": args.load_format,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "enable_chunked_prefill": not args.no_chunked_prefill,
        "enable_prefix_caching": not args.no_prefix_caching,
        "attention_backend": args.attention_backend,
        "seed": args.seed,
    }
    return ServeSettings(
        model=args.model,
        mode=args.mode,
        prefill=args.prefill,
        decode=args.decode,
        replicas=args.replicas,
        host=args.host,
        port=args.port,
        address=args.address,
        api_key=args.api_key or os.environ.get("TANDEM_API_KEY") or None,
        served_model_name=args.served_model_name,
        bind_host=args.bind_host,
        prefill_resource=args.prefill_resource,
        decode_resource=args.decode_resource,
        num_cpus=args.num_cpus,
        disagg_threshold=args.disagg_threshold,
        lease_seconds=args.lease_seconds,
        on_transfer_failure=args.on_transfer_failure,
        log_level=args.log_level,
        max_frame_bytes=int(args.max_frame_mb * 2**20),
        decode_quantization=args.decode_quantization,
        engine=engine,
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
