"""Prometheus metrics of the router, in their own CollectorRegistry (names prefixed tandem_).

Latency histograms and request/decision counters are updated by the server as requests run;
the admission queue gauges read `AdmissionControl` at scrape time (`track_queue`). The
request length histograms and the uncached prompt token counter are fed by the planner's
signal recorder (router/signal_recorder.py); the planner's own gauges and decision counters
come from the latest status the router fetched from the controller (`track_planner`,
router/planner_status.py). With SLO targets set (`--slo-ttft-ms`, `--slo-ttft-ms-per-1k`,
`--slo-tpot-ms`; `tandem serve` passes the planner's), every request served to its end is
counted in `tandem_slo_requests{result}` by engine/slo.py's rule, the one `tandem simulate`'s
attainment and `tandem bench serve`'s goodput use.
Per-worker numbers (queue depth, running, KV blocks, transfer totals) are read at scrape time
from the latest directory snapshot by `WorkerCollector`, so they are never staler than the
router's own view. Transfer totals are worker-side cumulative counts (WorkerLoad.extra keys
transfer_bytes, transfer_seconds, transfer_failures, expired_leases, remote_prefills,
recomputed, handoffs, read_blocks, reused_blocks, aborts, prefix_hit_tokens,
prefix_query_tokens, the host KV tier's host_*; see `_TRANSFER_KEYS`) and
are exported as counters with a worker label; a restarted worker restarts its series, as
Prometheus expects.

The Helm chart's recording rules (helm/tandem/templates/_vllm_rules.tpl) republish these under
vLLM's names, and tests/deploy/test_helm_metrics.py checks every name they read is exported
here: rename a metric in both places.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.roles import COLOCATED, DECODE, PREFILL
from engine.slo import SLO_RESULTS, SLO_UNSERVED, SloTargets
from router.directory import DOWN, READY, WORKER_STATES, WorkerInfo
from router.planner_status import PlannerCollector, PlannerStatus
from router.routing import LOCAL, REMOTE
from router.signals import LENGTH_EDGES

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# Token-length buckets: 1, 2, 4, ..., 256 Ki (+Inf), so they line up with the planner's windows.
LENGTH_BUCKETS = tuple(float(edge) for edge in LENGTH_EDGES)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)

# The finish_reason label values of tandem_requests_finished, exported at 0 from the start:
# stop, length and abort as vLLM names them, error for a request that failed.
FINISH_REASONS = ("stop", "length", "abort", "error")
# Why the router refused a generation request before routing it (tandem_requests_rejected):
# its admission queue was full (429), it is draining (503), or no decode worker was known (503).
REJECT_REASONS = ("queue_full", "draining", "no_workers")

_TRANSFER_KEYS = (
    ("transfer_bytes", "tandem_kv_transfer_bytes", "KV bytes moved to/from this worker"),
    ("transfer_seconds", "tandem_kv_transfer_seconds", "Seconds spent in KV transfers"),
    ("transfer_failures", "tandem_kv_transfer_failures", "KV transfers that failed"),
    ("expired_leases", "tandem_kv_expired_leases", "KV block leases that expired"),
    (
        "refused_peers",
        "tandem_kv_refused_peers",
        "KV handshakes or hand-offs refused: the peer is not in the registry (or stale)",
    ),
    (
        "rejected_frames",
        "tandem_kv_rejected_frames",
        "Malformed, oversized or out-of-order frames a worker's KV side channel refused",
    ),
    (
        "restarted_leases",
        "tandem_kv_restarted_leases",
        "KV leases released at once because their reader was replaced by a new incarnation",
    ),
    ("bad_frames", "tandem_worker_bad_frames", "Malformed or oversized frames a worker dropped"),
    ("preemptions", "tandem_preemptions", "Sequences preempted (recomputed) for lack of KV"),
    (
        "prefix_hit_tokens",
        "tandem_prefix_cache_hit_tokens",
        "Prompt tokens served from cache (device and host tiers)",
    ),
    ("host_hit_tokens", "tandem_kv_host_hit_tokens", "Prompt tokens served from the host KV tier"),
    ("host_hit_blocks", "tandem_kv_host_hit_blocks", "Blocks found in the host KV tier"),
    (
        "host_miss_blocks",
        "tandem_kv_host_miss_blocks",
        "Blocks past a device prefix hit looked up in the host KV tier and not found",
    ),
    ("host_demotions", "tandem_kv_host_demotions", "Evicted device blocks copied to host"),
    ("host_promotions", "tandem_kv_host_promotions", "Host blocks copied back to the device"),
    ("host_dropped", "tandem_kv_host_dropped", "Evicted blocks not kept: every host slot reserved"),
    ("host_bytes_demoted", "tandem_kv_host_demoted_bytes", "KV bytes copied device to host"),
    ("host_bytes_promoted", "tandem_kv_host_promoted_bytes", "KV bytes copied host to device"),
    (
        "prefix_query_tokens",
        "tandem_prefix_cache_query_tokens",
        "Prompt tokens looked up in the prefix cache (hit rate: hit tokens / these)",
    ),
    (
        "remote_prefills",
        "tandem_kv_remote_prefills",
        "Requests a decode worker served from KV received from a prefill worker",
    ),
    (
        "recomputed",
        "tandem_kv_recomputes",
        "Requests a decode worker recomputed because their KV could not be fetched",
    ),
    ("handoffs", "tandem_kv_handoffs", "Requests a prefill worker handed to a decode worker"),
    (
        "read_blocks",
        "tandem_kv_read_blocks",
        "KV blocks of remote prompts a decode worker read from prefill workers",
    ),
    (
        "reused_blocks",
        "tandem_kv_reused_blocks",
        "KV blocks of remote prompts a decode worker took from its own prefix cache, unread",
    ),
    ("aborts", "tandem_worker_aborts", "Requests a worker dropped on an abort"),
    ("prefix_pulls", "tandem_kv_prefix_pulls", "Prompts whose leading blocks a prefill worker "
     "asked a peer for instead of computing them (prefix pull)"),
    ("prefix_pulled_blocks", "tandem_kv_prefix_pulled_blocks",
     "KV blocks a prefill worker READ from a peer's prefix cache"),
    ("prefix_pull_bytes", "tandem_kv_prefix_pull_bytes",
     "KV bytes a prefill worker READ from peers' prefix caches"),
    ("prefix_pull_failures", "tandem_kv_prefix_pull_failures",
     "Prefix pulls that ended without the blocks (the prompt was computed)"),
    ("prefix_lent_blocks", "tandem_kv_prefix_lent_blocks",
     "KV blocks of this worker's prefix cache lent to a prefill worker's READ"),
)  # fmt: skip


class WorkerCollector:
    """Per-worker gauges and transfer counters from the latest directory snapshot."""

    def __init__(self, snapshot: Callable[[], list[WorkerInfo]]) -> None:
        self._snapshot = snapshot

    def describe(self):  # no eager collect at registration time
        return []

    def collect(self):
        workers = self._snapshot()
        labels = ["worker", "role"]
        gauges = _worker_gauges(labels)
        pools = GaugeMetricFamily(
            "tandem_pool_size", "Routable (ready) workers per role", labels=["role"]
        )
        states = GaugeMetricFamily(
            "tandem_workers",
            "Workers per role and state (ready, draining, down)",
            labels=["role", "state"],
        )
        counters = {
            key: CounterMetricFamily(name, doc, labels=labels) for key, name, doc in _TRANSFER_KEYS
        }
        # Every role gets a sample (0 when empty), in a fixed order.
        per_role: dict[str, int] = {PREFILL: 0, DECODE: 0, COLOCATED: 0}
        per_state = {(r, st): 0 for r in per_role for st in WORKER_STATES}
        for w in workers:
            load = w.load
            lv = [w.worker_id, w.role]
            per_role[w.role] += w.state == READY
            per_state[(w.role, w.state)] += 1
            self._worker_load_gauges(gauges, w, lv)
            extra = load.extra or {}
            for key, _, _ in _TRANSFER_KEYS:  # what the worker did: still true once it is gone
                value = extra.get(key)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    counters[key].add_metric(lv, float(value))
        for role, n in per_role.items():
            pools.add_metric([role], n)
        for (role, state), n in per_state.items():
            states.add_metric([role, state], n)
        yield from gauges.values()
        yield pools
        yield states
        yield from counters.values()

    @staticmethod
    def _worker_load_gauges(gauges: dict, w: WorkerInfo, lv: list[str]) -> None:
        """A worker's current load; none for a DOWN one, whose last report describes a process
        that is gone (the KV blocks it held went with it: they are not in use anywhere)."""
        if w.state == DOWN:
            return
        load = w.load
        gauges["queue"].add_metric(lv, load.num_waiting)
        gauges["running"].add_metric(lv, load.num_running)
        gauges["free"].add_metric(lv, load.num_free_blocks)
        gauges["total"].add_metric(lv, load.num_total_blocks)
        total = load.num_total_blocks
        used = (total - load.num_free_blocks) / total if total > 0 else 0.0
        gauges["usage"].add_metric(lv, used)
        gauges["queued_prefill"].add_metric(lv, load.queued_prefill_tokens)
        extra = load.extra or {}
        for key in ("host_used_blocks", "host_total_blocks"):  # only where the tier is on
            value = extra.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                gauges[key].add_metric(lv, value)


def _worker_gauges(labels: list[str]) -> dict[str, GaugeMetricFamily]:
    return {
        "queue": GaugeMetricFamily(
            "tandem_queue_depth", "Requests waiting on the worker", labels=labels
        ),
        "running": GaugeMetricFamily(
            "tandem_running_requests", "Requests running on the worker", labels=labels
        ),
        "free": GaugeMetricFamily("tandem_kv_free_blocks", "Free KV cache blocks", labels=labels),
        "total": GaugeMetricFamily(
            "tandem_kv_total_blocks", "Total KV cache blocks", labels=labels
        ),
        "usage": GaugeMetricFamily(
            "tandem_kv_usage_ratio", "Fraction of KV blocks in use", labels=labels
        ),
        "queued_prefill": GaugeMetricFamily(
            "tandem_queued_prefill_tokens", "Prompt tokens waiting for prefill", labels=labels
        ),
        "host_used_blocks": GaugeMetricFamily(
            "tandem_kv_host_used_blocks", "Blocks held by the host KV tier", labels=labels
        ),
        "host_total_blocks": GaugeMetricFamily(
            "tandem_kv_host_total_blocks", "Host KV tier capacity in blocks", labels=labels
        ),
    }


class KVIndexCollector:
    """The kv-events index (router/kv_index.py) and its listener, read at scrape time from a
    `router.routing.WorkerPool` (nothing with `--routing affinity`, which keeps no index)."""

    def __init__(self, pool) -> None:
        self._pool = pool

    def describe(self):
        return []

    def collect(self):
        pool = self._pool
        listener = pool.kv_listener
        if listener is None:
            return
        index = pool.kv_index
        yield GaugeMetricFamily(
            "tandem_kv_index_entries",
            "(block hash, worker) pairs in the router's KV index",
            value=index.num_entries,
        )
        for name, doc, value in (
            ("tandem_kv_events_received", "KV events received from workers", index.num_events),
            ("tandem_kv_event_batches", "KV event batches received", listener.num_batches),
            (
                "tandem_kv_index_resyncs",
                "Worker snapshots loaded into the KV index",
                listener.num_resyncs,
            ),
            (
                "tandem_kv_index_resync_failures",
                "KV index resyncs that failed or timed out",
                listener.num_resync_failures,
            ),
            (
                "tandem_kv_index_overflow",
                "KV blocks not indexed: the index was full",
                index.num_overflow,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        hits = CounterMetricFamily(
            "tandem_kv_routing_hits",
            "Routes whose chosen worker held part of the prompt",
            labels=["pool"],
        )
        tokens = CounterMetricFamily(
            "tandem_kv_routing_hit_tokens",
            "Prompt tokens the chosen worker held, per route",
            labels=["pool"],
        )
        for p in ("decode", "prefill"):
            hits.add_metric([p], pool.route_hits[p])
            tokens.add_metric([p], pool.route_hit_tokens[p])
        yield hits
        yield tokens


class RouterMetrics:
    def __init__(
        self, snapshot: Callable[[], list[WorkerInfo]], slo: SloTargets | None = None
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.slo = slo or SloTargets()
        self._add_latency_metrics(r)
        self.requests = Counter(
            "tandem_requests", "Finished requests by status", ["status"], registry=r
        )
        self.disagg = Counter(
            "tandem_disagg_decisions",
            "Prefill placement decisions (local: on the decode worker; remote: prefill pool)",
            ["path"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tandem_prompt_tokens", "Prompt tokens of dispatched requests", registry=r
        )
        self.generation_tokens = Counter(
            "tandem_generation_tokens", "Output tokens delivered to clients", registry=r
        )
        self.bad_frames = Counter(
            "tandem_bad_frames", "Malformed frames dropped on the token sink", registry=r
        )
        self.inflight = Gauge("tandem_inflight_requests", "Requests in flight", registry=r)
        self.finished = Counter(
            "tandem_requests_finished",
            "Finished generations by why they ended (stop, length, abort, error)",
            ["finish_reason"],
            registry=r,
        )
        # Every label value starts at 0 so a rate() over it is defined before the first event.
        for reason in FINISH_REASONS:
            self.finished.labels(finish_reason=reason)
        for status in ("success", "client_error", "server_error", "cancelled"):
            self.requests.labels(status=status)
        for path in (LOCAL, REMOTE):
            self.disagg.labels(path=path)
        self._add_admission_metrics(r)
        if self.slo.judged:
            self._add_slo_metrics(r)
        r.register(WorkerCollector(snapshot))
        self._add_planner_metrics(r)

    def _add_planner_metrics(self, r: CollectorRegistry) -> None:
        self._planner_status: Callable[[], PlannerStatus | None] = lambda: None
        r.register(PlannerCollector(lambda: self._planner_status()))
        # The planner's length mix as Prometheus sees it (router/signal_recorder.py observes
        # them): power-of-two buckets, the edges of router.signals.LENGTH_EDGES.
        self.request_prompt_tokens = Histogram(
            "tandem_request_prompt_tokens",
            "Prompt tokens per arriving request (refused and failed ones included)",
            buckets=LENGTH_BUCKETS,
            registry=r,
        )
        self.request_output_tokens = Histogram(
            "tandem_request_output_tokens",
            "Output tokens per finished sequence",
            buckets=LENGTH_BUCKETS,
            registry=r,
        )
        self.prompt_tokens_uncached = Counter(
            "tandem_prompt_tokens_uncached",
            "Arrived prompt tokens the prefix cache did not serve (estimated per signal window)",
            registry=r,
        )

    def _add_latency_metrics(self, r: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "tandem_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "tandem_tpot_seconds",
            "Mean time per output token after the first, per request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tandem_itl_seconds",
            "Time between consecutive token deliveries",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem_e2e_seconds",
            "Request latency, arrival to last token",
            buckets=_E2E_BUCKETS,
            registry=r,
        )

    def _add_slo_metrics(self, r: CollectorRegistry) -> None:
        # Attainment is met / all: the share the planner sizes for and that `tandem simulate`
        # and `tandem bench serve` report, judged by the same rule (engine/slo.py).
        self.slo_requests = Counter(
            "tandem_slo_requests",
            "Requests by how they fared against the SLO targets (TTFT with its allowance per "
            "1k prompt tokens; TPOT): met or missed when served to their end, else failed "
            "(after admission) or refused (429/503)",
            ["result"],
            registry=r,
        )
        for result in (*SLO_RESULTS, *SLO_UNSERVED):
            self.slo_requests.labels(result=result)
        targets = Gauge(
            "tandem_slo_target_seconds",
            "The SLO targets requests are judged by (a target not judged is absent)",
            ["target"],
            registry=r,
        )
        slo = self.slo
        for name, ms in (
            ("ttft", slo.ttft_ms),
            ("ttft_per_1k_prompt_tokens", slo.ttft_ms_per_1k if slo.ttft_ms is not None else None),
            ("tpot", slo.tpot_ms),
        ):
            if ms is not None:
                targets.labels(target=name).set(ms / 1000.0)

    def observe_slo(self, prompt_len: int, ttft_s: float, tpot_s: float | None) -> None:
        """Count one request served to its end against the targets (none set: nothing)."""
        if self.slo.judged:
            self.slo_requests.labels(result=self.slo.judge(prompt_len, ttft_s, tpot_s)).inc()

    def request_ended(self, status: str) -> None:
        """One generation request's end by status (success, client_error, server_error,
        cancelled; `refused`: a 503 no_workers, a server error to tandem_requests): a server
        error or a refusal also counts against the SLO."""
        if status == "refused":
            self.observe_unserved("refused")
            status = "server_error"
        elif status == "server_error":
            self.observe_unserved("failed")
        self.requests.labels(status=status).inc()

    def observe_unserved(self, result: str) -> None:
        """Count a request taken and not served (one of SLO_UNSERVED): it met no target."""
        if self.slo.judged:
            self.slo_requests.labels(result=result).inc()

    def _add_admission_metrics(self, r: CollectorRegistry) -> None:
        self.rejected = Counter(
            "tandem_requests_rejected",
            "Generation requests refused before routing, by reason",
            ["reason"],
            registry=r,
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(reason=reason)
        self.queued_requests = Gauge(
            "tandem_router_queued_requests",
            "Requests admitted and waiting for their first token",
            registry=r,
        )
        self.queued_prompt_tokens = Gauge(
            "tandem_router_queued_prompt_tokens",
            "Prompt tokens of the requests waiting for their first token",
            registry=r,
        )

    def track_planner(self, status: Callable[[], PlannerStatus | None]) -> None:
        """Export the planner status `status()` returns at scrape time (None: planner off)."""
        self._planner_status = status

    def track_kv_index(self, pool) -> None:
        """Export the kv-events index of `pool` (a router.routing.WorkerPool) at scrape time."""
        self.registry.register(KVIndexCollector(pool))

    def track_queue(self, requests: Callable[[], float], tokens: Callable[[], float]) -> None:
        """Read the admission queue's size at scrape time (never stale, nothing to update)."""
        self.queued_requests.set_function(requests)
        self.queued_prompt_tokens.set_function(tokens)
