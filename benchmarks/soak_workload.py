"""The soak's request mix and how each answer is judged (benchmarks/soak.py drives them).

`build_workload(count, seed, ctx)` draws a seeded list of `RequestSpec`s from `MIX`:
completions and chats, streamed and not, prompts below and above the server's
--disagg-threshold (some sharing a prefix, so the prefix cache hits and evicts), n=2, logprobs,
client aborts (a stream closed after a chunk or two; a plain request cancelled while it runs)
and bad requests that must be refused with a 4xx. Good requests use ignore_eos, so their usage
is known in advance: the prompt's tokens (token-id prompts; chats counted with the model's
chat template) and n * max_tokens completion tokens.

`run_one(http, url, spec)` sends one and returns an `Outcome`: ok (200 and the answer checks
out: `check_body` / `check_events`), aborted (the client gave up as planned), refused (a bad
request's 4xx with an OpenAI error body) or failed (anything else, with the reason).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

# --------------------------------------------------------------------------- the workload


@dataclass(slots=True, frozen=True)
class RequestSpec:
    """One request of the mix and what its answer must be."""

    index: int
    kind: str
    path: str
    body: dict[str, Any] | None
    raw: bytes | None = None  # a body that is not JSON (bad requests)
    stream: bool = False
    good: bool = True  # False: a 4xx is the right answer
    n: int = 1
    max_tokens: int = 0
    prompt_tokens: int = 0
    long: bool = False
    logprobs: bool = False
    abort_after_chunks: int = 0  # > 0: close the stream after this many events
    abort_after_s: float = 0.0  # > 0: cancel a non-streamed request after this long

    def __post_init__(self) -> None:
        if (self.body is None) == (self.raw is None):
            raise ValueError(f"request {self.index}: give exactly one of body and raw")
        if self.good and not (self.n >= 1 and self.max_tokens >= 1 and self.prompt_tokens >= 1):
            raise ValueError(f"request {self.index}: a good request needs n, max_tokens, prompt")


# kind -> weight. "abort_*" are good requests the client gives up on; "bad" must be refused.
MIX = {
    "completion": 16,
    "completion_stream": 16,
    "chat": 12,
    "chat_stream": 12,
    "n2": 8,
    "logprobs": 10,
    "abort_stream": 10,
    "abort_wait": 6,
    "bad": 10,
}
_WORDS = "alpha beta gamma delta river stone cloud light paper window garden music".split()


@dataclass(slots=True)
class WorkloadContext:
    model: str  # served model name
    vocab: int
    threshold: int  # --disagg-threshold of the server
    max_model_len: int
    chat_len: Any  # messages -> prompt tokens (the model's chat template)
    prefixes: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.vocab <= 8 or self.threshold < 2:
            raise ValueError(f"vocab {self.vocab} / threshold {self.threshold} too small")
        rng = random.Random(1234)  # shared prefixes: the prefix cache hits and evicts
        self.prefixes = [[rng.randrange(4, self.vocab) for _ in range(48)] for _ in range(4)]


def _prompt_ids(rng: random.Random, ctx: WorkloadContext, long: bool) -> list[int]:
    if not long:
        return [rng.randrange(4, ctx.vocab) for _ in range(rng.randint(4, ctx.threshold - 1))]
    n = rng.randint(ctx.threshold + 8, ctx.threshold * 4)
    head = list(rng.choice(ctx.prefixes)) if rng.random() < 0.5 else []
    return head + [rng.randrange(4, ctx.vocab) for _ in range(n - len(head))]


def _messages(rng: random.Random, ctx: WorkloadContext, long: bool) -> list[dict[str, str]]:
    words = rng.randint(ctx.threshold, ctx.threshold * 3) if long else rng.randint(2, 20)
    text = " ".join(rng.choice(_WORDS) for _ in range(words))
    return [{"role": "user", "content": text}]


def _good_spec(i: int, kind: str, rng: random.Random, ctx: WorkloadContext) -> RequestSpec:
    chat = kind.startswith("chat") or (kind != "completion" and rng.random() < 0.4)
    if kind in ("completion", "completion_stream"):
        chat = False
    long = rng.random() < 0.3
    stream = kind.endswith("_stream") or (kind in ("n2", "logprobs") and rng.random() < 0.3)
    n = 2 if kind == "n2" else 1
    max_tokens = rng.randint(48, 96) if kind.startswith("abort") else rng.randint(1, 16)
    body: dict[str, Any] = {"model": ctx.model, "max_tokens": max_tokens, "ignore_eos": True}
    body |= {"temperature": 0.8, "seed": i} if n > 1 or rng.random() < 0.3 else {}
    if chat:
        body["messages"] = _messages(rng, ctx, long)
        prompt_tokens = ctx.chat_len(body["messages"])
    else:
        body["prompt"] = _prompt_ids(rng, ctx, long)
        prompt_tokens = len(body["prompt"])
    logprobs = kind == "logprobs" and not stream
    if kind == "logprobs":
        body |= {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
    body["n"] = n
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return RequestSpec(
        i, kind, path, body, stream=stream, n=n, max_tokens=max_tokens,
        prompt_tokens=prompt_tokens, long=prompt_tokens >= ctx.threshold, logprobs=logprobs,
        abort_after_chunks=rng.randint(1, 2) if kind == "abort_stream" else 0,
        abort_after_s=rng.uniform(0.02, 0.1) if kind == "abort_wait" else 0.0,
    )  # fmt: skip


def _bad_spec(i: int, rng: random.Random, ctx: WorkloadContext) -> RequestSpec:
    base = {"model": ctx.model, "prompt": [5, 6, 7], "max_tokens": 4}
    variants: list[tuple[str, dict[str, Any] | None, bytes | None]] = [
        ("/v1/completions", base | {"model": "no-such-model"}, None),
        ("/v1/completions", base | {"max_tokens": -1}, None),
        ("/v1/completions", base | {"n": 0}, None),
        ("/v1/completions", base | {"temperature": "hot"}, None),
        ("/v1/completions", base | {"prompt": [5] * (ctx.max_model_len + 1)}, None),
        ("/v1/completions", None, b'{"model": "m", "prompt": '),
        ("/v1/chat/completions", {"model": ctx.model, "max_tokens": 4}, None),
        ("/v1/chat/completions", {"model": ctx.model, "messages": "hi"}, None),
    ]
    path, body, raw = rng.choice(variants)
    return RequestSpec(i, "bad", path, body, raw=raw, good=False)


def build_workload(count: int, seed: int, ctx: WorkloadContext) -> list[RequestSpec]:
    rng = random.Random(seed)
    kinds, weights = zip(*MIX.items(), strict=True)
    out = []
    for i in range(count):
        kind = rng.choices(kinds, weights)[0]
        out.append(_bad_spec(i, rng, ctx) if kind == "bad" else _good_spec(i, kind, rng, ctx))
    return out


def build_multiturn_workload(
    count: int, seed: int, ctx: WorkloadContext, turns: int = 4, active: int = 16
) -> list[RequestSpec]:
    """Multi-turn chats (`--mix multiturn`, issue 24's soak): `active` conversations at a
    time, each turn picked from a random one, its prompt the previous turn's plus a stand-in
    answer (seeded ids, as long as that turn's max_tokens) and 8-24 new tokens; a conversation
    ends after `turns` turns and a new one starts. Greedy token-id completions, half streamed,
    so prefix caches, the host tier and the router's index fill, evict and turn over."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(4, ctx.vocab) for _ in range(n)]  # noqa: E731
    convs: list[tuple[list[int], int]] = []
    out: list[RequestSpec] = []
    while len(out) < count:
        while len(convs) < active:
            convs.append((ids(rng.randint(ctx.threshold + 8, 2 * ctx.threshold)), turns))
        j = rng.randrange(len(convs))
        prompt, left = convs[j]
        max_tokens, stream = rng.randint(4, 16), rng.random() < 0.5
        body: dict[str, Any] = {"model": ctx.model, "prompt": prompt, "max_tokens": max_tokens}
        body |= {"ignore_eos": True, "temperature": 0, "n": 1}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        kind = "multiturn_stream" if stream else "multiturn"
        out.append(RequestSpec(
            len(out), kind, "/v1/completions", body, stream=stream, max_tokens=max_tokens,
            prompt_tokens=len(prompt), long=len(prompt) >= ctx.threshold,
        ))  # fmt: skip
        nxt = prompt + ids(max_tokens) + ids(rng.randint(8, 24))
        if left <= 1 or len(nxt) + 16 > ctx.max_model_len:
            convs.pop(j)
        else:
            convs[j] = (nxt, left - 1)
    return out


# --------------------------------------------------------------------------- sending


@dataclass(slots=True)
class Outcome:
    """What one request got: result is ok, aborted (the client gave up, as planned), refused
    (a bad request's 4xx) or failed (anything else; `error` says what)."""

    index: int
    kind: str
    status: int | None
    result: str
    error: str = ""
    latency_s: float = 0.0
    long: bool = False


def check_usage(spec: RequestSpec, usage: Any) -> str:
    if not isinstance(usage, dict):
        return f"no usage object: {usage!r}"
    want = (spec.prompt_tokens, spec.n * spec.max_tokens)
    got = (usage.get("prompt_tokens"), usage.get("completion_tokens"))
    if got != want:
        return f"usage (prompt, completion) {got} != expected {want}"
    if usage.get("total_tokens") != sum(want):
        return f"total_tokens {usage.get('total_tokens')} != {sum(want)}"
    return ""


def check_body(spec: RequestSpec, body: dict[str, Any]) -> str:
    """A whole JSON answer: n choices, each cut by length (ignore_eos), logprobs when asked."""
    choices = body.get("choices") or []
    if sorted(c.get("index") for c in choices) != list(range(spec.n)):
        return f"choice indexes {[c.get('index') for c in choices]} for n={spec.n}"
    for c in choices:
        if c.get("finish_reason") != "length":
            return f"finish_reason {c.get('finish_reason')!r} with ignore_eos (want 'length')"
        if spec.logprobs:
            lp = c.get("logprobs") or {}
            entries = lp.get("content") if "chat" in spec.path else lp.get("tokens")
            if not entries or len(entries) != spec.max_tokens:
                return f"{len(entries or [])} logprob entries for {spec.max_tokens} tokens"
    return check_usage(spec, body.get("usage"))


def check_events(spec: RequestSpec, events: list[Any]) -> str:
    """A whole SSE stream: no error event, a finish_reason per choice, usage, then [DONE]."""
    if not events or events[-1] != "[DONE]":
        return f"stream ended without [DONE] after {len(events)} events"
    errors = [e["error"] for e in events[:-1] if "error" in e]
    if errors:
        return f"error event: {errors[0]}"
    finished = {
        c.get("index"): c["finish_reason"]
        for e in events[:-1]
        for c in e.get("choices") or []
        if c.get("finish_reason")
    }
    if finished != dict.fromkeys(range(spec.n), "length"):
        return f"finish reasons {finished} for n={spec.n} with ignore_eos"
    usage = [e["usage"] for e in events[:-1] if e.get("usage")]
    return check_usage(spec, usage[-1] if usage else None)


async def _exchange(http: Any, url: str, spec: RequestSpec) -> Outcome:
    def done(status: int | None, error: str, result: str = "") -> Outcome:
        result = result or ("failed" if error else "ok")
        return Outcome(spec.index, spec.kind, status, result, error, long=spec.long)

    if spec.raw is not None:
        kwargs: dict[str, Any] = {"data": spec.raw, "headers": {"Content-Type": "application/json"}}
    else:
        kwargs = {"json": spec.body}
    async with http.post(url + spec.path, **kwargs) as resp:
        if not spec.good or resp.status != 200:
            text = await resp.text()
            refused = not spec.good and 400 <= resp.status < 500 and '"error"' in text
            return done(resp.status, "" if refused else f"HTTP {resp.status}: {text[:200]}",
                        "refused" if refused else "failed")  # fmt: skip
        if not spec.stream:
            return done(200, check_body(spec, await resp.json()))
        events: list[Any] = []
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
            if spec.abort_after_chunks and len(events) >= spec.abort_after_chunks:
                resp.close()  # the client goes away mid-stream: the server must abort it
                return done(200, "", "aborted")
        return done(200, check_events(spec, events))


async def run_one(http: Any, url: str, spec: RequestSpec) -> Outcome:
    import aiohttp

    t0 = time.perf_counter()
    try:
        if spec.abort_after_s:
            try:
                out = await asyncio.wait_for(_exchange(http, url, spec), spec.abort_after_s)
            except TimeoutError:  # cancelled while the server works on it
                out = Outcome(spec.index, spec.kind, None, "aborted", long=spec.long)
        else:
            out = await _exchange(http, url, spec)
    except (aiohttp.ClientError, ValueError, TimeoutError) as e:
        out = Outcome(spec.index, spec.kind, None, "failed", f"{type(e).__name__}: {e}")
    out.latency_s = time.perf_counter() - t0
    return out
