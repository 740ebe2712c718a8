"""An engine behind ZMQ sockets, composed with a KV connector: the one loop every worker runs
(no Ray, no NIXL here).

Lifecycle of one request: a `GenerateRequest` frame arrives on the PULL socket -> validated and
added to the engine (a bad one is answered with an "error" TokenMessage at once) -> each engine
step's new tokens go out as `TokenMessage`s to the request's `reply_to` PUSH socket -> the last
one carries `finish_reason` and the request is forgotten. `AbortRequest` drops it wherever it
is, and so does the connection to its router dropping (the router died or restarted). Frames
that are not valid msgpack, too large, or of an unknown type are logged and dropped; the loop
keeps serving.

The role's KV hand-off is the connector's (`WorkerConnector`, below; the prefill and decode
ones live in kv_transfer/): each frame is offered to it first, it runs before and after each
engine step, it is asked first about an abort (it may own the request's blocks), and it adds
its counters to the load report. A colocated worker runs with `NoConnector`. One iteration:

    receive frames (connector.handle first) -> connector.before_step -> engine.step ->
    publish tokens -> connector.after_step -> every 50 ms: load report, dropped routers
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.distributed import TPError
from engine.kv_cache import DEVICE_TIER, HOST_TIER
from engine.kv_events import KVEventPublisher
from engine.llm_engine import LLMEngine
from engine.outputs import TokenOutput
from engine.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    AbortRequest,
    GenerateRequest,
    Shutdown,
    TokenMessage,
    WireError,
    WorkerLoad,
    decode,
    encode,
)

log = logging.getLogger(__name__)


class ReplySockets:
    """One PUSH socket per destination endpoint, created on first use, each with a monitor
    that reports the peer's connection dropping (a router that died or restarted)."""

    def __init__(self, ctx: zmq.Context):
        self.ctx = ctx
        self._socks: dict[str, zmq.Socket] = {}
        self._monitors: dict[str, zmq.Socket] = {}

    def send(self, endpoint: str, msg) -> None:
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            self._monitors[endpoint] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(endpoint)
            self._socks[endpoint] = sock
        sock.send(encode(msg))

    def take_disconnected(self) -> list[str]:
        """Endpoints whose connection dropped since the last call (non-blocking)."""
        gone = []
        for endpoint, mon in self._monitors.items():
            while mon.poll(0):
                event = recv_monitor_message(mon)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    gone.append(endpoint)
        return gone

    def close(self) -> None:
        for endpoint, s in self._socks.items():
            s.disable_monitor()
            self._monitors[endpoint].close(linger=0)
            s.close(linger=200)
        self._socks.clear()
        self._monitors.clear()


class ConnectorHost(Protocol):
    """What a connector may ask of the loop it is composed with (`EngineServer` is one)."""

    worker_id: str
    engine: LLMEngine
    endpoint: str  # this worker's request socket (peers answer a PrefixPull there)

    def stream(self, request_id: str, reply_to: str, num_choices: int) -> None:
        """Stream `request_id`'s tokens from here to the router at `reply_to`."""
        ...

    def forget(self, request_id: str) -> None:
        """Stop streaming `request_id` from here (it finished, failed, or went elsewhere)."""
        ...

    def send(self, endpoint: str, msg: Any) -> None: ...

    def add_generate(self, msg: GenerateRequest) -> None:
        """Put a local request in the engine and stream it (an error to its router if not)."""
        ...

    def send_error(self, reply_to: str, request_id: str, message: str) -> None: ...

    def publish(self, outputs: list[TokenOutput]) -> None: ...

    def count_abort(self) -> None:
        """An abort this worker honoured outside `EngineServer.abort` (the `aborts` counter)."""
        ...


class WorkerConnector(Protocol):
    """A KV connector as the loop sees it; it is also the engine's `PrefillKV` or `DecodeKV`
    for its role (engine/kv_connector.py: only that role's call, no stub of the other).

    Per iteration: `handle(msg)` for each frame received (True: it took the frame; it may
    also just look, as the decode side counts local prefills), `before_step()` (transfer
    events: blocks released, reads landed or failed), the engine step (which calls
    `on_prefilled` / `on_remote_admitted`), the step's tokens published, `after_step()` (what
    must follow the tokens: the prefill side's KVReady frames). Between iterations:
    `abort(rid)` is asked first, True while the connector owns the request's blocks and will
    free them itself (else the engine aborts it); `abort_unknown(rid)` when neither knew the
    id (its hand-off may still be on its way); `request_finished(rid)` after its last token;
    `has_pending_work()` (transfers in flight: poll again soon), `holds_nothing()` (drain;
    read from another thread), `extra_load()` (its counters in the load report), `close()`.
    It reaches the loop back through `attach(host)`.

    Tensor parallelism will create the byte-moving half (the agent) once per rank; the
    decisions (which blocks, when to free, the failure policy) stay with the loop on rank 0.
    """

    # The engine role this connector serves, or None for any role that moves no KV.
    role: str | None

    def attach(self, host: ConnectorHost) -> None: ...

    def handle(self, msg: Any) -> bool: ...

    def before_step(self) -> None: ...

    def after_step(self) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def abort_unknown(self, request_id: str) -> None: ...

    def request_finished(self, request_id: str) -> None: ...

    def has_pending_work(self) -> bool: ...

    def holds_nothing(self) -> bool: ...

    def extra_load(self) -> dict: ...

    def close(self) -> None: ...


class NoConnector:
    """A colocated worker's connector: no KV moves, no frame is its own, nothing is held."""

    role = None

    def attach(self, host: ConnectorHost) -> None:
        pass

    def handle(self, msg: Any) -> bool:
        return False

    def before_step(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def abort(self, request_id: str) -> bool:
        return False

    def abort_unknown(self, request_id: str) -> None:
        pass

    def request_finished(self, request_id: str) -> None:
        pass

    def has_pending_work(self) -> bool:
        return False

    def holds_nothing(self) -> bool:
        return True

    def extra_load(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class EngineServer:
    """The loop; see the module docstring. Satisfies `ConnectorHost` for its connector."""

    def __init__(
        self,
        worker_id: str,
        role: str,
        engine: LLMEngine,
        connector: WorkerConnector | None = None,
        bind_host: str = "127.0.0.1",
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ):
        connector = NoConnector() if connector is None else connector
        if connector.role is not None and connector.role != role:
            raise ValueError(f"a {connector.role} connector cannot serve a {role} worker")
        self.worker_id = worker_id
        self.role = role
        self.engine = engine
        self.connector = connector
        if connector.role is not None:  # it moves KV: the engine calls it from its step
            engine.set_kv_connector(connector)
        self.max_frame_bytes = max_frame_bytes
        self.ctx = zmq.Context()
        self.requests = self.ctx.socket(zmq.PULL)
        # ZMQ's own cap (which drops silently) sits well above ours, so an oversized frame
        # up to 4x the limit is received, logged and dropped by `_receive`.
        self.requests.setsockopt(zmq.MAXMSGSIZE, 4 * max_frame_bytes)
        self.requests.setsockopt(zmq.RCVHWM, 100_000)
        self.requests.bind(f"tcp://{bind_host}:*")
        self.endpoint = self.requests.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.replies = ReplySockets(self.ctx)
        self.kv_events = self._kv_events(bind_host)
        self.reply_to: dict[str, str] = {}  # request id -> router endpoint
        self.open_choices: dict[str, int] = {}  # request id -> its choices not yet finished
        self.num_bad_frames = 0
        self.num_aborts = 0  # requests this worker dropped on an AbortRequest
        self._stalled = False  # the last step had nothing it could run
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._poller = zmq.Poller()
        self._poller.register(self.requests, zmq.POLLIN)
        if self.kv_events is not None:  # a resync request wakes an idle loop too
            self._poller.register(self.kv_events.snapshots, zmq.POLLIN)
        self._load_time = 0.0
        self._latest_load: WorkerLoad | None = None
        self.step_delay_s = 0.0  # fault injection (tests): sleep this long after each step
        # Called once, on the loop thread, when the engine's tensor-parallel group went down
        # (after its requests got their errors): a Ray worker exits, so Ray replaces it whole.
        self.on_group_down: Callable[[TPError], None] | None = None
        self._group_down = False
        connector.attach(self)

    def _kv_events(self, bind_host: str) -> KVEventPublisher | None:
        """The KV event publisher, hooked to the engine's block manager (an engine without
        one, or without prefix caching, has no cache to tell routers about)."""
        bm = getattr(self.engine, "block_manager", None)
        if bm is None or not bm.enable_prefix_caching:
            return None
        pub = KVEventPublisher(
            self.ctx,
            self.worker_id,
            bm.block_size,
            lambda: self._held_hashes(bm),
            bind_host,
            self.max_frame_bytes,
        )
        bm.event_sink = pub.record
        return pub

    def _held_hashes(self, bm) -> dict[str, list[int]]:
        """Per tier, the block hashes this worker holds (a KV-event snapshot)."""
        held = {DEVICE_TIER: bm.cached_hashes()}
        host = getattr(self.engine, "host_cache", None)
        if host is not None:
            held[HOST_TIER] = host.cached_hashes()
        return held

    @property
    def kv_events_endpoints(self) -> tuple[str, str]:
        """(PUB endpoint, snapshot endpoint) of the KV events, ("", "") without them."""
        if self.kv_events is None:
            return "", ""
        return self.kv_events.endpoint, self.kv_events.snapshot_endpoint

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._latest_load = self.load()
        self._thread = threading.Thread(
            target=self._serve, name=f"engine-{self.worker_id}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.close()

    def close(self) -> None:
        self.replies.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self.requests.close(linger=0)
        self.ctx.term()
        self.connector.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except TPError as e:  # a rank died: no step can run; every request says why
                log.error("%s: %s", self.worker_id, e)
                self.fail_all(f"the worker's tensor-parallel group is down: {e}")
                if self.on_group_down is not None and not self._group_down:
                    self._group_down = True
                    self.on_group_down(e)
            except Exception:  # keep the worker alive; the failed step's requests get errors
                log.exception("%s: engine step failed", self.worker_id)
                self.fail_all("internal error in the engine step")

    def run_once(self) -> None:
        # Never spin: with work that cannot run yet (transfers in flight, or requests waiting
        # for blocks those transfers hold) wait 1 ms, releasing the GIL for the transfer
        # agent's thread; fully idle, 20 ms.
        unfinished = self.engine.has_unfinished()
        if unfinished and not self._stalled:
            timeout_ms = 0
        else:
            timeout_ms = 1 if unfinished or self.connector.has_pending_work() else 20
        self._receive(timeout_ms)
        self.connector.before_step()
        self._stalled = False
        if self.engine.has_unfinished():
            steps = self.engine.num_steps
            self.publish(self.engine.step())
            self._stalled = self.engine.num_steps == steps
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
        self.connector.after_step()
        if self.kv_events is not None:
            self.kv_events.flush()
            self.kv_events.serve_snapshots()
        now = time.monotonic()
        if now - self._load_time > 0.05:
            self._load_time = now
            self._latest_load = self.load()
            for endpoint in self.replies.take_disconnected():
                self.drop_requests_of(endpoint)

    def latest_load(self) -> WorkerLoad:
        """The last load report built by the loop thread (safe to read from other threads)."""
        return self._latest_load

    # -- input -------------------------------------------------------------------------------
    def _receive(self, timeout_ms: int) -> None:
        if not self._poller.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frame, self.max_frame_bytes)
            except WireError as e:  # decode raises nothing else on a malformed frame
                self.num_bad_frames += 1
                log.error("%s: dropped a bad frame (%d bytes): %s", self.worker_id, len(frame), e)
                continue
            try:
                self.handle(msg)
            except Exception:
                log.exception("%s: failed to handle %s", self.worker_id, type(msg).__name__)

    def handle(self, msg) -> None:
        if self.connector.handle(msg):
            return
        if isinstance(msg, GenerateRequest):
            self.add_generate(msg)
        elif isinstance(msg, AbortRequest):
            self.abort(msg.request_id)
        elif isinstance(msg, Shutdown):
            self._stop.set()
        else:
            self.num_bad_frames += 1
            log.error("%s: unexpected message %s", self.worker_id, type(msg).__name__)

    def add_generate(self, msg: GenerateRequest) -> None:
        try:
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.sampling)
        except ValueError as e:
            self.send_error(msg.reply_to, msg.request_id, str(e))
            return
        self.stream(msg.request_id, msg.reply_to, msg.sampling.n)

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is. The connector is asked first: while it owns the
        request's blocks (a lease, a READ in flight) it frees them itself, later. Ids nobody
        knows are passed to the connector too (the router aborts both workers at once, so the
        request may still be on its way here, or may have finished already)."""
        if self.connector.abort(request_id) or self.engine.abort(request_id):
            self.num_aborts += 1
        else:
            self.connector.abort_unknown(request_id)
        self.forget(request_id)

    def count_abort(self) -> None:
        self.num_aborts += 1

    # -- output ------------------------------------------------------------------------------
    def publish(self, outputs: list[TokenOutput]) -> None:
        for out in outputs:
            reply_to = self.reply_to.get(out.request_id)
            if reply_to is None:
                continue
            self.replies.send(reply_to, self.token_message(out))
            if out.finish_reason is not None:
                left = self.open_choices.get(out.request_id, 1) - 1
                self.open_choices[out.request_id] = left
                if left <= 0:
                    self.finished(out.request_id)

    def token_message(self, out: TokenOutput) -> TokenMessage:
        """The engine's record is the frame (a TokenMessage): add where it ran, then send it."""
        out.worker_id = self.worker_id
        if out.index == 0:
            out.prefill_worker_id = self.worker_id
        return out

    def stream(self, request_id: str, reply_to: str, num_choices: int) -> None:
        """Stream `request_id`'s tokens from here to `reply_to` until its choices finish."""
        self.reply_to[request_id] = reply_to
        self.open_choices[request_id] = num_choices

    def send(self, endpoint: str, msg: Any) -> None:
        self.replies.send(endpoint, msg)

    def forget(self, request_id: str) -> None:
        """Stop streaming `request_id` from here (it finished, failed, or went elsewhere)."""
        self.reply_to.pop(request_id, None)
        self.open_choices.pop(request_id, None)

    def finished(self, request_id: str) -> None:
        self.forget(request_id)
        self.engine.pop_finished(request_id)
        self.connector.request_finished(request_id)

    def send_error(self, reply_to: str, request_id: str, message: str) -> None:
        self.replies.send(
            reply_to,
            TokenMessage(
                request_id=request_id,
                index=0,
                token_ids=[],
                finish_reason="error",
                error=message[:2000],
                worker_id=self.worker_id,
            ),
        )

    def drop_requests_of(self, endpoint: str) -> None:
        """The router at `endpoint` went away: nobody reads these requests' tokens any more,
        so abort them (their KV blocks come back now, not after their last token). A router
        that restarts is a new router: it would drop their tokens as unknown anyway."""
        orphans = [rid for rid, to in self.reply_to.items() if to == endpoint]
        if orphans:
            log.warning(
                "%s: %s went away; aborting its %d requests", self.worker_id, endpoint, len(orphans)
            )
        for rid in orphans:
            # Queued for the reconnect: were the drop only a blip, the router learns of the
            # abort (a clear 503) instead of waiting for tokens that will never come.
            self.replies.send(
                endpoint,
                TokenMessage(
                    rid,
                    0,
                    [],
                    finish_reason="abort",
                    error="the worker lost its connection to the router",
                    worker_id=self.worker_id,
                ),
            )
            self.abort(rid)

    def fail_all(self, message: str) -> None:
        for rid, reply_to in list(self.reply_to.items()):
            self.send_error(reply_to, rid, message)
            self.abort(rid)

    def is_idle(self) -> bool:
        """Nothing in flight: no request in the engine or streaming from here, and nothing the
        connector holds (leases, READs). Read from another thread: a moment's view."""
        return (
            not self.engine.has_unfinished()
            and not self.reply_to
            and self.connector.holds_nothing()
        )

    # -- load report -------------------------------------------------------------------------
    def load(self) -> WorkerLoad:
        s = self.engine.stats()
        return WorkerLoad(
            worker_id=self.worker_id,
            role=self.role,
            num_free_blocks=s["num_free_blocks"],
            num_total_blocks=s["num_total_blocks"],
            num_running=s["num_running"],
            num_waiting=s["num_waiting"],
            queued_prefill_tokens=s["queued_prefill_tokens"],
            extra={
                **self.connector.extra_load(),
                "bad_frames": self.num_bad_frames,
                "aborts": self.num_aborts,
                "preemptions": s["num_preemptions"],
                "prefix_hit_tokens": s["prefix_hit_tokens"],
                "prefix_query_tokens": s["prefix_query_tokens"],
                # The host KV tier's counters and occupancy (engine/kv_host_cache.py), if on.
                **{k: v for k, v in s.items() if k.startswith("host_")},
                "time": time.time(),
            },
        )
