"""Cross-origin requests (CORS), so a web page may call the API from a browser, as vLLM and
SGLang allow by default (`--allowed-origins`, default "*").

`install_cors(app, allowed_origins)` puts `Cors(origins)`'s two hooks on the router's app:
- `middleware`, first in the chain: answers a browser's preflight (`OPTIONS` with `Origin` and
  `Access-Control-Request-Method`) itself, before the key check, since a browser never sends a
  key on a preflight; a preflight from an origin not allowed is a 403 with an OpenAI error body.
- `on_prepare` (aiohttp's `on_response_prepare`): adds the allow headers to every answer to an
  allowed origin while its headers are still unsent, so streams and error answers carry them
  too. tandem's own headers (`X-Request-Id`, `X-Tandem-*`, `Retry-After`) are exposed to the
  page's script.

No credentials mode: the API key travels in `Authorization`, which a page sets itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from router.errors import APIError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ANY = "*"
METHODS = "GET, POST, DELETE, OPTIONS"
EXPOSED = (
    "X-Request-Id, X-Tandem-Ignored-Fields, X-Tandem-Path, X-Tandem-Prefill-Worker, "
    "X-Tandem-Decode-Worker, Retry-After"
)
PREFLIGHT_MAX_AGE_S = 600


def parse_origins(value: str) -> tuple[str, ...]:
    """`--allowed-origins`: "*", or comma-separated origins (`https://app.example:8443`);
    "" allows none (no CORS headers, no preflight answers)."""
    origins = tuple(o.strip().rstrip("/") for o in value.split(",") if o.strip())
    for origin in origins:
        if origin != ANY and "://" not in origin:
            raise ValueError(
                f"allowed origin {origin!r} is not '*' or scheme://host[:port] (e.g. "
                "https://app.example.com)"
            )
    return origins


class Cors:
    def __init__(self, origins: tuple[str, ...]) -> None:
        self.any = ANY in origins
        self.origins = frozenset(origins)

    def allowed(self, origin: str | None) -> bool:
        return origin is not None and (self.any or origin in self.origins)

    def _allow_origin(self, origin: str) -> dict[str, str]:
        if self.any:
            return {"Access-Control-Allow-Origin": ANY}
        # The answer depends on the Origin header: caches must key on it.
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        wanted = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or origin is None or wanted is None:
            return await handler(request)
        if not self.allowed(origin):
            return APIError(403, f"origin {origin!r} may not call this API (CORS)").response()
        asked = request.headers.get("Access-Control-Request-Headers", "")
        headers = self._allow_origin(origin) | {
            "Access-Control-Allow-Methods": METHODS,
            "Access-Control-Allow-Headers": asked or "Authorization, Content-Type",
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
        }
        return web.Response(status=204, headers=headers)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if not self.allowed(origin) or request.method == "OPTIONS":
            return
        assert origin is not None
        for name, value in self._allow_origin(origin).items():
            if name == "Vary" and response.headers.get("Vary"):
                value = f"{response.headers['Vary']}, {value}"
            response.headers[name] = value
        response.headers["Access-Control-Expose-Headers"] = EXPOSED


def install_cors(app: web.Application, allowed_origins: str) -> None:
    """The hooks on `app` (before it starts), the preflight answer first among the middlewares;
    nothing when no origin is allowed."""
    origins = parse_origins(allowed_origins)
    if not origins:
        return
    cors = Cors(origins)
    app.middlewares.insert(0, cors.middleware)
    app.on_response_prepare.append(cors.on_prepare)
