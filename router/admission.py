"""Bounded admission: how many requests this router lets wait for their first token.

Lifecycle of a `Ticket`: `AdmissionControl.admit()` either refuses the request at once (429
`queue_full`, with a Retry-After estimate) or queues it -> `Ticket.started()` when its first
output token arrives (it leaves the queue: the workers are serving it) -> `Ticket.done()` when
the request ends whichever way (idempotent; a ticket still queued then leaves the queue too).
So the queue is "admitted, not yet given a first token": the backlog the workers have not
reached. Without a bound a burst would wait in that backlog until `request_timeout_s` turns it
into 504s; with one, the excess is told at once to come back later.

Limits (0 = unlimited for that limit): `max_queued_requests` and `max_queued_prompt_tokens`.
A request whose prompt alone is over the token limit is still admitted when nothing is queued,
so a big prompt waits its turn instead of being refused forever.

Retry-After for a 429 is the queued prompt tokens over the rate at which queued tokens have been
leaving the queue (served: `started()`), clamped to [1, 60] s; 1 s before any observation. The
rate is exponentially weighted tokens over exponentially weighted *busy* time (time with the
queue non-empty), so idle periods do not read as a slow service and a stall with requests
waiting lowers the rate as it lasts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.errors import APIError

# Weight of past observations falls by e every this many seconds of busy time.
RATE_TIME_CONSTANT_S = 10.0
MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60

_QUEUED, _STARTED, _DONE = "queued", "started", "done"


@dataclass(slots=True)
class Ticket:
    """One admitted request's place in the queue; end it with `started()` and/or `done()`."""

    request_id: str
    prompt_tokens: int
    control: AdmissionControl = field(repr=False)
    state: str = _QUEUED

    def __post_init__(self) -> None:
        if isinstance(self.prompt_tokens, bool) or self.prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be an int >= 0, got {self.prompt_tokens!r}")

    @property
    def queued(self) -> bool:
        return self.state == _QUEUED

    def started(self) -> None:
        """The first output token arrived: the request leaves the queue (served)."""
        if self.state == _QUEUED:
            self.state = _STARTED
            self.control._leave(self, served=True)

    def done(self) -> None:
        """The request ended (answered, failed or cancelled); safe to call more than once."""
        if self.state == _QUEUED:
            self.control._leave(self, served=False)
        self.state = _DONE


class AdmissionControl:
    """Counts this router's queued requests and refuses those over the limits."""

    def __init__(
        self,
        max_queued_requests: int,
        max_queued_prompt_tokens: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        rate_time_constant_s: float = RATE_TIME_CONSTANT_S,
    ) -> None:
        for name, value in (
            ("max_queued_requests", max_queued_requests),
            ("max_queued_prompt_tokens", max_queued_prompt_tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (0: unlimited), got {value!r}")
        if not rate_time_constant_s > 0:
            raise ValueError(f"rate_time_constant_s must be > 0, got {rate_time_constant_s!r}")
        self.max_queued_requests = max_queued_requests
        self.max_queued_prompt_tokens = max_queued_prompt_tokens
        self.queued_requests = 0
        self.queued_prompt_tokens = 0
        self._clock = clock
        self._tau = rate_time_constant_s
        # Exponentially weighted served tokens and busy seconds; their ratio is the rate.
        self._served_tokens = 0.0
        self._busy_s = 0.0
        self._busy_mark: float | None = None  # start of the busy time not yet accounted

    def check_room(self) -> None:
        """Raise the 429 at once when no request at all could be admitted now: the router
        calls this before it reads and parses a body, so that refusals stay cheap however
        busy it is (the token limit needs the prompt, and is checked by `admit`)."""
        reason = self._requests_full()
        if reason is not None:
            self._refuse(reason)

    def admit(self, request_id: str, prompt_tokens: int) -> Ticket:
        """Queue a request, or raise APIError 429 `queue_full` (with `retry_after`)."""
        reason = self._over_limit(prompt_tokens)
        if reason is not None:
            self._refuse(reason)
        ticket = Ticket(request_id, prompt_tokens, self)
        if self.queued_requests == 0:
            self._busy_mark = self._clock()  # idle time before this is not service time
        self.queued_requests += 1
        self.queued_prompt_tokens += prompt_tokens
        return ticket

    def _refuse(self, reason: str) -> None:
        raise APIError(
            429,
            f"the router's queue is full ({reason}); retry after the Retry-After delay",
            code="queue_full",
            retry_after=self.retry_after_s(),
        )

    def _requests_full(self) -> str | None:
        max_requests = self.max_queued_requests
        if max_requests and self.queued_requests + 1 > max_requests:
            return f"{self.queued_requests} requests waiting, limit {max_requests}"
        return None

    def _over_limit(self, prompt_tokens: int) -> str | None:
        max_tokens = self.max_queued_prompt_tokens
        if (reason := self._requests_full()) is not None:
            return reason
        if (
            max_tokens
            and self.queued_requests > 0
            and self.queued_prompt_tokens + prompt_tokens > max_tokens
        ):
            return (
                f"{self.queued_prompt_tokens} prompt tokens waiting, this request has "
                f"{prompt_tokens}, limit {max_tokens}"
            )
        return None

    def service_rate(self) -> float | None:
        """Queued prompt tokens served per busy second, recently; None before any."""
        if self._served_tokens <= 0:
            return None
        busy = self._busy_s
        if self.queued_requests and self._busy_mark is not None:
            # Time waited since the last departure counts now, so a stall lowers the rate.
            pending = max(self._clock() - self._busy_mark, 0.0)
            tokens = self._served_tokens * math.exp(-pending / self._tau)
            busy = busy * math.exp(-pending / self._tau) + pending
            return tokens / busy if busy > 0 else None
        return self._served_tokens / busy if busy > 0 else None

    def retry_after_s(self) -> int:
        """Whole seconds until the queued prompt tokens are likely served, in [1, 60]."""
        rate = self.service_rate()
        if rate is None or rate <= 0:
            return MIN_RETRY_AFTER_S
        wait = math.ceil(self.queued_prompt_tokens / rate)
        return max(MIN_RETRY_AFTER_S, min(MAX_RETRY_AFTER_S, wait))

    def _leave(self, ticket: Ticket, *, served: bool) -> None:
        now = self._clock()
        # A request that leaves unserved (cancelled, failed) still used up busy time.
        self._observe(ticket.prompt_tokens if served else 0, now)
        self.queued_requests -= 1
        self.queued_prompt_tokens -= ticket.prompt_tokens
        self._busy_mark = now if self.queued_requests else None

    def _observe(self, tokens: int, now: float) -> None:
        dt = 0.0 if self._busy_mark is None else max(now - self._busy_mark, 0.0)
        decay = math.exp(-dt / self._tau)
        self._served_tokens = self._served_tokens * decay + tokens
        self._busy_s = self._busy_s * decay + dt
