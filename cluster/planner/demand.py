"""What load the pools must carry: length distributions, the arrival-rate forecast, and the
`Workload` the sizing math reads.

Lifecycle: a `DemandTracker` is fed every window (`observe`), in time order. It keeps the
windows of the last `history_s` seconds (their length histograms are merged: one window holds
too few requests for a tail) and a Holt forecast of the arrival rate (level + damped trend,
updated once per window). `forecast_rate()` is the rate expected when a worker asked for now
would be ready (`startup_s + interval_s` ahead). The planner scales up on the larger of it and
the last window's rate (`up_rate`) when that window's excess work outlives a start-up
(`spike_outlives_startup`: a worker asked for a spike that is over before it serves buys
nothing), and down only when a smaller pool carries the forecast plus a margin that grows
with the rate's noise (`down_rate`).

Each forecast is also kept until its window comes and scored against that window's rate
(`horizon_error`): how far the forecast misses over a whole start-up, which on a ramp or a
shifting mix is far more than the one-step noise says. The prefill pool's margins take the
larger of the two (`learned=True`).

`LengthDist` is a length histogram as the sizing math wants it: (share, mean, spread) per
bucket. Inside a bucket the lengths are taken as uniform on the widest interval around the
bucket's mean that stays in the bucket (exact for one repeated length, close for a spread), so
tails (`quantile`) and second moments come out of a histogram without the raw lengths.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import NormalDist

from router.signals import LENGTH_EDGES, LengthHistogram, WindowSignals

from .config import PlannerConfig

# A last window with fewer prompts than this is too thin to size against on its own.
MIN_WINDOW_PROMPTS = 20
NOISE_WEIGHT = 0.05  # EWMA weight of a new squared forecast error
# A pool shrinks only if it would carry the forecast + this many noise SDs. Not fewer: a
# window more than BURST_SIGMAS over the forecast is sized at its own rate, so with 3 a
# Poisson spike's worker is taken back and re-added on a steady load (tests/planner).
NOISE_SIGMAS = 4.0
BURST_SIGMAS = 2.0  # a window this many noise SDs above the forecast is a burst
# A window whose mean prompt or answer is this many standard errors above the history's is
# a length burst. The test runs every window (360 an hour), so its threshold is a multiple-
# testing one: at 2 it fired on the sampling noise of heavy-tailed lengths about 8 times an
# hour on a flat synthetic load, starting a prefill worker each time (7.21 GPU-h, 1.024x the
# static split's); at 3 about once (7.08, 1.006x: a worker for 2 minutes at minute 7); at 3.5
# (a normal statistic's false alarm once in ~12 hours of windows) never (7.04, 1.000x). No
# other trace of the library moved at either step: the length bursts that mattered on the
# Azure traces stood further out.
LENGTH_BURST_SES = 3.5
NOISE_CLIP = 3.0  # forecast errors feed the noise estimate clipped at this many SDs
# SHIFT_WINDOWS windows in a row each more than SHIFT_SIGMAS noise SDs over the forecast are
# a step up in the level, not noise: the level jumps to them. Smoothing alone took 5-6
# windows to follow a 2.5x step, and the pools grew by 2-3 workers a window for a minute and
# then overshot on the backlog (benchmarks/README.md, "a rise re-levelled at once").
SHIFT_SIGMAS = 3.0
SHIFT_WINDOWS = 2
MIN_DIST_SAMPLES = 200  # lengths a distribution needs before it stands for the traffic
# Finished answers stand for the mix once traffic has run as long as this quantile of them
# takes at the TPOT target (see DemandTracker._answer_lengths).
CENSOR_QUANTILE = 0.99
HISTORY_CAP = 10  # windows kept: up to this many history_s (for MIN_DIST_SAMPLES)
# Scored forecasts (see `horizon_error`) are remembered this long; a margin needs this many.
ERROR_MEMORY_S = 1800.0
MIN_ERRORS = 12


@dataclass(slots=True, frozen=True)
class LengthDist:
    """Lengths as (share, mean, half-width) per bucket, ascending; shares sum to 1."""

    parts: tuple[tuple[float, float, float], ...]

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("a LengthDist needs at least one bucket")
        if abs(sum(p for p, _, _ in self.parts) - 1.0) > 1e-6:
            raise ValueError(f"LengthDist shares must sum to 1: {self.parts}")

    @classmethod
    def single(cls, length: float) -> LengthDist:
        return cls(((1.0, float(length), 0.0),))

    @classmethod
    def exponential(cls, mean: float, points: int = 64) -> LengthDist:
        """Lengths exponential around `mean` (as bucketed by a window's histogram): the prior
        for an expected mean length. LLM prompt and answer lengths are long-tailed, and a
        single length would hide the long answers that fill decode batches and the short
        ones that feel the KV hand-off most."""
        hist = LengthHistogram()
        for i in range(points):
            q = (i + 0.5) / points
            hist.add(max(1, round(-mean * math.log(1 - q))))
        dist = cls.of(hist)
        assert dist is not None  # points >= 1 lengths were added
        return dist

    @classmethod
    def of(cls, hist: LengthHistogram) -> LengthDist | None:
        """The histogram's distribution, or None when it is empty."""
        n = hist.count
        if not n:
            return None
        parts = []
        for i, (c, s) in enumerate(zip(hist.counts, hist.sums, strict=True)):
            if not c:
                continue
            mean = s / c
            lo = LENGTH_EDGES[i - 1] if i else 0
            hi = LENGTH_EDGES[i] if i < len(LENGTH_EDGES) else math.inf
            parts.append((c / n, mean, max(0.0, min(mean - lo, hi - mean))))
        return cls(tuple(parts))

    def mean(self) -> float:
        return sum(p * m for p, m, _ in self.parts)

    def second_moment(self) -> float:
        # A uniform spread of half-width w around m adds w^2/3 to m^2.
        return sum(p * (m * m + w * w / 3.0) for p, m, w in self.parts)

    def third_moment(self) -> float:
        # A uniform spread of half-width w around m adds m*w^2 to m^3.
        return sum(p * (m**3 + m * w * w) for p, m, w in self.parts)

    def quantile(self, q: float) -> float:
        seen = 0.0
        for p, m, w in self.parts:
            if seen + p >= q - 1e-12:
                inside = (q - seen) / p if p else 1.0
                return m - w + 2.0 * w * min(max(inside, 0.0), 1.0)
            seen += p
        _, m, w = self.parts[-1]
        return m + w

    def split(self, threshold: float) -> tuple[float, LengthDist | None, LengthDist | None]:
        """(share at or above `threshold`, that part, the part below), by bucket means (the
        router decides per prompt; a bucket's mean stands for its prompts)."""
        above = [x for x in self.parts if x[1] >= threshold]
        below = [x for x in self.parts if x[1] < threshold]
        share = sum(p for p, _, _ in above)
        return share, _renormalised(above), _renormalised(below)


def _renormalised(parts: list[tuple[float, float, float]]) -> LengthDist | None:
    total = sum(p for p, _, _ in parts)
    if total <= 0:
        return None
    return LengthDist(tuple((p / total, m, w) for p, m, w in parts))


@dataclass(slots=True)
class Workload:
    """The load to size the pools for: requests/s, their lengths, the share of prompt tokens
    not already in a prefix cache, and the queues at the last window's end."""

    rate: float
    prompts: LengthDist
    outputs: LengthDist
    uncached: float = 1.0
    queued_prompt_tokens: float = 0.0  # waiting for a first token (router view, all paths)
    prefill_waiting: int = 0  # requests queued inside prefill workers
    decode_running: int = 0
    decode_waiting: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate) and self.rate >= 0):
            raise ValueError(f"rate must be >= 0, got {self.rate}")
        if not (0 <= self.uncached <= 1):
            raise ValueError(f"uncached must be in [0, 1], got {self.uncached}")


@dataclass(slots=True)
class HoltForecast:
    """Double exponential smoothing (level + damped trend) of one series, one step per window."""

    alpha: float
    beta: float
    damping: float
    level: float | None = None
    trend: float = 0.0
    # EWMA of the squared one-step-ahead error: how noisy the series is around its forecast.
    error_var: float = 0.0
    # The values of the windows in a row that stood SHIFT_SIGMAS over the forecast.
    rise: list[float] = field(default_factory=list)

    def update(self, value: float, noise_floor: float = 0.0, alpha: float | None = None) -> None:
        """One step (`alpha`: this step's level smoothing, default the forecast's own). The
        error that feeds the noise estimate is clipped at NOISE_CLIP noise SDs (at least
        `noise_floor`): a level shift is a change, not noise, and must not keep a pool from
        shrinking for the many windows an EWMA takes to forget it. A rise that lasts
        SHIFT_WINDOWS windows re-levels the series at their mean, trend 0 (its errors are a
        change too: they do not feed the noise); a fall is left to the smoothing, as a pool
        shrinks with margins anyway."""
        if self.level is None:
            self.level = value
            return
        error = value - self.forecast(1)
        sd = max(self.noise, noise_floor)
        if sd <= 0 or error <= SHIFT_SIGMAS * sd:
            self.rise.clear()
        else:
            self.rise.append(value)
            if len(self.rise) >= SHIFT_WINDOWS:
                self.level, self.trend = sum(self.rise) / len(self.rise), 0.0
                self.rise.clear()
                return
        limit = NOISE_CLIP * sd
        if limit > 0:
            error = min(max(error, -limit), limit)
        self.error_var += NOISE_WEIGHT * (error * error - self.error_var)
        previous = self.level
        a = self.alpha if alpha is None else alpha
        self.level = a * value + (1 - a) * (previous + self.damping * self.trend)
        self.trend = (
            self.beta * (self.level - previous) + (1 - self.beta) * self.damping * self.trend
        )

    @property
    def noise(self) -> float:
        """Standard deviation of the one-step-ahead error."""
        return math.sqrt(self.error_var)

    def forecast(self, steps: float) -> float:
        """The value `steps` windows ahead (fractional steps allowed), never below 0."""
        if self.level is None:
            return 0.0
        phi = self.damping
        # sum_{i=1..h} phi^i, the damped trend's reach; h windows ahead.
        reach = steps if phi >= 1 else phi * (1 - phi**steps) / (1 - phi)
        return max(0.0, self.level + self.trend * reach)


@dataclass(slots=True)
class DemandTracker:
    """Recent windows, the rate forecast and the length distributions (see the module doc)."""

    config: PlannerConfig
    startup_s: float
    windows: deque[WindowSignals] = field(default_factory=deque)
    holt: HoltForecast = field(init=False)
    # The last non-empty distributions seen: the fallback when recent windows hold none.
    _prompts: LengthDist | None = field(default=None, init=False)
    _outputs: LengthDist | None = field(default=None, init=False)
    # The start of the first window with arrivals: answers are censored until some time after.
    _traffic_from: float | None = field(default=None, init=False)
    # The operator's expected answer mix (expected_output_tokens, exponential), if any.
    _answer_prior: LengthDist | None = field(default=None, init=False)
    _uncached: float = field(default=1.0, init=False)
    # Whether the last window's rate stood out of the noise the forecast expected before it.
    _burst: bool = field(default=False, init=False)
    # The prefill pool's queue-room share (`queue_share`) at the last decision: 1 for a tight
    # TTFT target; the level then smooths over the window and the room (`observe`).
    level_share: float = field(default=1.0, init=False)
    # The decaying peak of uncached prompt tokens arriving within one second (burst hold).
    _peak_1s: float = field(default=0.0, init=False)
    # Forecasts awaiting their window: (end of the window forecast, the rate forecast, the
    # uncached prompt tokens per request of the mix it was made with).
    _pending: deque[tuple[float, float, float]] = field(default_factory=deque, init=False)
    # (window end, its rate less the forecast made a horizon before): see horizon_error.
    _errors: deque[tuple[float, float]] = field(default_factory=deque, init=False)

    def __post_init__(self) -> None:
        c = self.config
        self.holt = HoltForecast(c.forecast_alpha, c.forecast_beta, c.forecast_damping)
        # An operator's expected rate is the forecast's prior: the first window is one noisy
        # sample against it, not the whole truth.
        self.holt.level = c.expected_rate_rps or None
        if c.expected_output_tokens:
            self._answer_prior = LengthDist.exponential(c.expected_output_tokens)
        if c.burst_half_life_s > 0:  # an expected burst is held (and decays) like a seen one
            self._peak_1s = float(c.expected_peak_prompt_tokens_1s or 0.0)

    def observe(self, window: WindowSignals) -> None:
        self.windows.append(window)
        end = window.start_s + window.duration_s
        keep = HISTORY_CAP * self.config.history_s
        while self.windows and _end(self.windows[0]) <= end - keep + 1e-9:
            self.windows.popleft()
        rate = window.arrival_rate
        expected = self.holt.forecast(1)
        poisson = math.sqrt(max(expected, 0.0) / self.config.interval_s)
        if self.holt.level is not None:
            self._burst = rate > expected + BURST_SIGMAS * max(self.holt.noise, poisson)
        self._score_forecasts(window)
        # Under a loose TTFT target the prefill pool carries the rate averaged over a window
        # and its queue room, so the level moves by sqrt(share) of alpha: the same factor the
        # noise terms take for that longer average. On the Mooncake conversation slice (30 s)
        # the level followed each window's Poisson noise of 3 req/s and two windows in three
        # asked for a third prefill worker, where two hold 99.89% (benchmarks/README.md).
        alpha = self.config.forecast_alpha * math.sqrt(self.level_share)
        self.holt.update(rate, poisson, alpha)
        if self._traffic_from is None and window.arrivals > 0:
            self._traffic_from = window.start_s
        prompts = self._recent(end, lambda w: w.prompt_lengths)
        self._prompts = LengthDist.of(prompts) or self._prompts
        self._outputs = self._answer_lengths(end) or self._outputs
        uncached = sum(w.uncached_prompt_tokens for w in self._within(end))
        total = sum(w.prompt_lengths.total for w in self._within(end))
        if total > 0:
            self._uncached = min(1.0, max(0.0, uncached / total))
        self._hold_peak(window)
        due = end + self.startup_s + self.config.interval_s
        self._pending.append((due, self.forecast_rate(), self._work_per_request()))

    def _work_per_request(self) -> float:
        """Uncached prompt tokens per request in the recent mix (0 before any prompt)."""
        prompts = self._prompts
        return prompts.mean() * self._uncached if prompts is not None else 0.0

    def _score_forecasts(self, window: WindowSignals) -> None:
        """The forecasts made for this window meet its work; the oldest scores are dropped.
        A window is scored in the prefill work it brought (uncached prompt tokens) over the
        tokens per request of the mix the forecast was made with: a rate in requests/s that
        also counts a shift toward longer prompts, which the pool computes as surely as more
        requests (Azure conversation x20, minute 42: prompts 800 -> 1,270 tokens at the same
        rate)."""
        end = _end(window)
        while self._pending and self._pending[0][0] <= end + 1e-9:
            due, forecast, work = self._pending.popleft()
            if due > window.start_s + 1e-9:  # not one for a window that never came
                rate = window.arrival_rate
                if work > 0:
                    rate = window.uncached_prompt_tokens / window.duration_s / work
                self._errors.append((end, rate - forecast))
        while self._errors and self._errors[0][0] <= end - ERROR_MEMORY_S + 1e-9:
            self._errors.popleft()

    def horizon_error(self, q: float) -> float | None:
        """The q-quantile of how far the rate came out above the forecast made a horizon
        (a start-up and a window) before it, in requests/s, over the last ERROR_MEMORY_S;
        None before MIN_ERRORS forecasts have met their windows. Holt's own noise is its
        one-step error: a ramp or a shift that it follows a window late looks small there
        and large here, and a worker asked for now serves only a horizon later."""
        if len(self._errors) < MIN_ERRORS:
            return None
        errors = sorted(e for _, e in self._errors)
        return errors[min(len(errors) - 1, int(q * len(errors)))]

    def _margin(self, sigmas: float, learned: bool) -> float:
        """`sigmas` SDs of the one-step noise, or with `learned` at least the horizon error
        at the same confidence (the normal quantile of `sigmas`, 0.69 for 0.5): on a steady
        load the two agree, so the learned margin only adds where the forecast has missed
        by more over a horizon than its noise says."""
        noise = sigmas * self.noise()
        if not learned:
            return noise
        error = self.horizon_error(NormalDist().cdf(sigmas))
        return noise if error is None else max(noise, error)

    def _hold_peak(self, window: WindowSignals) -> None:
        """The window's 1-s peak joins the hold, which halves every `burst_half_life_s`."""
        half_life = self.config.burst_half_life_s
        if half_life <= 0:
            self._peak_1s = 0.0
            return
        decayed = self._peak_1s * 0.5 ** (window.duration_s / half_life)
        self._peak_1s = max(decayed, window.peak_prompt_tokens_1s * self._uncached)

    @property
    def held_peak_tokens_1s(self) -> float:
        """The burst the prefill pool holds capacity for: uncached prompt tokens arriving
        within one second, the recent peak decayed by its age (0 with the hold off)."""
        return self._peak_1s

    def _within(self, end: float) -> list[WindowSignals]:
        return [w for w in self.windows if _end(w) > end - self.config.history_s + 1e-9]

    def _answer_lengths(self, end: float) -> LengthDist | None:
        """The answer-length mix. Answers are counted when they finish, so in the first
        seconds of traffic only the short ones have: the mix is censored until traffic has
        run as long as its long answers take (`CENSOR_QUANTILE` of the answers, the
        operator's expected ones included, at the TPOT target). Until then the longer of the
        finished answers' mix and the operator's expected one stands (a warm start's decode
        pool is not shrunk, nor its growth delayed, by the first window's short answers);
        after it, only windows that ended after it count, once they hold MIN_DIST_SAMPLES."""
        finished = self._recent(end, lambda w: w.output_lengths)
        observed = LengthDist.of(finished)
        if observed is None or self._traffic_from is None:
            return observed
        prior = self._answer_prior
        longest = max(
            observed.quantile(CENSOR_QUANTILE),
            prior.quantile(CENSOR_QUANTILE) if prior else 0.0,
        )
        censored_until = self._traffic_from + longest * self.config.slo_tpot_s
        after = self._recent(end, lambda w: w.output_lengths, censored_until)
        if after.count >= min(MIN_DIST_SAMPLES, finished.count):
            return LengthDist.of(after)
        if prior is not None and prior.mean() > observed.mean():
            return prior
        return observed

    def _recent(self, end: float, part, since: float = -math.inf) -> LengthHistogram:
        """The merged lengths of the last `history_s`, reaching further back (newest first)
        until MIN_DIST_SAMPLES: a few stragglers must not stand for a distribution (after a
        burst the last requests to finish are its longest answers). Only windows that end
        after `since`."""
        merged = LengthHistogram()
        for w in reversed(self.windows):
            if _end(w) <= since + 1e-9:
                break
            recent = _end(w) > end - self.config.history_s + 1e-9
            if not recent and merged.count >= MIN_DIST_SAMPLES:
                break
            merged.merge(part(w))
        return merged

    @property
    def last(self) -> WindowSignals | None:
        return self.windows[-1] if self.windows else None

    @property
    def last_rate(self) -> float:
        return self.windows[-1].arrival_rate if self.windows else 0.0

    def horizon_steps(self) -> float:
        """Windows between now and when a worker asked for now would serve its first request."""
        return (self.startup_s + self.config.interval_s) / self.config.interval_s

    def forecast_rate(self) -> float:
        return self.holt.forecast(self.horizon_steps())

    def noise(self) -> float:
        """Window-to-window noise of the rate (requests/s): the Holt one-step error's SD, at
        least the Poisson noise of a window's count, sqrt(rate / interval)."""
        forecast = self.forecast_rate()
        return max(self.holt.noise, math.sqrt(max(forecast, 0.0) / self.config.interval_s))

    def up_rate(
        self, room_s: float = 0.0, spike_s: float | None = None, learned: bool = False
    ) -> float:
        """The rate a scale-up provisions for: the forecast plus `up_noise_sigmas` of noise
        (the windows until a new worker is ready will peak above their mean), or the last
        window's rate when it stood out of the noise expected before it (a burst: more than
        BURST_SIGMAS above the one-step forecast); a window merely at the top of the noise
        does not start a worker. `room_s`: seconds a request may queue within its target
        (`queue_share`): a window's excess over the forecast then only needs the capacity
        that drains it within that room, and the noise is that of the longer average.
        `spike_s`: how long a window's excess keeps the pool busy after the window (None:
        for ever); when the window and that time end before a worker asked for now would
        serve (`spike_outlives_startup`), the burst is left to the pool as it is (the Holt
        level still absorbs a lasting shift within a few windows). `learned`: the noise
        margin is at least the forecast's horizon error at the same confidence (`_margin`)."""
        share = queue_share(self.config.interval_s, room_s)
        forecast = self.forecast_rate()
        margin = self._margin(self.config.up_noise_sigmas, learned)
        provisioned = forecast + margin * math.sqrt(share)
        if not self._burst or not self.spike_outlives_startup(spike_s):
            return provisioned
        return max(provisioned, share * self.last_rate + (1 - share) * provisioned)

    def spike_outlives_startup(self, spike_s: float | None) -> bool:
        """Whether a window's excess work is still there when a worker asked for now serves:
        the window plus `spike_s` (its queue's room, a sequence's lifetime) reach past the
        start-up. A worker started for work that is done (or missed) before it serves is a
        start-up of GPU time for nothing (Dynamo's over-reaction to spikes)."""
        return spike_s is None or self.config.interval_s + spike_s >= self.startup_s

    def down_rate(self, room_s: float = 0.0, learned: bool = False) -> float:
        """The rate a smaller pool must still carry: the forecast plus the larger of
        `down_margin` and NOISE_SIGMAS standard deviations of the rate's noise (and the last
        window's rate plus `down_margin`), so the noise of a steady load never shrinks a pool
        that the next window's rate grows back. `room_s` as for `up_rate`: the survivors
        carry the load averaged over a window and the room, so the same share applies to
        the noise and to the last window's excess as the scale-up rule uses (a pool shrunk
        here is not grown back by the next window's up rule at the same load; with `learned`,
        never less than the scale-up's learned margin, for the same reason)."""
        share = queue_share(self.config.interval_s, room_s)
        forecast, margin = self.forecast_rate(), self.config.down_margin
        noise = NOISE_SIGMAS * self.noise()
        if learned:  # the up rule's learned margin may exceed 4 noise SDs
            noise = max(noise, self._margin(self.config.up_noise_sigmas, learned=True))
        spread = max(margin * forecast, noise * math.sqrt(share))
        last = share * self.last_rate + (1 - share) * forecast
        return max(forecast + spread, last * (1 + margin))

    def workload(self, rate: float) -> Workload:
        """The recent length mix (history_s of windows, else older, else the prior) at `rate`,
        with the last window's queues."""
        c = self.config
        last = self.last
        return Workload(
            rate=rate,
            prompts=self._prompts or LengthDist.single(c.prior_prompt_tokens),
            outputs=self._outputs or LengthDist.single(c.prior_output_tokens),
            uncached=self._uncached,
            queued_prompt_tokens=float(last.queued_prompt_tokens) if last else 0.0,
            prefill_waiting=last.prefill_waiting if last else 0,
            decode_running=last.decode_running if last else 0,
            decode_waiting=last.decode_waiting if last else 0,
        )

    def last_window_workload(self) -> Workload | None:
        """The last window alone (its own length mix at its own rate), when it holds enough
        prompts to stand on: a burst of long prompts shows here before the history absorbs it."""
        last = self.last
        if last is None or last.prompt_lengths.count < MIN_WINDOW_PROMPTS:
            return None
        recent = self.workload(last.arrival_rate)
        prompts = LengthDist.of(last.prompt_lengths)
        outputs = LengthDist.of(last.output_lengths)
        recent.prompts = prompts or recent.prompts
        if outputs is not None and last.output_lengths.count >= MIN_WINDOW_PROMPTS:
            recent.outputs = outputs
        if last.prompt_lengths.total > 0:
            recent.uncached = min(1.0, last.uncached_prompt_tokens / last.prompt_lengths.total)
        return recent

    def burst_workload(self, rate: float | None = None) -> Workload | None:
        """The last window's length mix at the scale-up rate, when its prompts or answers are
        longer than the recent history's by more than LENGTH_BURST_SES standard errors (a burst
        of long prompts shows here before the history absorbs it; a window's sampling noise
        does not start a worker); `rate`: the pool's scale-up rate (default `up_rate()`).
        None otherwise."""
        last = self.last_window_workload()
        if last is None:
            return None
        heavier = _heavier(last.prompts, self._prompts, self.last.prompt_lengths.count)
        if last.outputs is not self._outputs:
            count = self.last.output_lengths.count
            heavier = heavier or _heavier(last.outputs, self._outputs, count)
        if not heavier:
            return None
        last.rate = self.up_rate() if rate is None else rate
        return last


def _heavier(recent: LengthDist, history: LengthDist | None, count: int) -> bool:
    if history is None:
        return False
    sd = math.sqrt(max(history.second_moment() - history.mean() ** 2, 0.0))
    return recent.mean() > history.mean() + LENGTH_BURST_SES * sd / math.sqrt(max(count, 1))


def queue_share(interval_s: float, room_s: float) -> float:
    """The share of one window's excess arrivals the pool must compute within the window
    itself when requests may queue `room_s` seconds within their TTFT target: capacity C
    clears a window of rate r followed by the forecast f within the window plus the room when
    C >= (r W + f room) / (W + room), i.e. the share W / (W + room) of r. 1 with no room (a
    tight target: every window's rate must be carried as it comes)."""
    return interval_s / (interval_s + max(room_s, 0.0))


def _end(window: WindowSignals) -> float:
    return window.start_s + window.duration_s
