"""The router process: OpenAI-compatible HTTP in front, ZMQ to the workers behind.

Lifecycle of the server: `start()` loads the tokenizer and model limits, binds the ZMQ token
sink, takes a first directory snapshot, starts the snapshot refresher and the HTTP site, and
returns once both sockets listen (`.port`, `.reply_endpoint`). `stop()` undoes it in reverse.
`run_forever()` does both around a signal wait for a plain process; inside a Ray actor call
`await start()` on the actor's loop instead.

Lifecycle of a request: parse and validate (4xx on any client mistake) -> route (decode worker,
local or remote prefill; counted) -> register a token queue -> send GenerateRequest or
PrefillRequest -> merge TokenMessages in index order -> detokenize, apply stop strings and the
token limit -> respond (JSON, or SSE ending in `data: [DONE]`). Whatever way it ends before the
workers said they finished (stop string, error, timeout, client gone), AbortRequest goes to every
worker involved.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.protocol import AbortRequest, GenerateRequest, PrefillRequest, TokenMessage
from router.config import RouterConfig
from router.dataplane import DataPlane, SendError
from router.detokenizer import IncrementalDetokenizer
from router.directory import WorkerDirectory, WorkerInfo
from router.errors import APIError
from router.metrics import RouterMetrics
from router.openai_api import ParsedRequest, RequestParser
from router.policy import LOCAL, LoadView, NoWorkersError, RoutePlan, plan_route
from router.reorder import ReorderError, TokenReorderBuffer

log = logging.getLogger(__name__)

_GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(slots=True)
class Piece:
    """Text that became ready for the client, with the tokens behind it."""

    text: str
    num_tokens: int
    finish_reason: str | None = None


@dataclass(slots=True)
class ModelInfo:
    tokenizer: Any
    max_model_len: int
    vocab_size: int


def load_model_info(config: RouterConfig) -> ModelInfo:
    """Tokenizer, context window and vocabulary size of the served model (local HF dir)."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model_path)
    hf_config = AutoConfig.from_pretrained(config.model_path)
    max_len = getattr(hf_config, "max_position_embeddings", None) or config.max_model_len
    if max_len is None:
        raise ValueError(
            f"{config.model_path}: config has no max_position_embeddings; set max_model_len"
        )
    if config.max_model_len is not None:
        max_len = min(max_len, config.max_model_len)
    vocab = getattr(hf_config, "vocab_size", None) or len(tokenizer)
    return ModelInfo(tokenizer, int(max_len), int(vocab))


class RouterServer:
    def __init__(
        self,
        config: RouterConfig,
        directory: WorkerDirectory,
        model_info: ModelInfo | None = None,
    ) -> None:
        self.config = config
        self.directory = directory
        self.model_info = model_info
        self.parser: RequestParser | None = None
        self.port: int | None = None
        self._workers: list[WorkerInfo] = []
        self._view = LoadView([], config.default_block_size)
        self.metrics = RouterMetrics(lambda: self._workers)
        self.dataplane = DataPlane(
            bind_host=config.bind_host,
            port=config.zmq_port,
            advertise_host=config.advertise_host or config.bind_host,
            max_frame_bytes=config.max_frame_bytes,
            send_timeout_s=config.send_timeout_s,
            on_bad_frame=self.metrics.bad_frames.inc,
        )
        self._runner: web.AppRunner | None = None
        self._refresh_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._inflight: dict[str, tuple[str, ...]] = {}  # request id -> worker ids involved
        # request id -> where it runs; surfaced as the `tandem` extension field and headers
        self._placement: dict[str, dict] = {}
        self._gone: set[str] = set()
        self._created = int(time.time())

    # ------------------------------------------------------------------ lifecycle

    @property
    def reply_endpoint(self) -> str:
        return self.dataplane.reply_endpoint

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()  # release whatever was bound before the failure
            raise

    async def _start(self) -> None:
        if self.model_info is None:
            self.model_info = await asyncio.to_thread(load_model_info, self.config)
        info = self.model_info
        self.parser = RequestParser(
            info.tokenizer,
            self.config.served_model_name or self.config.model_path,
            info.max_model_len,
            info.vocab_size,
            self.config.completion_default_max_tokens,
        )
        await self.dataplane.start()
        await self._refresh()
        self._refresh_task = asyncio.create_task(self._refresh_loop(), name="router-directory")
        app = web.Application(
            client_max_size=self.config.max_body_bytes,
            middlewares=[self._error_middleware, self._auth_middleware],
        )
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        # handler_cancellation: a client that goes away cancels its handler, which aborts the
        # request on the workers (see _generate's finally).
        # shutdown_timeout: stop() waits this long for in-flight responses before closing.
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        sockets = site._server.sockets if site._server is not None else []
        self.port = sockets[0].getsockname()[1] if sockets else self.config.port
        log.info(
            "router listening on http://%s:%s, token sink %s, %s",
            self.config.host,
            self.port,
            self.dataplane.bound_endpoint,
            self.config,
        )

    async def stop(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresh_task
            self._refresh_task = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for task in list(self._background):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(task, timeout=1.0)
        await self.dataplane.stop()

    def run_forever(self) -> None:
        """Serve until SIGINT/SIGTERM (plain process convenience)."""

        async def main() -> None:
            await self.start()
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, stop.set)
            try:
                await stop.wait()
            finally:
                await self.stop()

        asyncio.run(main())

    # ------------------------------------------------------------------ directory

    async def _refresh(self) -> None:
        try:
            workers = await asyncio.wait_for(self.directory.snapshot(), timeout=5.0)
        except Exception as e:  # noqa: BLE001 - controller may be restarting; keep last view
            log.warning("worker directory snapshot failed: %s", e)
            return
        self._workers = list(workers)
        self._view = LoadView(self._workers, self.config.default_block_size)
        self.dataplane.retain({w.request_endpoint for w in self._workers})
        self._fail_orphans({w.worker_id for w in self._workers})

    def _fail_orphans(self, live: set[str]) -> None:
        """End requests whose worker left the pool (two snapshots in a row, so one odd
        snapshot during a controller restart does not kill everything in flight)."""
        gone_now: set[str] = set()
        for rid, wids in list(self._inflight.items()):
            missing = [w for w in wids if w not in live]
            gone_now.update(missing)
            confirmed = [w for w in missing if w in self._gone]
            if confirmed:
                self.dataplane.inject(
                    TokenMessage(
                        rid,
                        0,
                        [],
                        finish_reason="abort",
                        worker_id=confirmed[0],
                        error=f"worker {confirmed[0]} left the pool",
                    )
                )
        self._gone = gone_now

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_interval_s)
            await self._refresh()

    async def _route(self, prompt_ids: list[int]) -> RoutePlan:
        for attempt in range(2):
            try:
                plan = plan_route(
                    self._view,
                    prompt_ids,
                    disagg_threshold=self.config.disagg_threshold,
                    prefix_tokens=self.config.affinity_prefix_tokens,
                    slack_tokens=self.config.affinity_slack_tokens,
                    batch_norm=self.config.decode_batch_norm,
                )
            except NoWorkersError as e:
                if attempt == 0:
                    await self._refresh()  # workers may have registered since the last poll
                    continue
                raise APIError(503, f"{e}; try again later", code="no_workers") from e
            self._view.note_dispatch(plan, len(prompt_ids))
            self.metrics.disagg.labels(path=plan.path).inc()
            return plan
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ middlewares

    @web.middleware
    async def _error_middleware(self, request: web.Request, handler) -> web.StreamResponse:
        generate = request.path in _GENERATE_PATHS
        try:
            return await handler(request)
        except APIError as e:
            if generate:
                self.metrics.requests.labels(
                    status="client_error" if e.status < 500 else "server_error"
                ).inc()
            return e.response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            if generate:
                self.metrics.requests.labels(status="client_error").inc()
            message = (
                e.reason
                if e.status != 413
                else (f"request body is over the {self.config.max_body_bytes}-byte limit")
            )
            return APIError(e.status, message).response()
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            if generate:
                self.metrics.requests.labels(status="server_error").inc()
            return APIError(500, "internal server error").response()

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler) -> web.StreamResponse:
        key = self.config.api_key
        if key is not None and request.path != "/health":
            given = request.headers.get("Authorization", "")
            expected = f"Bearer {key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                raise APIError(
                    401,
                    "Invalid or missing API key; send 'Authorization: Bearer <key>'.",
                    code="invalid_api_key",
                )
        return await handler(request)

    # ------------------------------------------------------------------ simple routes

    async def _health(self, request: web.Request) -> web.Response:
        roles: dict[str, int] = {}
        for w in self._workers:
            roles[w.role] = roles.get(w.role, 0) + 1
        return web.json_response(
            {"status": "ok", "workers": roles, "inflight": self.dataplane.num_inflight}
        )

    async def _models(self, request: web.Request) -> web.Response:
        assert self.model_info is not None
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.served_model_name,
                        "object": "model",
                        "created": self._created,
                        "owned_by": "tandem",
                        "root": self.config.model_path,
                        "max_model_len": self.model_info.max_model_len,
                    }
                ],
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------------ generation routes

    async def _read_json(self, request: web.Request) -> Any:
        raw = await request.read()  # raises 413 over client_max_size
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from e

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        assert self.parser is not None
        parsed = self.parser.parse_completion(body)
        return await self._serve(request, parsed, f"cmpl-{uuid.uuid4().hex}")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        assert self.parser is not None
        parsed = self.parser.parse_chat(body)
        return await self._serve(request, parsed, f"chatcmpl-{uuid.uuid4().hex}")

    async def _serve(self, request: web.Request, parsed: ParsedRequest, rid: str):
        arrival = time.monotonic()
        self.metrics.inflight.inc()
        status = "cancelled"
        try:
            if parsed.stream:
                resp = await self._respond_stream(request, parsed, rid, arrival)
            else:
                resp = await self._respond_json(parsed, rid, arrival)
            status = "success"
            return resp
        except APIError as e:
            status = "server_error" if e.status >= 500 else "client_error"
            return e.response()
        except (asyncio.CancelledError, ConnectionResetError):
            status = "cancelled"
            raise
        except Exception:
            status = "server_error"
            raise
        finally:
            self._placement.pop(rid, None)
            self.metrics.inflight.dec()
            self.metrics.requests.labels(status=status).inc()

    async def _generate(
        self, parsed: ParsedRequest, rid: str, arrival: float
    ) -> AsyncIterator[Piece]:
        """Dispatch one request and yield its text as it becomes ready; see module docstring."""
        assert self.model_info is not None
        cfg = self.config
        plan = await self._route(parsed.prompt_ids)
        self._placement[rid] = {
            "path": plan.path,
            "prefill_worker": (plan.prefill or plan.decode).worker_id,
            "decode_worker": plan.decode.worker_id,
        }
        targets = [plan.decode.request_endpoint]
        if plan.prefill is not None:
            targets.append(plan.prefill.request_endpoint)
        self.metrics.prompt_tokens.inc(len(parsed.prompt_ids))
        queue = self.dataplane.register(rid)
        self._inflight[rid] = tuple(
            w.worker_id for w in (plan.decode, plan.prefill) if w is not None
        )
        workers_done = False
        loop = asyncio.get_running_loop()
        try:
            await self._dispatch(plan, parsed, rid)
            reorder = TokenReorderBuffer()
            detok = IncrementalDetokenizer(self.model_info.tokenizer, parsed.stop)
            max_tokens = parsed.sampling.max_tokens
            deadline = arrival + cfg.request_timeout_s
            num_tokens = 0
            first_at: float | None = None
            last_at: float | None = None
            while True:
                now = loop.time()
                gap_deadline = reorder.gap_deadline(cfg.token_gap_timeout_s)
                if gap_deadline is not None and now >= gap_deadline:
                    raise APIError(
                        500,
                        f"token stream of request {rid} has a gap at index {reorder.next_index} "
                        f"older than {cfg.token_gap_timeout_s}s",
                        code="token_gap",
                    )
                if now >= deadline:
                    raise APIError(
                        504,
                        f"request {rid} timed out after {cfg.request_timeout_s}s",
                        code="timeout",
                    )
                wait = min(deadline, gap_deadline if gap_deadline is not None else math.inf) - now
                try:
                    msg = await asyncio.wait_for(queue.get(), timeout=max(wait, 0.0))
                except TimeoutError:
                    continue
                try:
                    deliveries = reorder.push(msg, loop.time())
                except ReorderError as e:
                    raise APIError(500, f"request {rid}: {e}", code="token_reorder") from e
                for d in deliveries:
                    if d.finish_reason == "error":
                        workers_done = plan.path == LOCAL
                        raise APIError(
                            500,
                            f"worker {d.worker_id or '?'} failed request {rid}: "
                            f"{d.error or 'unknown error'}",
                            code="worker_error",
                        )
                    if d.finish_reason == "abort":
                        workers_done = plan.path == LOCAL
                        raise APIError(
                            503,
                            f"worker {d.worker_id or '?'} aborted request {rid}: "
                            f"{d.error or 'no reason given'}",
                            code="worker_abort",
                        )
                    tokens = d.token_ids[: max_tokens - num_tokens]
                    finish = d.finish_reason
                    workers_done = finish is not None
                    now = loop.time()
                    if tokens:
                        if first_at is None:
                            first_at = now
                            self.metrics.ttft.observe(now - arrival)
                        elif last_at is not None:
                            self.metrics.itl.observe(now - last_at)
                        last_at = now
                    num_tokens += len(tokens)
                    self.metrics.generation_tokens.inc(len(tokens))
                    text = detok.add(tokens)
                    if detok.stopped:
                        finish = "stop"
                    elif num_tokens >= max_tokens and finish is None:
                        finish = "length"  # the worker overran; cut it off here
                    if finish is not None and not detok.stopped:
                        text += detok.finish()
                        if detok.stopped:
                            finish = "stop"
                    yield Piece(text, len(tokens), finish)
                    if finish is not None:
                        self.metrics.e2e.observe(now - arrival)
                        if first_at is not None and num_tokens > 1:
                            self.metrics.tpot.observe((now - first_at) / (num_tokens - 1))
                        return
        finally:
            self.dataplane.unregister(rid)
            self._inflight.pop(rid, None)
            if not workers_done:
                self._spawn(self._abort(rid, targets))

    async def _dispatch(self, plan: RoutePlan, parsed: ParsedRequest, rid: str) -> None:
        reply_to = self.dataplane.reply_endpoint
        try:
            if plan.prefill is None:
                msg: Any = GenerateRequest(rid, parsed.prompt_ids, parsed.sampling, reply_to)
                await self.dataplane.send(plan.decode.request_endpoint, msg)
            else:
                msg = PrefillRequest(
                    rid,
                    parsed.prompt_ids,
                    parsed.sampling,
                    reply_to,
                    decode_worker_id=plan.decode.worker_id,
                    decode_endpoint=plan.decode.decode_endpoint,
                )
                await self.dataplane.send(plan.prefill.request_endpoint, msg)
        except SendError as e:
            raise APIError(503, str(e), code="worker_unreachable") from e

    async def _abort(self, rid: str, endpoints: list[str]) -> None:
        for endpoint in endpoints:
            try:
                await self.dataplane.send(endpoint, AbortRequest(rid))
            except Exception as e:  # noqa: BLE001 - best effort: the worker may be gone
                log.warning("could not send abort for %s to %s: %s", rid, endpoint, e)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ response shapes

    @staticmethod
    def _usage(parsed: ParsedRequest, completion_tokens: int) -> dict:
        p = len(parsed.prompt_ids)
        return {
            "prompt_tokens": p,
            "completion_tokens": completion_tokens,
            "total_tokens": p + completion_tokens,
        }

    async def _respond_json(self, parsed: ParsedRequest, rid: str, arrival: float) -> web.Response:
        parts: list[str] = []
        num_tokens = 0
        finish = None
        async with contextlib.aclosing(self._generate(parsed, rid, arrival)) as pieces:
            async for piece in pieces:
                parts.append(piece.text)
                num_tokens += piece.num_tokens
                finish = piece.finish_reason or finish
        text = "".join(parts)
        created = int(time.time())
        if parsed.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return web.json_response(
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": parsed.model,
                "choices": [choice],
                "usage": self._usage(parsed, num_tokens),
                "tandem": self._placement.get(rid, {}),
            },
            headers=self._placement_headers(rid),
        )

    def _placement_headers(self, rid: str) -> dict[str, str]:
        p = self._placement.get(rid)
        if not p:
            return {}
        return {"X-Tandem-Path": p["path"], "X-Tandem-Prefill-Worker": p["prefill_worker"],
                "X-Tandem-Decode-Worker": p["decode_worker"]}

    def _chunk(
        self,
        parsed: ParsedRequest,
        rid: str,
        created: int,
        text: str | None,
        finish: str | None,
        first: bool = False,
    ) -> dict:
        if parsed.kind == "chat":
            delta: dict = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        chunk = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": parsed.model,
            "choices": [choice],
        }
        if parsed.include_usage:
            chunk["usage"] = None
        return chunk

    @staticmethod
    async def _send_event(resp: web.StreamResponse, payload: dict | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
        await resp.write(f"data: {data}\n\n".encode())

    async def _respond_stream(
        self, request: web.Request, parsed: ParsedRequest, rid: str, arrival: float
    ) -> web.StreamResponse:
        created = int(time.time())
        resp: web.StreamResponse | None = None
        num_tokens = 0
        async with contextlib.aclosing(self._generate(parsed, rid, arrival)) as pieces:
            try:
                async for piece in pieces:
                    num_tokens += piece.num_tokens
                    if resp is None:
                        # Headers wait for the first token so that an early failure can still
                        # be a plain HTTP error with a JSON body.
                        resp = web.StreamResponse(
                            headers={
                                "Content-Type": "text/event-stream",
                                "Cache-Control": "no-cache",
                                "X-Request-Id": rid,
                                **self._placement_headers(rid),
                            }
                        )
                        await resp.prepare(request)
                        if parsed.kind == "chat":
                            await self._send_event(
                                resp, self._chunk(parsed, rid, created, "", None, first=True)
                            )
                    if piece.text or piece.finish_reason is not None:
                        await self._send_event(
                            resp,
                            self._chunk(parsed, rid, created, piece.text, piece.finish_reason),
                        )
            except APIError as e:
                if resp is None:
                    raise
                log.warning("stream %s failed after it started: %s", rid, e.message)
                await self._send_event(resp, e.body())
                await self._send_event(resp, "[DONE]")
                await resp.write_eof()
                raise _StreamFailed(resp) from e
        assert resp is not None
        if parsed.include_usage:
            usage_chunk = {
                "id": rid,
                "object": "chat.completion.chunk" if parsed.kind == "chat" else "text_completion",
                "created": created,
                "model": parsed.model,
                "choices": [],
                "usage": self._usage(parsed, num_tokens),
            }
            await self._send_event(resp, usage_chunk)
        await self._send_event(resp, "[DONE]")
        await resp.write_eof()
        return resp


class _StreamFailed(APIError):
    """A stream that already sent its headers and then failed: the error event is written."""

    def __init__(self, resp: web.StreamResponse) -> None:
        super().__init__(500, "stream failed")
        self.resp = resp

    def response(self) -> web.StreamResponse:  # type: ignore[override]
        return self.resp
