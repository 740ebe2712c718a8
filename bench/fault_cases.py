"""Fault cases on a live `tandem serve`: inject one fault under load, judge every request.

Each case sends greedy requests (their reference texts taken from the healthy server first),
injects its fault while they are in flight, and records per request correct / clear error /
wrong (`bench.fault_requests`), the KV blocks not back on the surviving workers once the dust
settles, and the recovery time (fault to the first fresh request answered correctly with
`/ready` 200). Used by tests/faults/ (few requests, bounded time) and benchmarks/faults.py
(the table in benchmarks/README.md). Which outcome is right is the caller's to assert: a
decode worker killed mid-stream can only end its streams with clear errors, a prefill worker
killed during the READ must cost nothing under "recompute", and so on.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Awaitable, Callable

from bench import fault_requests as fr
from bench.live_server import LiveServer

RECOVERY_TIMEOUT_S = 120.0
PROMPTS = (
    "the quick brown fox jumps over the lazy dog and runs far away",
    "a long time ago in a galaxy far far away there lived a small robot",
    "once upon a time there was a king who had three daughters and a cat",
)


def prompts(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] + f" #{i}" for i in range(n)]


async def references(url: str, texts: list[str], max_tokens: int) -> dict[str, str]:
    """The healthy server's greedy answer to each distinct prompt."""
    async with fr.session() as s:
        uniq = sorted(set(texts))
        outs = await asyncio.gather(*(_reference(s, url, p, max_tokens) for p in uniq))
    return dict(zip(uniq, outs, strict=True))


async def _reference(session, url: str, prompt: str, max_tokens: int) -> str:
    body = fr.completion_body(prompt, max_tokens, False)
    async with session.post(url + "/v1/completions", json=body) as r:
        body = await r.json()
        if r.status != 200:
            raise RuntimeError(f"reference request failed: {r.status} {body}")
        return body["choices"][0]["text"]


async def under_fault(
    server: LiveServer,
    tally: fr.Tally,
    n: int,
    max_tokens: int,
    inject: Callable[[], Awaitable[None]],
    deadline_s: float = 60.0,
    inject_after_s: float | None = None,
) -> tuple[str, str]:
    """n streams; once every one has its first text (or 10 s passed), or `inject_after_s`
    after they were sent, `inject()`; then judge them all (each must end within
    `deadline_s`). Returns one (prompt, reference) pair for the recovery probe."""
    texts = prompts(n)
    refs = await references(server.url, texts, max_tokens)
    async with fr.session(deadline_s + 30) as s:
        tasks, started = launch_streams(s, server.url, texts, refs, max_tokens, deadline_s)
        if inject_after_s is None:
            await wait_started(started, tasks, 10.0)
        else:
            await asyncio.sleep(inject_after_s)
        await inject()
        tally.outcomes += await asyncio.gather(*tasks)
    return texts[0], refs[texts[0]]


def launch_streams(
    session, url: str, texts: list[str], refs: dict[str, str], max_tokens: int, deadline_s: float
) -> tuple[list[asyncio.Task], list[asyncio.Event]]:
    """One judged stream per prompt, running; each event is set at its stream's first text."""
    started = [asyncio.Event() for _ in texts]
    tasks = [
        asyncio.create_task(
            fr.guarded(fr.stream(session, url, p, max_tokens, refs[p], ev), deadline_s)
        )
        for p, ev in zip(texts, started, strict=True)
    ]
    return tasks, started


async def wait_started(
    events: list[asyncio.Event], tasks: list[asyncio.Task], timeout_s: float
) -> None:
    """Until every stream has its first text (or ended), or `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(e.is_set() or t.done() for e, t in zip(events, tasks, strict=True)):
            return
        await asyncio.sleep(0.02)


async def recover(
    server: LiveServer, since: float, probe: tuple[str, str], max_tokens: int
) -> tuple[float, bool]:
    """Seconds from `since` (monotonic) until `probe`'s prompt is answered with its reference
    text and /ready is 200, and whether /ready was seen 503 on the way."""
    (prompt, ref), seen_503 = probe, False
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    async with fr.session(60) as s:
        while time.monotonic() < deadline:
            status, _ = await asyncio.to_thread(server.get, "/ready")
            seen_503 |= status == 503
            if status == 200:
                out = await fr.guarded(fr.whole(s, server.url, prompt, max_tokens, ref), 60)
                if out.kind == fr.CORRECT:
                    return time.monotonic() - since, seen_503
            await asyncio.sleep(0.1)
    raise TimeoutError(f"no recovery within {RECOVERY_TIMEOUT_S}s")


async def settle(server: LiveServer, tally: fr.Tally, timeout_s: float = 40.0) -> None:
    tally.leaked_blocks = await asyncio.to_thread(server.wait_blocks_free, timeout_s)


# -- the cases ---------------------------------------------------------------------------------


async def kill_worker(
    server: LiveServer,
    worker: str,
    policy: str,
    n: int,
    max_tokens: int,
    after_s: float | None = None,
):
    """SIGKILL a worker with n streams in flight: once all have their first text, or
    `after_s` after they were sent (a prefill worker, with the decode worker's READs held
    back longer than that: during the READ)."""
    name = f"SIGKILL {worker}" + (" during READ" if after_s else "")
    return await _signal_worker(server, worker, name, policy, n, max_tokens, after_s, None)


async def stop_worker(
    server: LiveServer,
    worker: str,
    policy: str,
    n: int,
    max_tokens: int,
    stop_s: float,
    after_s: float | None = None,
):
    """SIGSTOP a worker (hung, not dead) for `stop_s`, then SIGCONT; when, as kill_worker."""
    name = f"SIGSTOP {worker} {stop_s:g}s"
    return await _signal_worker(server, worker, name, policy, n, max_tokens, after_s, stop_s)


async def _signal_worker(
    server: LiveServer,
    worker: str,
    case: str,
    policy: str,
    n: int,
    max_tokens: int,
    after_s: float | None,
    stop_s: float | None,
):
    """The fault: SIGKILL (`stop_s` None) or SIGSTOP for `stop_s` then SIGCONT."""
    tally = fr.Tally(case, policy)
    hit_at: list[float] = []

    async def inject() -> None:
        server.kill(worker, signal.SIGKILL if stop_s is None else signal.SIGSTOP)
        hit_at.append(time.monotonic())
        if stop_s is not None:
            resume = lambda: server.kill(worker, signal.SIGCONT)  # noqa: E731
            asyncio.get_running_loop().call_later(stop_s, resume)

    deadline_s = 60 + (stop_s or 0)
    probe = await under_fault(server, tally, n, max_tokens, inject, deadline_s, after_s)
    tally.recovery_s, seen_503 = await recover(server, hit_at[0], probe, max_tokens)
    tally.notes = "/ready 503 seen" if seen_503 else "/ready stayed 200"
    await settle(server, tally)
    return tally


async def plain_load(
    server: LiveServer,
    case: str,
    policy: str,
    n: int,
    max_tokens: int,
    refs: dict[str, str] | None = None,
):
    """n streams with no outside fault: for faults the server was started with (injected
    transfer errors, a receiver that never reads). The load goes first, so that it meets the
    injected faults; it is judged against `refs` (prompt -> text, from a healthy server; by
    default taken from this one after the load)."""
    tally = fr.Tally(case, policy)
    texts = prompts(n)
    async with fr.session(150) as s:
        outs = await asyncio.gather(
            *(fr.guarded(fr.stream(s, server.url, p, max_tokens, None), 120) for p in texts)
        )
    refs = refs or await references(server.url, texts, max_tokens)
    tally.outcomes += [o.judge(refs[p]) for o, p in zip(outs, texts, strict=True)]
    await settle(server, tally)
    return tally


async def abort_storm(server: LiveServer, n: int = 100, max_tokens: int = 64, seed: int = 0):
    """n streams whose clients disconnect around their first token (just before, at, or just
    after it); then n//10 requests that must be answered correctly."""
    tally = fr.Tally(f"abort storm ({n} disconnects)", "")
    rng = random.Random(seed)
    texts = prompts(n)

    async def one(s, prompt: str) -> None:
        delay = rng.choice([0.0, 0.005, 0.02, 0.05])
        try:
            async with s.post(
                server.url + "/v1/completions", json=fr.completion_body(prompt, max_tokens, True)
            ) as resp:
                if rng.random() < 0.5:
                    await resp.content.readline()  # the first chunk, then go away
                await asyncio.sleep(delay)
        except Exception:  # noqa: BLE001 - the client is the one hanging up
            pass

    async with fr.session(60) as s:
        await asyncio.gather(*(one(s, p) for p in texts))
    follow = prompts(max(3, n // 10))
    refs = await references(server.url, follow, 16)
    async with fr.session(60) as s:
        tally.outcomes += await asyncio.gather(
            *(fr.guarded(fr.whole(s, server.url, p, 16, refs[p]), 60) for p in follow)
        )
    await settle(server, tally)
    tally.notes = f"then {len(follow)} requests judged"
    return tally


async def kill_controller(server: LiveServer, n: int, max_tokens: int):
    """SIGKILL the controller with streams in flight: Ray restarts it, it rebuilds its
    registry from the worker actors, and serving never stops meanwhile."""
    tally = fr.Tally("SIGKILL controller", "")
    killed_at: list[float] = []

    async def inject() -> None:
        server.kill("controller", signal.SIGKILL)
        killed_at.append(time.monotonic())

    probe = await under_fault(server, tally, n, max_tokens, inject)
    deadline = time.monotonic() + 60
    while "controller recovered" not in server.log_text() and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    tally.recovery_s, _ = await recover(server, killed_at[0], probe, max_tokens)
    tally.notes = (
        "registry rebuilt" if "controller recovered" in server.log_text() else "NOT rebuilt"
    )
    await settle(server, tally)
    return tally


async def restart_router(server: LiveServer, workdir, n: int, max_tokens: int):
    """A second router attached to the deployment (`--router-only`) is SIGKILLed with n
    streams in flight, then started again. Its clients lose their connections (nothing can
    answer them); the workers must abort those requests at once (not decode them to the end),
    and the new router must serve."""
    tally = fr.Tally("router SIGKILL + restart", "")
    flags = ("--router-only", "--address", server.ray_address(), "--disagg-threshold", "8")
    router = LiveServer(server.model, workdir, *flags, router_only=True).start()
    texts = prompts(n)
    refs = await references(router.url, texts, max_tokens)
    aborts_before = _worker_aborts(server)
    async with fr.session(120) as s:
        tasks, started = launch_streams(s, router.url, texts, refs, max_tokens, 60)
        await wait_started(started, tasks, 10.0)
        router.kill("router", signal.SIGKILL)
        t0 = time.monotonic()
        lost = await asyncio.gather(*tasks)
    # The killed router's clients can only see their connection drop: not judged.
    tally.notes = f"{sum(o.status == 0 for o in lost)} of {n} client connections dropped"
    tally.leaked_blocks = await asyncio.to_thread(server.wait_blocks_free, 30)
    freed_s = time.monotonic() - t0
    aborted = _worker_aborts(server) - aborts_before
    tally.notes += f"; workers aborted {aborted:g} requests, blocks back {freed_s:.1f}s after"
    router.stop()
    router = LiveServer(server.model, workdir, *flags, router_only=True).start()
    try:
        async with fr.session(60) as s:
            tally.outcomes += await asyncio.gather(
                *(fr.guarded(fr.whole(s, router.url, p, max_tokens, refs[p]), 60) for p in texts)
            )
        tally.recovery_s = time.monotonic() - t0
    finally:
        router.stop()
    return tally


def _worker_aborts(server: LiveServer) -> float:
    return sum(v for k, v in server.metrics().items() if k.startswith("tandem_worker_aborts"))
