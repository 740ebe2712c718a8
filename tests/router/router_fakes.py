"""A test-seam worker: real ZMQ sockets and real wire frames, deterministic fake generation.

It PULLs on its own `tcp://127.0.0.1:<port>`, decodes frames with `engine.protocol.decode`, and
PUSHes `TokenMessage`s to each request's `reply_to`. Output token i is prompt[i % len(prompt)]
("echo"), so the expected text is known. A prefill-role fake sends token 0 (with
`prefill_worker_id`) and hands the rest to its `partner` decode fake, like the real split.
Behaviour knobs: `chunk` tokens per message, `delay_s` between messages, `mode`:
"echo" | "shuffle" (out-of-order and duplicate indexes) | "error" (fails after one token) |
"error_first" (fails before any token) | "silent" (never answers) | "overrun" (ignores
max_tokens and never finishes on its own) | "gap" (loses its first message).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import zmq

from engine.protocol import (
    AbortRequest,
    GenerateRequest,
    PrefillRequest,
    TokenMessage,
    WorkerLoad,
    decode,
    encode,
)
from router.directory import WorkerInfo


@dataclass
class _Job:
    request_id: str
    reply_to: str
    messages: list[TokenMessage] = field(default_factory=list)
    next_at: float = 0.0


def echo_tokens(prompt: list[int], n: int) -> list[int]:
    return [prompt[i % len(prompt)] for i in range(n)]


class FakeWorker:
    def __init__(
        self,
        worker_id: str,
        role: str = "decode",
        *,
        mode: str = "echo",
        chunk: int = 1,
        delay_s: float = 0.0,
        partner: FakeWorker | None = None,
        free_blocks: int = 100,
        script: list[int] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.role = role
        self.mode = mode
        self.chunk = chunk
        self.delay_s = delay_s
        self.partner = partner
        self.free_blocks = free_blocks
        # A fixed answer (its last id an EOS), finished "stop", in place of the echo.
        self.script = script
        self.received: list[object] = []
        self.aborts: list[str] = []
        self.handoffs: list[tuple[str, int]] = []  # (request_id, first index) from a prefill
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._push: dict[str, zmq.Socket] = {}
        self._jobs: list[_Job] = []
        self._inbox: queue.Queue[_Job] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fake-{worker_id}", daemon=True)
        self._thread.start()

    def info(self, **load_overrides) -> WorkerInfo:
        load = dict(  # noqa: C408
            worker_id=self.worker_id,
            role=self.role,
            num_free_blocks=self.free_blocks,
            num_total_blocks=100,
            num_running=0,
            num_waiting=0,
            queued_prefill_tokens=0,
            extra={
                "transfer_bytes": 1234,
                "transfer_seconds": 0.5,
                "transfer_failures": 0,
                "expired_leases": 0,
            },
        )
        load.update(load_overrides)
        return WorkerInfo(self.worker_id, self.role, self.endpoint, WorkerLoad(**load))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for s in self._push.values():
            s.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()

    # ------------------------------------------------------------------ worker loop

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            now = time.monotonic()
            busy = any(j.messages and j.next_at <= now for j in self._jobs)
            events = dict(poller.poll(timeout=0 if busy else 5))
            if self._pull in events:
                msg = decode(self._pull.recv())
                self.received.append(msg)
                self._handle(msg)
            while not self._inbox.empty():
                self._jobs.append(self._inbox.get())
            self._advance()

    def _handle(self, msg: object) -> None:
        if isinstance(msg, AbortRequest):
            self.aborts.append(msg.request_id)
            self._jobs = [j for j in self._jobs if j.request_id != msg.request_id]
            return
        if isinstance(msg, PrefillRequest):
            first = echo_tokens(msg.prompt_token_ids, 1)
            done = "length" if msg.sampling.max_tokens == 1 else None
            tm = TokenMessage(
                msg.request_id,
                0,
                first,
                finish_reason=done,
                worker_id=self.worker_id,
                prefill_worker_id=self.worker_id,
            )
            self._jobs.append(_Job(msg.request_id, msg.reply_to, [tm]))
            if done is None and self.partner is not None:
                self.partner.hand_off(msg)
            return
        if isinstance(msg, GenerateRequest):
            self._jobs.append(
                self._plan(
                    msg.request_id,
                    msg.reply_to,
                    msg.prompt_token_ids,
                    msg.sampling.max_tokens,
                    start=0,
                )
            )

    def hand_off(self, req: PrefillRequest) -> None:
        """Called by the prefill partner (any thread): continue the request from index 1."""
        self.handoffs.append((req.request_id, 1))
        job = self._plan(
            req.request_id, req.reply_to, req.prompt_token_ids, req.sampling.max_tokens, start=1
        )
        self._inbox.put(job)

    def _plan(
        self, rid: str, reply_to: str, prompt: list[int], max_tokens: int, start: int
    ) -> _Job:
        n = max_tokens if self.mode != "overrun" else max_tokens + 50
        out = echo_tokens(prompt, n)
        if self.script is not None:
            out, n = self.script, len(self.script)
        msgs: list[TokenMessage] = []
        if self.mode == "silent":
            return _Job(rid, reply_to, [])
        if self.mode == "error_first":
            msgs.append(
                TokenMessage(
                    rid, start, [], finish_reason="error", error="boom", worker_id=self.worker_id
                )
            )
            return _Job(rid, reply_to, msgs)
        for i in range(start, n, self.chunk):
            toks = out[i : i + self.chunk]
            last = i + self.chunk >= n
            finish = "length" if last and self.mode != "overrun" else None
            if last and self.script is not None:
                finish = "stop"
            msgs.append(TokenMessage(rid, i, toks, finish_reason=finish, worker_id=self.worker_id))
        if self.mode == "gap":
            msgs = msgs[1:]  # the first message is lost
        if self.mode == "error":
            msgs = msgs[:1] + [
                TokenMessage(
                    rid,
                    start + self.chunk,
                    [],
                    finish_reason="error",
                    error="boom",
                    worker_id=self.worker_id,
                )
            ]
        if self.mode == "shuffle" and len(msgs) >= 3:
            # 1 before 0, 0 twice, an overlapping resend, and the tail reversed.
            a, b, *rest = msgs
            overlap = TokenMessage(
                rid, a.index, a.token_ids + b.token_ids, worker_id=self.worker_id
            )
            msgs = [b, a, a, overlap] + rest[::-1] + [b]
        return _Job(rid, reply_to, msgs)

    def _advance(self) -> None:
        now = time.monotonic()
        for job in list(self._jobs):
            if job.next_at > now:
                continue
            if not job.messages:
                if self.mode != "silent":
                    self._jobs.remove(job)
                continue
            msg = job.messages.pop(0)
            self._send(job.reply_to, msg)
            job.next_at = now + self.delay_s
            if not job.messages and self.mode != "silent":
                self._jobs.remove(job)

    def _send(self, endpoint: str, msg: TokenMessage) -> None:
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._push[endpoint] = sock
        sock.send(encode(msg))


class HoldingWorker(FakeWorker):
    """A FakeWorker that sends nothing until `release()`: its requests wait for their first
    token as they would behind a full worker queue. Aborts still reach it while it holds.
    After the release it answers like a FakeWorker (`delay_s` between messages)."""

    def __init__(self, worker_id: str, role: str = "colocated", **kwargs) -> None:
        self.released = threading.Event()  # set before the worker thread starts
        super().__init__(worker_id, role, **kwargs)

    def release(self) -> None:
        self.released.set()

    def _advance(self) -> None:
        if not self.released.is_set():
            # Push every job's next message a little ahead, so the poll loop sleeps instead of
            # spinning while it holds.
            hold_until = time.monotonic() + 0.005
            for job in self._jobs:
                job.next_at = max(job.next_at, hold_until)
            return
        super()._advance()
