"""The `tandem serve` under test and the processes it runs, for the soak and overload benchmarks.

`ServeSession.start` runs `tandem serve` as a subprocess in a new session
(`bench.live_server.LiveServer`: every process it starts, Ray's GCS, raylet and actor workers
included, shares one session id);
`ServeSession.attach` finds the session of the process listening on a URL's port. Either way
`.processes()` lists the session's live processes, `.metrics()` / `.kv_blocks()` read the
router's /metrics, and `.stop()` (only for a started one) sends SIGTERM and reports the exit
code and any process left behind.

`Sampler` records RSS and open fds of every process of the session: a timeline every
`interval_s` on a thread (for the plot) and named snapshots ("start", "warm", "end");
`growth()` compares "warm" with "end" per process and summed.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.live_server import LiveServer, kv_block_counts, parse_metrics

MB = 1024 * 1024
# A process's open fds count as grown only past `max_pct` *and* this many: Ray's own agents
# (the dashboard agent, the raylet) hold a few short-lived sockets at any moment, so 50 -> 53
# is a sample taken mid-connection, while a leak of one fd per request is hundreds in any run.
FD_NOISE = 8


# --------------------------------------------------------------------------- the server


@dataclass(slots=True)
class ServeSession:
    """A `tandem serve` this script started (`server` set) or one it attached to (`server`
    None). `session_id` is the session every process of it shares (Ray's GCS, raylet,
    actors...)."""

    url: str
    session_id: int
    server: LiveServer | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must be http(s)://host:port, got {self.url!r}")

    @property
    def log_path(self) -> Path | None:
        return None if self.server is None else self.server.log_path

    @classmethod
    def start(cls, model: Path, workdir: Path, flags: list[str], timeout: float = 300.0):
        server = LiveServer(model, workdir, *flags).start(timeout)
        assert server.proc is not None
        return cls(server.url, server.proc.pid, server)

    @classmethod
    def attach(cls, url: str) -> ServeSession:
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
                return cls(url.rstrip("/"), os.getsid(conn.pid))
        raise RuntimeError(f"no process of this user listens on port {port} ({url})")

    def processes(self) -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getsid(p.pid) == self.session_id:
                    out.append(p)
            except (ProcessLookupError, PermissionError):
                continue
        return out

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode())

    def kv_blocks(self) -> dict[str, dict[str, float]]:
        """worker -> {free, total} from /metrics."""
        counts = kv_block_counts(self.metrics())
        return {w: {"free": free, "total": total} for w, (free, total) in counts.items()}

    def wait_kv_free(self, timeout: float) -> dict[str, dict[str, float]]:
        """Poll until free == total on every worker (load reports lag a beat) or timeout."""
        deadline = time.time() + timeout
        while True:
            blocks = self.kv_blocks()
            if blocks and all(b.get("free") == b.get("total") for b in blocks.values()):
                return blocks
            if time.time() > deadline:
                return blocks
            time.sleep(0.5)

    def stop(self) -> dict[str, Any]:
        """SIGTERM and wait; the exit code and any process the session left behind."""
        if self.server is None:
            return {"exit_code": None, "leftovers": []}
        code = self.server.stop()
        deadline, left = time.time() + 20, []
        while time.time() < deadline:
            left = [f"{p.pid} {_cmdline(p)[:120]}" for p in self.processes()]
            if not left:
                break
            time.sleep(0.5)
        return {"exit_code": code, "leftovers": left}


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()) or p.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"


# --------------------------------------------------------------------------- process samples

# Ray's helper processes, named by what their command line runs.
_RAY_PARTS = (
    ("gcs_server", "ray gcs_server"),
    ("raylet", "ray raylet"),
    ("dashboard.py", "ray dashboard"),
    ("log_monitor.py", "ray log_monitor"),  # before monitor.py, which it contains
    ("monitor.py", "ray monitor"),
)


def process_label(cmdline: str, pid: int, leader: int) -> str:
    if pid == leader:
        return "tandem serve (driver + router)"
    if cmdline.startswith("ray::"):
        # Ray retitles an actor's process with the method it runs ("ray::Name.step"): keep
        # the actor part, so one process keeps one name.
        return cmdline.split()[0].split(".")[0]
    for part, name in _RAY_PARTS:
        if part in cmdline:
            return name
    return cmdline.split("/")[-1][:40]


def sample_processes(session: ServeSession) -> dict[int, dict[str, Any]]:
    """pid -> {name, rss (bytes), fds} of every live process of the session."""
    out = {}
    for p in session.processes():
        try:
            with p.oneshot():
                out[p.pid] = {
                    "name": process_label(_cmdline(p), p.pid, session.session_id),
                    "rss": p.memory_info().rss,
                    "fds": p.num_fds(),
                }
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


@dataclass(slots=True)
class Sampler:
    """Samples the session's processes every `interval_s` on a thread (the plot's data) and
    keeps named snapshots ("start", "warm", "end") for the growth checks."""

    session: ServeSession
    interval_s: float
    t0: float = field(default_factory=time.monotonic)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    snapshots: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    marks: dict[str, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")

    def snapshot(self, name: str) -> dict[int, dict[str, Any]]:
        snap = sample_processes(self.session)
        self.snapshots[name] = snap
        self.marks[name] = time.monotonic() - self.t0
        self._record(snap)
        return snap

    def _record(self, snap: dict[int, dict[str, Any]]) -> None:
        procs = {str(pid): [s["rss"], s["fds"]] for pid, s in snap.items()}
        self.timeline.append({"t": round(time.monotonic() - self.t0, 2), "procs": procs})

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._record(sample_processes(self.session))

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def growth(snapshots: dict[str, dict[int, dict[str, Any]]], max_pct: float) -> dict[str, Any]:
    """Per-process and summed RSS/fd growth from "warm" to "end" (processes alive at both),
    the processes over `max_pct`, and those that appeared or went away after warm-up."""
    start, warm, end = snapshots["start"], snapshots["warm"], snapshots["end"]
    rows, over = [], []
    for pid in sorted(set(warm) & set(end)):
        row: dict[str, Any] = {"pid": pid, "name": end[pid]["name"]}
        for metric in ("rss", "fds"):
            w, e = warm[pid][metric], end[pid][metric]
            row[metric] = {"start": start.get(pid, {}).get(metric), "warm": w, "end": e}
            row[f"{metric}_growth_pct"] = round(100.0 * (e - w) / w, 2) if w else 0.0
            noise = FD_NOISE if metric == "fds" else 0
            if row[f"{metric}_growth_pct"] >= max_pct and e - w > noise:
                over.append({"pid": pid, "name": row["name"], "metric": metric, "warm": w})
                over[-1] |= {"end": e, "growth_pct": row[f"{metric}_growth_pct"]}
        rows.append(row)
    totals = {}
    for metric in ("rss", "fds"):
        w = sum(r[metric]["warm"] for r in rows)
        e = sum(r[metric]["end"] for r in rows)
        s = sum(start[p][metric] for p in start)
        pct = round(100.0 * (e - w) / w, 2) if w else 0.0
        totals[metric] = {"start": s, "warm": w, "end": e, "growth_pct": pct}
    appeared = [{"pid": p} | end[p] for p in sorted(set(end) - set(warm))]
    gone = [{"pid": p} | warm[p] for p in sorted(set(warm) - set(end))]
    return {"processes": rows, "totals": totals, "over": over, "appeared": appeared, "gone": gone}


def idle_growth(
    snapshots: dict[str, dict[int, dict[str, Any]]], marks: dict[str, float]
) -> dict[int, float]:
    """pid -> the RSS growth % a process showed with no requests ("idle0" -> "idle1"), scaled
    to the length of "warm" -> "end": what time alone (Ray's own periodic work) adds."""
    idle0, idle1 = snapshots["idle0"], snapshots["idle1"]
    scale = (marks["end"] - marks["warm"]) / (marks["idle1"] - marks["idle0"])
    return {
        pid: round(100.0 * scale * (idle1[pid]["rss"] - s["rss"]) / s["rss"], 2)
        for pid, s in idle0.items()
        if pid in idle1 and s["rss"]
    }
