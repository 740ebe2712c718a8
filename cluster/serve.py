"""`tandem serve`: start (or attach to) a Ray cluster, the controller, the worker pools and
the router, and serve until Ctrl-C / SIGTERM.

The settings are `cluster.settings.ServeSettings` (one flag per field, plus the router's and
the engine's); the running system is `cluster.deployment.Deployment`. On the first SIGTERM or
SIGINT it drains (no new requests: 503 with Retry-After and `/ready` 503; in-flight requests
finish, up to --drain-timeout-s; leases are read or released), then stops everything and
exits 0. A second signal skips the rest of the drain.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

from cluster.deployment import Deployment
from cluster.planner.config import PlannerConfig
from cluster.settings import (
    ENGINE_FIELDS_FROM_SERVE,
    PLANNER_FIELDS_FROM_SERVE,
    ROUTER_FIELDS_FROM_SERVE,
    ServeSettings,
)
from engine.config_flags import add_flags, values_from_args
from engine.llm_engine import EngineConfig
from router.config import RouterConfig

__all__ = ["Deployment", "ServeSettings", "add_arguments", "run", "settings_from_args"]


def write_ready_file(path: str, payload: dict) -> None:
    """Write `payload` as JSON so that a reader polling for the file never sees it empty or
    half-written: a temporary file beside it, renamed into place (atomic on POSIX). A reader
    that saw the file appear and read it at once got '' (seen as a JSONDecodeError in a test)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, ServeSettings)
    add_flags(p, RouterConfig, title="router", exclude=ROUTER_FIELDS_FROM_SERVE)
    add_flags(p, EngineConfig, title="engine", exclude=ENGINE_FIELDS_FROM_SERVE)
    add_flags(p, PlannerConfig, title="planner (--autoscale)", exclude=PLANNER_FIELDS_FROM_SERVE)
    p.add_argument("--ready-file", default=None, help="write {url, pid} as JSON here when serving")


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    values = values_from_args(ServeSettings, args)
    values["api_key"] = values["api_key"] or os.environ.get("TANDEM_API_KEY") or None
    return ServeSettings(
        **values,
        engine=values_from_args(EngineConfig, args, exclude=ENGINE_FIELDS_FROM_SERVE),
        router=values_from_args(RouterConfig, args, exclude=ROUTER_FIELDS_FROM_SERVE),
        planner=values_from_args(PlannerConfig, args, exclude=PLANNER_FIELDS_FROM_SERVE),
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    try:
        settings = settings_from_args(args)
    except ValueError as e:
        print(f"tandem serve: {e}", file=sys.stderr)
        return 2
    signals = threading.Semaphore(0)
    dep = Deployment(settings)
    try:
        dep.start()
        # Installed after ray.init, which sets handlers of its own that would abort us.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: signals.release())
        if args.ready_file:
            write_ready_file(args.ready_file, {"url": dep.url, "pid": os.getpid()})
        while not signals.acquire(timeout=0.5):
            pass
        _drain(dep, signals)
        print("tandem: shutting down", flush=True)
    finally:
        dep.stop()
    print("tandem: stopped", flush=True)
    return 0


def _drain(dep: Deployment, signals: threading.Semaphore) -> None:
    """Drain in a helper thread, so that a second signal can cut it short."""
    result: list[bool] = []
    drainer = threading.Thread(target=lambda: result.append(dep.drain()), daemon=True)
    drainer.start()
    while drainer.is_alive():
        if signals.acquire(timeout=0.2):
            print("tandem: second signal: stopping now", flush=True)
            return
    if result and not result[0]:
        print("tandem: drain timed out; stopping with requests in flight", flush=True)
    elif result:
        print("tandem: drained", flush=True)
