"""The chart's monitoring extras, rendered by the real helm: the recording rules that publish
tandem's metrics under vLLM's names (a PrometheusRule and a plain rules file in a ConfigMap)
and tandem's Grafana dashboard (a ConfigMap for Grafana's sidecar).

Every `tandem_*` series a rule or a dashboard query reads is checked against what the router
really exports: a `RouterMetrics` with a worker snapshot that reports every counter, scraped
through prometheus_client's text exposition as Prometheus would. The rules are also applied,
by a small evaluator of exactly the expression forms the chart uses, to that scrape, so a
selector that matches nothing or a label that is not there fails here."""

from __future__ import annotations

import json
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_helpers import CHART, K8S_VERSION, Helm, find, one
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.protocol import WorkerLoad
from engine.slo import SloTargets
from router.directory import WorkerInfo
from router.metrics import RouterMetrics

NAMESPACE = "serving"  # what Helm.render uses
MODEL = "Qwen2.5-7B-Instruct"
ON = [
    "--set",
    "metrics.vllmRecordingRules.prometheusRule.enabled=true",
    "--set",
    "metrics.vllmRecordingRules.configMap.enabled=true",
    "--set",
    "metrics.grafanaDashboard.enabled=true",
    "--set",
    f"model.servedModelName={MODEL}",
]
# The names dashboards and autoscalers written for vLLM read (vLLM's /metrics, V1 engine).
HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
)
REQUIRED_VLLM = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
} | {h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
# What the recorded series stand for: vLLM name -> the tandem series it copies.
SOURCES = {
    "vllm:num_requests_running": "tandem_running_requests",
    "vllm:num_requests_waiting": "tandem_queue_depth",
    "vllm:kv_cache_usage_perc": "tandem_kv_usage_ratio",
    "vllm:prompt_tokens_total": "tandem_prompt_tokens_total",
    "vllm:generation_tokens_total": "tandem_generation_tokens_total",
    "vllm:prefix_cache_queries_total": "tandem_prefix_cache_query_tokens_total",
    "vllm:prefix_cache_hits_total": "tandem_prefix_cache_hit_tokens_total",
    "vllm:time_to_first_token_seconds_bucket": "tandem_ttft_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum": "tandem_itl_seconds_sum",
    "vllm:time_per_output_token_seconds_count": "tandem_itl_seconds_count",
    "vllm:e2e_request_latency_seconds_bucket": "tandem_e2e_seconds_bucket",
}
# Labels Prometheus attaches to every series it scrapes from the router's Service.
TARGET = {"namespace": NAMESPACE, "service": "tandem-router", "pod": "tandem-head-x"}
Series = tuple[str, frozenset[tuple[str, str]]]


def _worker(worker_id: str, role: str, free: int) -> WorkerInfo:
    # Every counter a worker reports in WorkerLoad.extra, so every per-worker name is exported.
    extra = {
        "transfer_bytes": 4e9,
        "transfer_seconds": 2.0,
        "transfer_failures": 1,
        "expired_leases": 2,
        "bad_frames": 0,
        "preemptions": 3,
        "prefix_hit_tokens": 30,
        "prefix_query_tokens": 120,
        "remote_prefills": 4,
        "recomputed": 1,
        "handoffs": 5,
        "aborts": 0,
    }
    load = WorkerLoad(
        worker_id=worker_id,
        role=role,
        num_free_blocks=free,
        num_total_blocks=100,
        num_running=3,
        num_waiting=2,
        queued_prefill_tokens=64,
        extra=extra,
    )
    return WorkerInfo(worker_id, role, "tcp://127.0.0.1:1", load)


@pytest.fixture(scope="module")
def scrape() -> dict[Series, float]:
    """The router's /metrics as Prometheus stores it: every sample, with the target labels."""
    workers = [_worker("p0", "prefill", 25), _worker("d0", "decode", 60)]
    # With the SLO targets `tandem serve` always passes (the planner's), so the SLO series exist.
    m = RouterMetrics(lambda: workers, SloTargets(ttft_ms=1000.0, tpot_ms=100.0))
    m.observe_slo(prompt_len=100, ttft_s=0.2, tpot_s=0.012)
    m.ttft.observe(0.2)
    m.itl.observe(0.01)
    m.tpot.observe(0.012)
    m.e2e.observe(1.5)
    m.prompt_tokens.inc(100)
    m.generation_tokens.inc(40)
    m.finished.labels(finish_reason="stop").inc(3)
    m.finished.labels(finish_reason="length").inc(1)
    out: dict[Series, float] = {}
    for family in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in family.samples:
            out[(s.name, frozenset((s.labels | TARGET).items()))] = s.value
    return out


@pytest.fixture(scope="module")
def exported(scrape: dict[Series, float]) -> dict[str, set[str]]:
    """Every series name the router exports -> the label names its samples carry."""
    names: dict[str, set[str]] = {}
    for name, labels in scrape:
        names.setdefault(name, set()).update(k for k, _ in labels)
    assert "tandem_prefix_cache_query_tokens_total" in names, sorted(names)
    return names


@pytest.fixture(scope="module")
def manifests(helm: Helm) -> list[dict[str, Any]]:
    return helm.render(*ON)


def _rules(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    assert groups, "no rule groups"
    rules = [r for g in groups for r in g["rules"]]
    assert rules, "no rules"
    return rules


def _tandem_names(expr: str) -> list[str]:
    return re.findall(r"\btandem_[a-z0-9_]+\b", expr)


# ---- a tiny PromQL evaluator for the two forms the rules use -----------------------------------

_SELECTOR = re.compile(r"^(tandem_[a-z0-9_]+)\{(.*)\}$")
_RELABEL = re.compile(
    r"^sum without \((\w+)\) \(label_replace\((tandem_[a-z0-9_]+)\{(.*)\}, "
    r'"(\w+)", "\$1", "(\w+)", "\(\.\*\)"\)\)$'
)


def _matchers(text: str) -> dict[str, str]:
    pairs = re.findall(r'(\w+)="([^"]*)"', text)
    assert ",".join(f'{k}="{v}"' for k, v in pairs) == text, f"unsupported matchers: {text}"
    return dict(pairs)


def _select(scrape: dict[Series, float], name: str, matchers: dict[str, str]):
    for (n, labels), value in scrape.items():
        if n == name and matchers.items() <= dict(labels).items():
            yield dict(labels), value


def evaluate(expr: str, scrape: dict[Series, float]) -> list[tuple[dict[str, str], float]]:
    """The result of a rule's expression over one scrape; fails on any other form, so a new
    form in the chart must be taught here (and so checked) before it passes."""
    if m := _SELECTOR.match(expr):
        return list(_select(scrape, m.group(1), _matchers(m.group(2))))
    m = _RELABEL.match(expr)
    assert m, f"the test cannot evaluate {expr!r}"
    dropped, name, sel, dst, src = m.groups()
    assert dropped == src, expr
    out = []
    for labels, value in _select(scrape, name, _matchers(sel)):
        assert src in labels, f"{name} has no label {src}"
        relabeled = {k: v for k, v in labels.items() if k != src} | {dst: labels[src]}
        out.append((relabeled, value))
    keys = [tuple(sorted(lbl.items())) for lbl, _ in out]
    assert len(set(keys)) == len(keys), "the sum would merge series (and hide their resets)"
    return out


# ---- the recording rules -------------------------------------------------------------------


def test_off_by_default(rendered: dict[str, list[dict]]) -> None:
    for name, ms in rendered.items():
        assert not [m for m in ms if m["metadata"]["name"].endswith(("-vllm", "-vllm-rules"))]
        assert not find(ms, "ConfigMap"), name


def test_lint_strict_with_everything_on(helm: Helm) -> None:
    proc = helm.run("lint", "--strict", "--kube-version", K8S_VERSION, CHART, *ON)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


def test_configmaps_pass_kubernetes_validate_strict(manifests: list[dict]) -> None:
    maps = find(manifests, "ConfigMap")
    assert {m["metadata"]["name"] for m in maps} == {"tandem-vllm-rules", "tandem-dashboard"}
    for m in maps:
        kubernetes_validate.validate(m, K8S_VERSION, strict=True)


def test_prometheus_rule_and_rules_file_carry_the_same_rules(manifests: list[dict]) -> None:
    rule = one(manifests, "PrometheusRule", "-vllm")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["app.kubernetes.io/instance"] == "tandem"
    rules_file = yaml.safe_load(
        one(manifests, "ConfigMap", "-vllm-rules")["data"]["tandem-vllm.rules.yaml"]
    )
    assert set(rules_file) == {"groups"}
    assert rules_file["groups"] == rule["spec"]["groups"]
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "rules", "interval"}
    for r in _rules(rule["spec"]["groups"]):
        assert set(r) == {"record", "expr", "labels"}, r
        assert r["labels"] == {"model_name": MODEL}, r
        assert r["record"].startswith("vllm:") and r["expr"].count("(") == r["expr"].count(")")


def test_every_required_vllm_name_is_recorded(manifests: list[dict]) -> None:
    records = [
        r["record"] for r in _rules(one(manifests, "PrometheusRule", "-vllm")["spec"]["groups"])
    ]
    assert len(records) == len(set(records)), "a name is recorded twice"
    assert REQUIRED_VLLM <= set(records), sorted(REQUIRED_VLLM - set(records))


def test_every_tandem_series_a_rule_reads_is_exported(
    manifests: list[dict], exported: dict[str, set[str]]
) -> None:
    checked = 0
    for r in _rules(one(manifests, "PrometheusRule", "-vllm")["spec"]["groups"]):
        names = _tandem_names(r["expr"])
        assert names, f"{r['record']} reads no tandem series"
        for name in names:
            assert name in exported, f"{r['record']} reads {name}, which the router does not export"
            checked += 1
    assert checked >= len(REQUIRED_VLLM)


def test_rules_applied_to_a_scrape_give_vllm_shaped_series(
    manifests: list[dict], scrape: dict[Series, float]
) -> None:
    rules = {
        r["record"]: r for r in _rules(one(manifests, "PrometheusRule", "-vllm")["spec"]["groups"])
    }
    for record, rule in rules.items():
        result = evaluate(rule["expr"], scrape)
        assert result, f"{record}: the selector matches nothing the router exports"
    for record, source in SOURCES.items():
        got = {tuple(sorted(lbl.items())): v for lbl, v in evaluate(rules[record]["expr"], scrape)}
        want = {
            tuple(sorted(dict(lbl).items())): v for (n, lbl), v in scrape.items() if n == source
        }
        assert got == want, record
    kv = dict(
        (lbl["worker"], v) for lbl, v in evaluate(rules["vllm:kv_cache_usage_perc"]["expr"], scrape)
    )
    assert kv == {"p0": 0.75, "d0": 0.4}
    success = {
        lbl["finished_reason"]: v
        for lbl, v in evaluate(rules["vllm:request_success_total"]["expr"], scrape)
    }
    assert success == {"stop": 3, "length": 1, "abort": 0, "error": 0}


def test_selector_and_interval_values(helm: Helm) -> None:
    ms = helm.render(
        *ON,
        "--set-string",
        'metrics.vllmRecordingRules.selector=job="tandem"',
        "--set",
        "metrics.vllmRecordingRules.interval=15s",
        "--set",
        "metrics.vllmRecordingRules.labels.release=kps",
    )
    rule = one(ms, "PrometheusRule", "-vllm")
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert one(ms, "ConfigMap", "-vllm-rules")["metadata"]["labels"]["release"] == "kps"
    assert [g["interval"] for g in rule["spec"]["groups"]] == ["15s"]
    for r in _rules(rule["spec"]["groups"]):
        assert '{job="tandem"}' in r["expr"] and "namespace=" not in r["expr"], r


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "metrics.vllmRecordingRules.prometheusRule.enabled=maybe"], "enabled"),
        (["--set", "metrics.vllmRecordingRules.interval=soon"], "interval"),
        (["--set", "metrics.vllmRecordingRules.prometheusRul.enabled=true"], "prometheusRul"),
        (["--set", "metrics.grafanaDashboard.enable=true"], "enable"),
    ],
    ids=["not-a-bool", "bad-interval", "typo", "dashboard-typo"],
)
def test_schema_rejects_bad_values(helm: Helm, args: list[str], message: str) -> None:
    proc = helm.template(*args)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


# ---- the Grafana dashboard -----------------------------------------------------------------


def _dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [
        v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        for v in dashboard["templating"]["list"]
        if v["type"] == "query"
    ]
    assert exprs, "the dashboard has no queries"
    return exprs


def test_dashboard_configmap_ships_the_file(manifests: list[dict]) -> None:
    cm = one(manifests, "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    text = (CHART / "dashboards" / "tandem.json").read_text()
    assert json.loads(cm["data"]["tandem.json"]) == json.loads(text)


def test_dashboard_queries_read_exported_series(exported: dict[str, set[str]]) -> None:
    dashboard = json.loads((CHART / "dashboards" / "tandem.json").read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    names = {n for e in _dashboard_exprs(dashboard) for n in _tandem_names(e)}
    missing = sorted(n for n in names if n not in exported)
    assert not missing, f"the dashboard reads series the router does not export: {missing}"
    # What the dashboard promises to show, by the series it reads.
    for needed in (
        "tandem_requests_total",
        "tandem_requests_finished_total",
        "tandem_ttft_seconds_bucket",
        "tandem_itl_seconds_bucket",
        "tandem_e2e_seconds_bucket",
        "tandem_generation_tokens_total",
        "tandem_queue_depth",
        "tandem_running_requests",
        "tandem_kv_usage_ratio",
        "tandem_prefix_cache_hit_tokens_total",
        "tandem_prefix_cache_query_tokens_total",
        "tandem_kv_transfer_bytes_total",
        "tandem_kv_transfer_failures_total",
        "tandem_slo_requests_total",
    ):
        assert needed in names, needed
    for labels in ("role", "finish_reason"):
        assert any(f"by ({labels})" in e for e in _dashboard_exprs(dashboard)), labels


def test_dashboard_layout_is_sound() -> None:
    dashboard = json.loads((CHART / "dashboards" / "tandem.json").read_text())
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        for t in p.get("targets", []):
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert t["datasource"]["uid"] == "${datasource}"
    quantiles = [e for e in _dashboard_exprs(dashboard) if e.startswith("histogram_quantile(")]
    for q in ("0.5", "0.9", "0.99"):
        for h in ("ttft", "itl", "e2e"):
            assert any(
                e.startswith(f"histogram_quantile({q},") and f"tandem_{h}_" in e for e in quantiles
            )
