"""The router process: OpenAI-compatible HTTP in front, ZMQ to the workers behind.

Lifecycle of the server: `start()` loads the tokenizer and model limits, binds the ZMQ token
sink, takes a first directory snapshot, starts the snapshot refresher (`WorkerPool`) and the
HTTP site, and returns once both sockets listen (`.port`, `.reply_endpoint`). `stop()` undoes
it in reverse. `run_forever()` does both around a signal wait for a plain process; inside a Ray
actor call `await start()` on the actor's loop instead.

Lifecycle of a request: the middlewares check the key and turn any error into an OpenAI error
body -> parse and validate (4xx on any client mistake) -> admission (router/admission.py: 503
`draining` once `begin_drain()` was called, 429 `queue_full` over the queue limits; both answered
before anything is sent to a worker) -> a `Generation` routes, dispatches and
yields text pieces (router/generation.py) -> answered as one JSON body or as SSE events ending
in `data: [DONE]` (shapes in router/responses.py). Streams send their headers with the first
piece, so a failure before it is still a plain HTTP error. The admission ticket leaves the queue
at the first output token and is released whichever way the request ends.

Probes: `/health` is liveness (200 while the process serves); `/ready` (alias
`/health?ready=1`) is readiness: 503 while draining or while the pool has no decode-capable
worker. Neither needs the API key. Drain (what a SIGTERM handler calls): `begin_drain()`, then
`await wait_idle(timeout_s)` until the generation requests in flight have ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.metadata
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.model_info import ModelInfo, read_model_info
from engine.roles import DECODING_ROLES
from router import responses
from router.admission import AdmissionControl, Ticket
from router.config import RouterConfig
from router.cors import install_cors
from router.dataplane import DataPlane
from router.directory import WorkerDirectory
from router.errors import UNAVAILABLE_RETRY_AFTER_S, APIError
from router.generation import GenerationContext
from router.metrics import RouterMetrics
from router.openai_api import ParsedRequest, RequestParser, read_body
from router.openapi import openapi_document
from router.response_store import ResponseStore
from router.responses_api import ResponsesAPI, ResponsesCall
from router.routing import WorkerPool
from router.serving import RequestRun, StreamWriter
from router.signal_recorder import SignalRecorder, SignalReporter
from router.tools import detect_tool_format
from router.utility_routes import add_utility_routes

log = logging.getLogger(__name__)

_GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
# Probes answer without the API key: orchestrators do not hold it.
_PROBE_PATHS = ("/health", "/ready")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def tandem_version() -> str:
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def load_model_info(config: RouterConfig) -> ModelInfo:
    """Tokenizer, context window, vocabulary size, EOS ids and sampling defaults of the
    served model (local HF dir), read as the engine reads them (engine/model_info.py)."""
    return read_model_info(
        config.model_path, config.max_model_len, config.tokenizer, config.chat_template
    )


def request_parser(config: RouterConfig, info: ModelInfo) -> RequestParser:
    """The router's request parser for `info`'s model, structured-output checks included."""
    return RequestParser(
        info.tokenizer,
        config.served_model_name or config.model_path,
        info.max_model_len,
        info.vocab_size,
        config.completion_default_max_tokens,
        generation_defaults=info.generation_defaults,
        check_structured=RouterServer._structured_checker(info),
        tool_format=config.tool_call_parser or detect_tool_format(info.chat_template),
        model_aliases=(config.model_path,),
        scheduling_policy=config.scheduling_policy,
        reasoning_parser=config.reasoning_parser,
    )


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
        self.metrics = RouterMetrics(lambda: self.pool.workers, config.slo_targets())
        self.dataplane = DataPlane(
            bind_host=config.bind_host,
            port=config.zmq_port,
            advertise_host=config.advertise_host or config.bind_host,
            max_frame_bytes=config.max_frame_bytes,
            send_timeout_s=config.send_timeout_s,
            on_bad_frame=self.metrics.bad_frames.inc,
        )
        self.pool = WorkerPool(config, directory, self.dataplane)
        self.metrics.track_kv_index(self.pool)
        self.admission = AdmissionControl(
            config.max_queued_requests, config.max_queued_prompt_tokens
        )
        self.metrics.track_queue(
            lambda: self.admission.queued_requests, lambda: self.admission.queued_prompt_tokens
        )
        # Planner signals: a window per signal_interval_s, pushed to the controller.
        self.signals = SignalRecorder(
            lambda: self.pool.workers, self.admission, metrics=self.metrics
        )
        self.signal_reporter = SignalReporter(self.signals, directory, config.signal_interval_s)
        self.metrics.track_planner(lambda: self.signal_reporter.planner_status)
        self._draining = False
        self._active = 0  # generation requests inside _serve (what wait_idle waits out)
        self._idle = asyncio.Event()
        self._idle.set()
        self._generation_context: GenerationContext | None = None
        self._runner: web.AppRunner | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._created = int(time.time())
        self.response_store = ResponseStore(
            config.responses_max_stored, config.responses_max_stored_bytes
        )
        self.responses_api: ResponsesAPI | None = None

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
        self.parser = request_parser(self.config, info)
        self.responses_api = ResponsesAPI(self.parser, self.response_store)
        shared = (self.config, self.pool, self.dataplane, self.metrics, info.tokenizer)
        self._generation_context = GenerationContext(*shared, self._spawn, self.signals)
        await self.dataplane.start()
        await self.pool.start()
        self.signals.begin()  # after the first snapshot: the prefix counters' baseline
        self.signal_reporter.start()
        await self._start_http()
        log.info(
            "router listening on http://%s:%s, token sink %s, %s",
            self.config.host,
            self.port,
            self.dataplane.bound_endpoint,
            self.config,
        )

    @staticmethod
    def _structured_checker(info: ModelInfo):
        """Compiles structured-output specs against the served tokenizer, so a bad schema is
        a 400 at the router (the workers compile the same spec from their cache)."""
        if not hasattr(info.tokenizer, "backend_tokenizer"):
            return None  # not a fast HF tokenizer (test fakes): the workers still check
        from engine.structured import GrammarCompiler

        compiler = GrammarCompiler(info.tokenizer, info.vocab_size, info.eos_token_ids)
        return compiler.validate

    async def _start_http(self) -> None:
        app = web.Application(
            client_max_size=self.config.max_body_bytes,
            middlewares=[self._error_middleware, self._auth_middleware],
        )
        install_cors(app, self.config.allowed_origins)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model:.+}", self._model)  # an alias may be a path
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        assert self.responses_api is not None
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post("/v1/responses/input_tokens", self._responses_input_tokens)
        app.router.add_get("/v1/responses/{response_id}", self.responses_api.get)
        app.router.add_delete("/v1/responses/{response_id}", self.responses_api.delete)
        info, parser = self.model_info, self.parser
        assert info is not None and parser is not None
        document = openapi_document(parser.served_model_name)

        async def openapi(request: web.Request) -> web.Response:
            return web.json_response(document)

        app.router.add_get("/openapi.json", openapi)
        add_utility_routes(
            app,
            info.tokenizer,
            parser.served_model_name,
            info.max_model_len,
            tandem_version(),
            parser.chat_prompt_ids,
            body_timeout_s=self.config.body_timeout_s,
            model_aliases=parser.limits.aliases,
        )
        # handler_cancellation: a client that goes away cancels its handler, which aborts the
        # request on the workers (the Generation's pieces() is closed).
        # shutdown_timeout: stop() waits this long for in-flight responses before closing.
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        sockets = site._server.sockets if site._server is not None else []
        self.port = sockets[0].getsockname()[1] if sockets else self.config.port

    async def stop(self) -> None:
        await self.signal_reporter.stop()
        await self.pool.stop()
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

    # ------------------------------------------------------------------ drain

    @property
    def draining(self) -> bool:
        return self._draining

    def begin_drain(self) -> None:
        """Refuse new generation requests (503 `draining`) and fail readiness; requests in
        flight go on. Idempotent; there is no way back (the process is on its way out)."""
        if not self._draining:
            self._draining = True
            log.info("router draining: %d generation requests in flight", self._active)

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no generation request is in flight; False if some still are after
        `timeout_s` seconds."""
        if self._active == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(timeout_s, 0.0))
        except TimeoutError:
            return self._active == 0
        return True

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ middlewares

    @web.middleware
    async def _error_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
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
    async def _auth_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.config.api_key
        if key is not None and self._needs_key(request.path):
            given = request.headers.get("Authorization", "")
            expected = f"Bearer {key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                raise APIError(
                    401,
                    "Invalid or missing API key; send 'Authorization: Bearer <key>'.",
                    code="invalid_api_key",
                )
        return await handler(request)

    def _needs_key(self, path: str) -> bool:
        if path in _PROBE_PATHS:
            return False
        return self.config.metrics_require_key or path != "/metrics"

    # ------------------------------------------------------------------ simple routes

    async def _health(self, request: web.Request) -> web.Response:
        """Liveness: 200 while the process serves (`?ready=1`: the readiness answer)."""
        if request.query.get("ready", "").lower() in ("1", "true"):
            return await self._ready(request)
        return web.json_response(
            {
                "status": "ok",
                "workers": self.pool.role_counts(),
                "inflight": self.dataplane.num_inflight,
                "draining": self._draining,
            }
        )

    async def _ready(self, request: web.Request) -> web.Response:
        """Readiness: 200 when new requests can be served, else 503 with the reason."""
        workers = self.pool.role_counts()  # the routable workers of the latest snapshot
        if self._draining:
            reason, message = "draining", "the router is draining (shutting down)"
        elif not any(workers.get(role) for role in DECODING_ROLES):
            reason = "no_decode_workers"
            message = "no decode-capable worker (decode or colocated) in the pool"
        else:
            return web.json_response({"status": "ready", "workers": workers})
        return web.json_response(
            {"status": "not_ready", "reason": reason, "message": message, "workers": workers},
            status=503,
            headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
        )

    def _model_card(self) -> dict[str, Any]:
        assert self.model_info is not None
        return {
            "id": self.config.served_model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "tandem",
            "root": self.config.model_path,
            "max_model_len": self.model_info.max_model_len,
        }

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model}: the served model by its name (or its path), else a 404."""
        assert self.parser is not None
        name = request.match_info["model"]
        if name not in (self.parser.served_model_name, *self.parser.limits.aliases):
            message = f"The model `{name}` does not exist."
            raise APIError(404, message, param="model", code="model_not_found")
        return web.json_response(self._model_card())

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------------ generation routes

    async def _read_body(self, request: web.Request) -> bytes:
        return await read_body(request, self.config.body_timeout_s)  # 408 / 413 / 400

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        if (refusal := self._early_refusal()) is not None:
            return refusal
        body = await self._read_body(request)
        assert self.parser is not None
        parsed = self.parser.parse_completion(body)  # the model validates the bytes
        return await self._serve(request, parsed, self._answer_ids("cmpl", parsed, request))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        if (refusal := self._early_refusal()) is not None:
            return refusal
        body = await self._read_body(request)
        assert self.parser is not None
        parsed = self.parser.parse_chat(body)
        return await self._serve(request, parsed, self._answer_ids("chatcmpl", parsed, request))

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """/v1/responses: converted to a chat request (router/responses_api.py), served as one."""
        if (refusal := self._early_refusal()) is not None:
            return refusal
        body = await self._read_body(request)
        assert self.responses_api is not None
        call = self.responses_api.parse(body)
        return await self._serve(request, call.parsed, (call.rid, call.rid), call)

    async def _responses_input_tokens(self, request: web.Request) -> web.Response:
        """POST /v1/responses/input_tokens: the prompt tokens a /v1/responses body would run
        (its conversation through the chat template, tools included); nothing is generated."""
        assert self.responses_api is not None
        body = await self._read_body(request)
        tokens = len(self.responses_api.parse(body).parsed.prompt_ids)
        return web.json_response({"object": "response.input_tokens", "input_tokens": tokens})

    def _early_refusal(self) -> web.Response | None:
        """503 `draining` or 429 `queue_full` before the body is even read (the cheapest
        answer an overloaded router can give), or None."""
        try:
            self._check_draining()
            self.admission.check_room()
        except APIError as e:
            self.signals.note_arrival(None)  # demand all the same; its prompt is unread
            return self._refuse(e)
        return None

    def _check_draining(self) -> None:
        if self._draining:
            raise APIError(
                503,
                "the router is draining (shutting down) and takes no new requests; retry",
                code="draining",
            )

    def _admit(self, parsed: ParsedRequest, rid: str) -> Ticket:
        """A place in the admission queue, or APIError 503 `draining` / 429 `queue_full`:
        synchronous, so a refusal never waits on a worker."""
        self._check_draining()
        return self.admission.admit(rid, sum(len(p) for p in parsed.prompts))

    def _refuse(self, e: APIError) -> web.Response:
        self.metrics.rejected.labels(reason=e.code).inc()
        self.metrics.observe_unserved("refused")
        self.metrics.requests.labels(
            status="client_error" if e.status < 500 else "server_error"
        ).inc()
        return e.response()

    def _enter(self) -> None:
        self._active += 1
        self._idle.clear()
        self.metrics.inflight.inc()

    def _leave(self) -> None:
        self.metrics.inflight.dec()
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    @staticmethod
    def _answer_ids(prefix: str, parsed: ParsedRequest, request: web.Request) -> tuple[str, str]:
        return responses.answer_ids(prefix, parsed, request.headers.get("X-Request-Id"))

    async def _serve(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        ids: tuple[str, str],  # (the answer's id, the id it runs under): responses.answer_ids
        responses_call: ResponsesCall | None = None,
    ) -> web.StreamResponse:
        assert self._generation_context is not None
        arrival = time.monotonic()
        self.signals.note_arrival([len(p) for p in parsed.prompts])
        try:
            ticket = self._admit(parsed, ids[1])
        except APIError as e:
            return self._refuse(e)
        self._enter()
        status = "cancelled"
        try:
            run = RequestRun(self._generation_context, parsed, ids, arrival)
            run.set_first_token_callback(ticket.started)
            if responses_call is not None:
                assert self.responses_api is not None
                resp = await self.responses_api.respond(request, run, responses_call)
            elif parsed.stream:
                resp = await self._respond_stream(request, run)
            else:
                resp = await self._respond_json(run)
            status = "success"
            return resp
        except APIError as e:
            status = "server_error" if e.status >= 500 else "client_error"
            if e.code == "no_workers":
                self.metrics.rejected.labels(reason="no_workers").inc()
                status = "refused"
            return e.response()
        except (asyncio.CancelledError, ConnectionResetError):
            status = "cancelled"
            raise
        except Exception:
            status = "server_error"
            raise
        finally:
            ticket.done()
            self._leave()
            self.metrics.request_ended(status)

    async def _respond_json(self, run: RequestRun) -> web.Response:
        body = await run.answer_body(int(time.time()))
        headers = {
            "X-Request-Id": run.rid,
            **responses.placement_headers(run.placement),
            **responses.ignored_headers(run.parsed),
        }
        return web.json_response(body, headers=headers)

    async def _respond_stream(self, request: web.Request, run: RequestRun) -> web.StreamResponse:
        parsed, rid = run.parsed, run.rid
        writer = StreamWriter(run, int(time.time()))
        resp: web.StreamResponse | None = None
        async with contextlib.aclosing(run.pieces()) as pieces:
            try:
                async for p, piece in pieces:
                    if resp is None:
                        resp = await self._open_stream(request, run, writer)
                    for event in writer.events(p, piece):
                        await resp.write(event)
            except APIError as e:
                if resp is None:
                    raise
                log.warning("stream %s failed after it started: %s", rid, e.message)
                await resp.write(responses.sse_event(e.body()))
                await resp.write(responses.SSE_DONE)
                await resp.write_eof()
                raise _StreamFailed(resp) from e
        assert resp is not None
        if parsed.include_usage:
            usage = responses.usage_chunk(parsed, rid, writer.created, run.usage())
            await resp.write(responses.sse_event(usage))
        await resp.write(responses.SSE_DONE)
        await resp.write_eof()
        return resp

    @staticmethod
    async def _open_stream(
        request: web.Request, run: RequestRun, writer: StreamWriter
    ) -> web.StreamResponse:
        """Send the headers (held back until the first piece so that an early failure can
        still be a plain HTTP error with a JSON body) and, for chat, the role chunks."""
        resp = web.StreamResponse(
            headers=responses.stream_headers(run.rid, run.placement, run.parsed)
        )
        await resp.prepare(request)
        for event in writer.role_events():
            await resp.write(event)
        return resp


class _StreamFailed(APIError):
    """A stream that already sent its headers and then failed: the error event is written."""

    def __init__(self, resp: web.StreamResponse) -> None:
        super().__init__(500, "stream failed")
        self.resp = resp

    def response(self) -> web.StreamResponse:  # type: ignore[override]
        return self.resp
