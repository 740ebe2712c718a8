"""The planner's state as the router exports it: `PlannerStatus` and `PlannerCollector`.

Lifecycle: the router's signal loop (router/signal_recorder.py, `SignalReporter`) fetches the
controller's planner status every `signal_interval_s` through the directory's
`planner_status()`; `PlannerStatus.from_dict` checks it (None when autoscaling is off) and the
reporter keeps the latest good one. `PlannerCollector` reads that at scrape time, like the
per-worker collector reads the latest snapshot. A status that fails the checks is logged by
the reporter and dropped, so a bad controller answer never turns /metrics into a 500.

The router never imports `cluster/`: the status arrives as a plain dict (Ray carries it as
is), in the controller's format:

    {"enabled": True, "interval_s": 10.0,
     "desired": {"prefill": 2, "decode": 1}, "replicas": {...}, "starting": {...},
     "draining": {...},
     "decisions": [["prefill", "up", "demand", 3], ...],  # cumulative (pool, direction,
                                                         # reason, count)
     "predicted": {"prefill_tokens_per_s": 1.0, ...}, "observed": {...},
     "last_reasons": {"prefill": "text", ...}}

Unknown keys are ignored (an older router reads a newer controller's status).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_POOL_COUNTS = (
    ("desired", "tandem_planner_desired_replicas", "Replicas the planner wants per pool"),
    ("replicas", "tandem_planner_replicas", "Ready replicas per pool"),
    ("starting", "tandem_planner_replicas_starting", "Replicas asked for, not ready yet"),
    ("draining", "tandem_planner_replicas_draining", "Replicas finishing their last requests"),
)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"planner status: {what} must be a non-empty string, got {value!r}")
    return value


def _counts(value: Any, what: str) -> dict[str, int]:
    """A {pool: replicas} map: ints >= 0 (a float that is a whole number is accepted)."""
    if not isinstance(value, dict):
        raise ValueError(f"planner status: {what} must be a dict, got {type(value).__name__}")
    out: dict[str, int] = {}
    for pool, n in value.items():
        if not _is_number(n) or not math.isfinite(n) or n < 0 or n != int(n):
            raise ValueError(f"planner status: {what}[{pool!r}] must be an int >= 0, got {n!r}")
        out[_name(pool, f"a pool of {what}")] = int(n)
    return out


def _quantities(value: Any, what: str) -> dict[str, float]:
    """A {quantity: value} map; NaN is kept (a quantity the planner could not estimate)."""
    if not isinstance(value, dict):
        raise ValueError(f"planner status: {what} must be a dict, got {type(value).__name__}")
    out: dict[str, float] = {}
    for name, v in value.items():
        if not _is_number(v):
            raise ValueError(f"planner status: {what}[{name!r}] must be a number, got {v!r}")
        out[_name(name, f"a quantity of {what}")] = float(v)
    return out


def _decisions(value: Any) -> tuple[tuple[str, str, str, float], ...]:
    if not isinstance(value, list | tuple):
        raise ValueError(f"planner status: decisions must be a list, got {type(value).__name__}")
    # Rows with the same labels add up: one series per label set (a repeated series would
    # make Prometheus reject the scrape).
    out: dict[tuple[str, str, str], float] = {}
    for row in value:
        if not isinstance(row, list | tuple) or len(row) != 4:
            raise ValueError(
                f"planner status: a decision must be [pool, direction, reason, count], got {row!r}"
            )
        pool, direction, reason, count = row
        if not _is_number(count) or not math.isfinite(count) or count < 0:
            raise ValueError(f"planner status: decision count must be >= 0, got {count!r}")
        names = [_name(x, "a decision's pool/direction/reason") for x in (pool, direction, reason)]
        key = (names[0], names[1], names[2])
        out[key] = out.get(key, 0.0) + float(count)
    return tuple((*key, count) for key, count in sorted(out.items()))


@dataclass(slots=True, frozen=True)
class PlannerStatus:
    """A checked planner status (autoscaling on). Build it with `from_dict`."""

    interval_s: float | None = None
    desired: dict[str, int] = field(default_factory=dict)
    replicas: dict[str, int] = field(default_factory=dict)
    starting: dict[str, int] = field(default_factory=dict)
    draining: dict[str, int] = field(default_factory=dict)
    decisions: tuple[tuple[str, str, str, float], ...] = ()
    predicted: dict[str, float] = field(default_factory=dict)
    observed: dict[str, float] = field(default_factory=dict)
    last_reasons: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.interval_s is not None and not (
            _is_number(self.interval_s) and math.isfinite(self.interval_s) and self.interval_s > 0
        ):
            raise ValueError(f"planner status: interval_s must be > 0, got {self.interval_s!r}")
        for name, _, _ in _POOL_COUNTS:
            _counts(getattr(self, name), name)
        _decisions(self.decisions)
        _quantities(self.predicted, "predicted")
        _quantities(self.observed, "observed")
        for pool, text in self.last_reasons.items():
            if not isinstance(pool, str) or not isinstance(text, str):
                raise ValueError(f"planner status: last_reasons must map str to str: {pool!r}")

    @classmethod
    def from_dict(cls, d: Any) -> PlannerStatus | None:
        """The status of a controller answer; None when autoscaling is off (None, or
        `enabled` False). Raises ValueError naming the first bad field."""
        if d is None:
            return None
        if not isinstance(d, dict):
            raise ValueError(f"planner status must be a dict, got {type(d).__name__}")
        enabled = d.get("enabled", False)
        if not isinstance(enabled, bool):
            raise ValueError(f"planner status: enabled must be a bool, got {enabled!r}")
        if not enabled:
            return None
        interval = d.get("interval_s")
        reasons = d.get("last_reasons") or {}
        if not isinstance(reasons, dict):
            raise ValueError("planner status: last_reasons must be a dict")
        return cls(
            interval_s=None if interval is None else interval,
            **{name: _counts(d.get(name) or {}, name) for name, _, _ in _POOL_COUNTS},
            decisions=_decisions(d.get("decisions") or ()),
            predicted=_quantities(d.get("predicted") or {}, "predicted"),
            observed=_quantities(d.get("observed") or {}, "observed"),
            last_reasons=dict(reasons),
        )


class PlannerCollector:
    """The planner's gauges and decision counters from the latest status, at scrape time.
    Autoscaling off (or no status yet): only `tandem_planner_enabled 0`."""

    def __init__(self, status: Callable[[], PlannerStatus | None]) -> None:
        self._status = status

    def describe(self) -> list:  # no eager collect at registration time
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        status = self._status()
        enabled = GaugeMetricFamily(
            "tandem_planner_enabled", "1 while the controller's planner sizes the pools"
        )
        enabled.add_metric([], 0.0 if status is None else 1.0)
        yield enabled
        if status is None:
            return
        if status.interval_s is not None:
            yield GaugeMetricFamily(
                "tandem_planner_interval_seconds", "Planner decision period", status.interval_s
            )
        for key, name, doc in _POOL_COUNTS:
            family = GaugeMetricFamily(name, doc, labels=["pool"])
            for pool, n in sorted(getattr(status, key).items()):
                family.add_metric([pool], float(n))
            yield family
        decisions = CounterMetricFamily(
            "tandem_planner_decisions",
            "Planner decisions per pool, direction (up, down, hold) and reason (cumulative)",
            labels=["pool", "direction", "reason"],
        )
        for pool, direction, reason, count in status.decisions:
            decisions.add_metric([pool, direction, reason], count)
        yield decisions
        for key, doc in (
            ("predicted", "What the planner predicted for its last interval, per quantity"),
            ("observed", "What was observed over the planner's last interval, per quantity"),
        ):
            family = GaugeMetricFamily(f"tandem_planner_{key}", doc, labels=["quantity"])
            for quantity, value in sorted(getattr(status, key).items()):
                family.add_metric([quantity], value)
            yield family
