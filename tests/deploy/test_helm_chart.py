"""The Helm chart, rendered by the real helm binary and checked against Kubernetes' schemas,
the KubeRay CRD, Ray's own autoscaler and the real `tandem serve` parser.

A check that loops over rendered objects first asserts it has the objects it expects, so an
empty render or a renamed group fails instead of passing on nothing."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploy_helpers import (
    CHART,
    EXAMPLES,
    K8S_VERSION,
    REPO,
    VALUE_SETS,
    Helm,
    find,
    given_flags,
    group_counts,
    one,
    parse_serve_args,
    serve_argv,
    serve_defaults,
)

# Kinds from CRDs kubernetes-validate has no schema for. RayCluster is checked against the
# KubeRay CRD in shared/; the Prometheus Operator kinds by the structural test below.
CRD_KINDS = {"RayCluster", "ServiceMonitor", "PrometheusRule"}
# The RayCluster's groups: the head and one worker group per pool.
POOLS = ("prefill", "decode")


def _values(name: str) -> dict[str, Any]:
    """The merged values of a value set (defaults overlaid by the example file)."""
    base = yaml.safe_load((CHART / "values.yaml").read_text())
    for f in VALUE_SETS[name]:
        _merge(base, yaml.safe_load(f.read_text()))
    return base


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def _groups(rc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The worker groups by name; fails unless they are exactly the two pools."""
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert sorted(groups) == sorted(POOLS), sorted(groups)
    return groups


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _head_container(rc: dict[str, Any]) -> dict[str, Any]:
    return rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def _head_serve_command(rc: dict[str, Any]) -> str:
    script = _head_container(rc)["args"][0]
    lines = [ln.strip() for ln in script.splitlines() if "tandem serve" in ln]
    assert len(lines) == 1, script
    return lines[0]


# ---- acceptance 1: helm lint --strict and helm template ------------------------------------


def test_helm_is_the_real_binary(helm: Helm) -> None:
    proc = helm.run("version", "--short")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(("v3.", "v4.")), proc.stdout


def test_at_least_three_value_sets_beside_the_defaults() -> None:
    assert {"gpu-rdma", "cpu-dev", "autoscaling-off"} <= set(VALUE_SETS), sorted(VALUE_SETS)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_lint_strict(helm: Helm, value_set: str) -> None:
    args: list[str | Path] = []
    for f in VALUE_SETS[value_set]:
        args += ["-f", f]
    proc = helm.run("lint", "--strict", "--kube-version", K8S_VERSION, CHART, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout, proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


def test_default_render_has_every_object(rendered: dict[str, list[dict]]) -> None:
    kinds = sorted(m["kind"] for m in rendered["default"])
    assert kinds == sorted(
        [
            "RayCluster",
            "Service",
            "Secret",
            "NetworkPolicy",
            "Pod",
            "PodDisruptionBudget",
            "PodDisruptionBudget",
            "PodDisruptionBudget",
        ]
    )
    gpu = {m["kind"] for m in rendered["gpu-rdma"]}
    assert {"Ingress", "ServiceMonitor", "PrometheusRule"} <= gpu


# ---- acceptance 2: kubernetes-validate --strict and the KubeRay CRD --------------------------


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_manifests_pass_kubernetes_validate_strict(
    rendered: dict[str, list[dict]], value_set: str
) -> None:
    checked = 0
    for m in rendered[value_set]:
        if m["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(m, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{m['kind']}/{m['metadata']['name']}: {e.message} at {list(e.path)}")
        checked += 1
    assert checked >= 4  # Service, Secret or not, NetworkPolicy, test Pod, PDBs


def test_kubernetes_validate_strict_rejects_an_unknown_field(
    rendered: dict[str, list[dict]],
) -> None:
    """The strict schemas are really in force (so the test above can fail)."""
    svc = copy.deepcopy(one(rendered["default"], "Service", "-router"))
    svc["spec"]["portz"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(svc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_raycluster_matches_kuberay_crd(
    rendered: dict[str, list[dict]], raycluster_schema: dict, value_set: str
) -> None:
    rc = one(rendered[value_set], "RayCluster")
    assert rc["apiVersion"] == "ray.io/v1"
    errors = sorted(
        jsonschema.Draft7Validator(raycluster_schema).iter_errors(rc), key=lambda e: list(e.path)
    )
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:10])


@pytest.mark.parametrize(
    "mutate",
    [
        lambda rc: rc["spec"]["headGroupSpec"].__setitem__("replicaz", 1),
        lambda rc: rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][
            0
        ].__setitem__("gpus", 1),
        lambda rc: rc["spec"]["workerGroupSpecs"][0]["rayStartParams"].__setitem__("num-gpus", 1),
        lambda rc: rc["spec"]["workerGroupSpecs"][0].pop("maxReplicas"),
    ],
    ids=[
        "unknown-group-field",
        "unknown-container-field",
        "non-string-start-param",
        "missing-maxReplicas",
    ],
)
def test_crd_schema_rejects_broken_rayclusters(
    rendered: dict[str, list[dict]], raycluster_schema: dict, mutate: Any
) -> None:
    rc = copy.deepcopy(one(rendered["default"], "RayCluster"))
    mutate(rc)
    assert list(jsonschema.Draft7Validator(raycluster_schema).iter_errors(rc))


def test_prometheus_operator_objects_are_well_formed(rendered: dict[str, list[dict]]) -> None:
    """kubernetes-validate has no schema for these CRDs; check what Prometheus relies on."""
    manifests = rendered["gpu-rdma"]
    sm = one(manifests, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm["spec"]) == {"selector", "namespaceSelector", "endpoints"}
    svc = one(manifests, "Service", "-router")
    sel = sm["spec"]["selector"]["matchLabels"]
    assert sel.items() <= svc["metadata"]["labels"].items(), "ServiceMonitor selects no Service"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    secret = one(manifests, "Secret", "-api-key")
    assert sm["spec"]["endpoints"], "the ServiceMonitor scrapes nothing"
    for ep in sm["spec"]["endpoints"]:
        assert set(ep) <= {"port", "path", "interval", "authorization"}
        assert ep["port"] in port_names and ep["path"] == "/metrics"
        # The router wants the API key on /metrics too.
        creds = ep["authorization"]["credentials"]
        assert ep["authorization"]["type"] == "Bearer"
        assert creds["name"] == secret["metadata"]["name"] and creds["key"] in secret["data"]

    metrics_py = REPO / "router" / "metrics.py"
    router_metrics = set(re.findall(r'"(tandem_[a-z_]+)"', metrics_py.read_text()))
    assert router_metrics, f"no tandem_* metric names found in {metrics_py}"
    rule = one(manifests, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"], "the PrometheusRule has no groups"
    series_checked = 0
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "rules", "interval"}
        assert group["rules"], f"rule group {group['name']} is empty"
        for r in group["rules"]:
            assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}
            assert r["alert"].startswith("Tandem") and r["expr"].count("(") == r["expr"].count(")")
            assert r["labels"]["severity"] in {"critical", "warning"}
            assert "{{" not in r["expr"]
            # Only series the router exports (router/metrics.py) or Prometheus makes (up).
            for name in re.findall(r"\b(tandem_[a-z_]+|up)\b", r["expr"]):
                base = name.removesuffix("_bucket").removesuffix("_total")
                assert name == "up" or base in router_metrics, f"{name} is not exported"
                series_checked += name != "up"
    assert series_checked, "no alert uses a series the router exports"


# ---- the RayCluster as KubeRay and Ray's autoscaler see it -----------------------------------


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_ray_autoscaler_sees_each_pool_with_its_resource(
    rendered: dict[str, list[dict]], value_set: str
) -> None:
    """Ray's own KubeRay config reader turns the groups into node types whose custom resource
    is what `--prefill-resource` / `--decode-resource` ask for, one unit per GPU."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    values = _values(value_set)
    rc = copy.deepcopy(one(rendered[value_set], "RayCluster"))
    rc["metadata"]["namespace"] = "serving"  # the API server sets it
    config = _derive_autoscaling_config_from_ray_cr(rc)
    types = config["available_node_types"]
    assert types["headgroup"]["resources"].get("GPU", 0) == 0
    assert not {"tandem_prefill", "tandem_decode"} & set(types["headgroup"]["resources"])
    serve = parse_serve_args(serve_argv(_head_serve_command(rc)))
    for pool, flag in (("prefill", serve.prefill_resource), ("decode", serve.decode_resource)):
        v = values[pool]
        t = types[pool]
        slots = v["gpusPerPod"] or v["cpuSlots"]
        assert t["resources"][v["rayResource"]] == slots
        assert flag == v["rayResource"]
        assert t["resources"].get("GPU", 0) == v["gpusPerPod"]
        # The pool's own bounds, or those derived from autoscaling.planner's when it is on.
        assert (t["min_workers"], t["max_workers"]) == group_counts(values, pool)[1:]
        other = "decode" if pool == "prefill" else "prefill"
        assert values[other]["rayResource"] not in t["resources"]


def test_head_starts_ray_then_tandem_serve(rendered: dict[str, list[dict]]) -> None:
    rc = one(rendered["default"], "RayCluster")
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    script = _head_container(rc)["args"][0]
    assert script.index("$KUBERAY_GEN_RAY_START_CMD") < script.index("exec tandem serve")
    ns = parse_serve_args(serve_argv(_head_serve_command(rc)))
    assert (ns.model, ns.mode, ns.address, ns.bind_host) == (
        "/models/model",
        "disagg",
        "auto",
        "auto",
    )
    assert (ns.host, ns.port) == ("0.0.0.0", 8000)
    # The key must come from the Secret, never the command line.
    assert "--api-key" not in given_flags(serve_argv(_head_serve_command(rc)))
    assert ns.api_key == serve_defaults().api_key
    assert _env(_head_container(rc))["TANDEM_API_KEY"]["secretKeyRef"]["key"] == "api-key"
    for group in _groups(rc).values():
        args = group["template"]["spec"]["containers"][0]["args"]
        assert args == ['ulimit -n 65536; exec /bin/bash -c "$KUBERAY_GEN_RAY_START_CMD"']


def test_serve_flags_follow_the_values(helm: Helm) -> None:
    manifests = helm.render(
        "--set",
        "serving.mode=colocated",
        "--set",
        "serving.replicas=2",
        "--set",
        "serving.disaggThreshold=256",
        "--set",
        "model.servedModelName=m",
        "--set",
        "model.kvDtype=fp8_e4m3",
        "--set-json",  # --set would pass 2.5 as a string
        "model.kvHostCacheGb=2.5",
        "--set-json",
        'serving.extraArgs=["--log-level", "DEBUG"]',
    )
    argv = serve_argv(_head_serve_command(one(manifests, "RayCluster")))
    ns = parse_serve_args(argv)
    assert (ns.mode, ns.replicas, ns.disagg_threshold) == ("colocated", 2, 256)
    # Colocated: no pool sizes on the command line.
    assert not given_flags(argv) & {"--prefill", "--decode"}, argv
    assert (ns.served_model_name, ns.kv_dtype) == ("m", "fp8_e4m3")
    assert ns.kv_host_cache_gb == 2.5  # the host KV tier (engine/kv_host_cache.py)
    # serving.extraArgs (values.yaml's example) reach `tandem serve` verbatim, last.
    assert argv[-2:] == ["--log-level", "DEBUG"] and ns.log_level == "DEBUG"


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_pod_is_locked_down_and_has_shm(
    rendered: dict[str, list[dict]], value_set: str
) -> None:
    rc = one(rendered[value_set], "RayCluster")
    ray_specs = [rc["spec"]["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in _groups(rc).values()
    ]
    test_pod = one(rendered[value_set], "Pod", "-test")
    specs = [*ray_specs, test_pod["spec"]]
    for spec in specs:
        assert spec["containers"], spec
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert set(sc["capabilities"].get("add", [])) <= {"IPC_LOCK"}
    for spec in ray_specs:
        shm = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in spec["containers"][0]["volumeMounts"]
    assert (
        rc["spec"]
        .get("autoscalerOptions", {})
        .get("securityContext", {})
        .get("allowPrivilegeEscalation", False)
        is False
    )


def test_gpu_rdma_values(rendered: dict[str, list[dict]]) -> None:
    rc = one(rendered["gpu-rdma"], "RayCluster")
    groups = _groups(rc)
    for pool, gpus, product in (
        ("prefill", 8, "NVIDIA-H100-80GB-HBM3"),
        ("decode", 4, "NVIDIA-L40S"),
    ):
        spec = groups[pool]["template"]["spec"]
        c = spec["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        env = _env(c)
        assert env["UCX_TLS"].split(",")[:2] == ["rc", "ud"] and "cuda_copy" in env["UCX_TLS"]
        assert env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
        assert env["UCX_IB_GID_INDEX"] == "3" and env["UCX_RNDV_SCHEME"] == "get_zcopy"
        assert env["UCX_TCP_PORT_RANGE"] == "21000-21999"
        assert spec["nodeSelector"] == {"nvidia.com/gpu.product": product}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
            "tolerations"
        ]
        assert (
            groups[pool]["template"]["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"]
            == "default/rdma-net"
        )
    head = _head_container(rc)
    assert _env(head)["UCX_TLS"] == "tcp,sm,self", "the head has no RDMA device"
    assert "IPC_LOCK" not in head["securityContext"]["capabilities"].get("add", [])


def test_cpu_dev_values(rendered: dict[str, list[dict]]) -> None:
    text = json.dumps(rendered["cpu-dev"])
    assert "nvidia.com/gpu" not in text
    rc = one(rendered["cpu-dev"], "RayCluster")
    for g in _groups(rc).values():
        assert g["rayStartParams"]["num-gpus"] == "0"
        c = g["template"]["spec"]["containers"][0]
        assert _env(c)["UCX_TLS"] == "tcp,sm,self"
        assert "tolerations" not in g["template"]["spec"]
    vol = [
        v
        for v in rc["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]
        if v["name"] == "model"
    ]
    assert vol[0]["hostPath"] == {"path": "/data/models", "type": "Directory"}
    assert not find(rendered["cpu-dev"], "PodDisruptionBudget")


def test_autoscaling_off_values(rendered: dict[str, list[dict]]) -> None:
    rc = one(rendered["autoscaling-off"], "RayCluster")
    assert rc["spec"]["enableInTreeAutoscaling"] is False
    assert "autoscalerOptions" not in rc["spec"]
    groups = _groups(rc)
    assert [groups[p]["replicas"] for p in ("prefill", "decode")] == [2, 3]
    assert all("idleTimeoutSeconds" not in g for g in groups.values())
    on = one(rendered["default"], "RayCluster")
    assert on["spec"]["enableInTreeAutoscaling"] is True
    assert on["spec"]["autoscalerOptions"]["idleTimeoutSeconds"] == 300


# ---- networking, disruption budgets, the API key ---------------------------------------------


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_networkpolicy_keeps_internal_ports_inside_the_release(
    rendered: dict[str, list[dict]], value_set: str
) -> None:
    """Ray, ZMQ and NIXL ports: only pods of this release. From elsewhere, only the router's
    port (and Ray's metrics port, for the scrapers metricsFrom names)."""
    manifests = rendered[value_set]
    np = one(manifests, "NetworkPolicy")
    release = {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": "tandem"}
    assert np["spec"]["podSelector"]["matchLabels"] == release
    assert np["spec"]["policyTypes"] == ["Ingress"]
    # Every pod of the release is covered, so none has its ports open by default.
    rc = one(manifests, "RayCluster")
    templates = [rc["spec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in _groups(rc).values()
    ]
    for t in templates:
        assert release.items() <= t["metadata"]["labels"].items()
    rules = np["spec"]["ingress"]
    assert rules, "the NetworkPolicy admits nothing: Ray could not start"
    release_rules = opened = 0
    for rule in rules:
        peers = rule.get("from")
        from_release_only = peers == [{"podSelector": {"matchLabels": release}}]
        if from_release_only:
            release_rules += 1
            continue
        names = {p["port"] for p in rule.get("ports", [])}
        assert names, f"rule opens every port to {peers}"
        assert names <= {"http", "metrics"}, names
        if "metrics" in names:
            assert peers, "metrics opened to any source"
        opened += "http" in names
    # The release's pods reach each other, and the router's port is reachable.
    assert release_rules == 1 and opened >= 1, rules


def test_router_service_and_pdbs_select_the_right_pods(rendered: dict[str, list[dict]]) -> None:
    manifests = rendered["default"]
    rc = one(manifests, "RayCluster")
    head = rc["spec"]["headGroupSpec"]["template"]
    svc = one(manifests, "Service", "-router")
    assert svc["spec"]["selector"].items() <= head["metadata"]["labels"].items()
    port_names = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    assert port_names["http"] == 8000 and svc["spec"]["ports"][0]["targetPort"] == "http"
    templates = {"head": head} | {g: s["template"] for g, s in _groups(rc).items()}
    assert len(templates) == 3, sorted(templates)
    for component, template in templates.items():
        pdb = one(manifests, "PodDisruptionBudget", f"-{component}")
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert sel.items() <= template["metadata"]["labels"].items()
        others = [t for c, t in templates.items() if c != component]
        assert not any(sel.items() <= t["metadata"]["labels"].items() for t in others)


def test_api_key_secret_variants(helm: Helm, rendered: dict[str, list[dict]]) -> None:
    import base64

    secret = one(rendered["default"], "Secret", "-api-key")
    assert len(base64.b64decode(secret["data"]["api-key"])) == 40
    fixed = helm.render("--set", "apiKey.value=s3cret")
    assert base64.b64decode(one(fixed, "Secret")["data"]["api-key"]) == b"s3cret"

    # An existing Secret: the chart makes none and points every reader at it.
    existing = rendered["autoscaling-off"]
    assert not find(existing, "Secret")
    ref = _env(_head_container(one(existing, "RayCluster")))["TANDEM_API_KEY"]["secretKeyRef"]
    assert ref == {"name": "tandem-api-key", "key": "key"}
    test_pod = one(existing, "Pod", "-test")
    assert _env(test_pod["spec"]["containers"][0])["TANDEM_API_KEY"]["secretKeyRef"] == ref

    off = helm.render("--set", "apiKey.enabled=false")
    assert not find(off, "Secret")
    assert "TANDEM_API_KEY" not in _env(_head_container(one(off, "RayCluster")))


# ---- acceptance 3: bad values fail with a clear message --------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "prefill.replicas=-1"], "/prefill/replicas': minimum: got -1, want 0"),
        (["--set", "decode.minReplicas=-2"], "/decode/minReplicas': minimum: got -2, want 0"),
        (
            ["--set", "prefill.minReplicas=5"],
            "prefill.minReplicas (5) must be <= prefill.maxReplicas (4)",
        ),
        (
            ["--set", "decode.maxReplicas=2", "--set", "decode.replicas=3"],
            "decode.replicas (3) must lie between decode.minReplicas (1) and decode.maxReplicas (2)",
        ),
        (["--set", "model.path=null"], "/model': missing property 'path'"),
        (["--set", "model.path="], "/model/path': minLength: got 0, want 1"),
        (["--skip-schema-validation", "--set", "model.path="], "model.path is required"),
        (
            ["--set", "model.path=/elsewhere/m"],
            "model.path (/elsewhere/m) must lie under model.mountPath (/models)",
        ),
        (
            ["--set", "serving.prefill=5", "--set", "prefill.maxReplicas=4"],
            "serving.prefill (5 actors) exceeds what prefill.maxReplicas x slots per pod can hold (4)",
        ),
        (["--set", "decode.rayResource=tandem_prefill"], "must differ"),
        (["--set", "serving.mode=split"], "/serving/mode'"),
        (["--set", "prefil.replicas=2"], "additional properties 'prefil' not allowed"),
        (["--set", "ports.zmq.first=30000"], "ports.zmq.first must be <= ports.zmq.last"),
    ],
    ids=[
        "negative-replicas",
        "negative-min",
        "min-gt-max",
        "replicas-outside-range",
        "model-missing",
        "model-empty",
        "model-required-template",
        "model-outside-mount",
        "too-many-actors",
        "same-resource",
        "bad-mode",
        "typo",
        "port-range",
    ],
)
def test_bad_values_fail_with_a_clear_message(helm: Helm, args: list[str], message: str) -> None:
    proc = helm.template(*args)
    assert proc.returncode != 0, f"helm template {args} rendered"
    assert message in proc.stderr, proc.stderr


# ---- the `helm test` hook ----------------------------------------------------------------------


class _Router(BaseHTTPRequestHandler):
    """Answers as the router does for the two calls the hook makes (an extra seam: the hook
    script is run for real against it)."""

    api_key = "k"
    seen: ClassVar[list[tuple[Any, ...]]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.seen.append(("GET", self.path))
        self._send(200 if self.path == "/health" else 404, {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(("POST", self.path, body))
        if self.headers.get("Authorization") != f"Bearer {self.api_key}":
            self._send(401, {"error": {"message": "bad key"}})
            return
        self._send(
            200, {"choices": [{"text": " world", "index": 0}], "usage": {"completion_tokens": 2}}
        )


def test_helm_test_hook_calls_health_and_one_completion(rendered: dict[str, list[dict]]) -> None:
    pod = one(rendered["default"], "Pod", "-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    c = pod["spec"]["containers"][0]
    env = _env(c)
    assert env["TANDEM_URL"] == "http://tandem-router:8000"
    assert env["TANDEM_MODEL"] == "model"
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Router.seen = []
    try:
        base = {k: v for k, v in env.items() if isinstance(v, str)}
        run_env = (
            os.environ
            | base
            | {"TANDEM_URL": f"http://127.0.0.1:{server.server_port}", "TANDEM_API_KEY": "k"}
        )
        ok = subprocess.run(
            [sys.executable, "-c", c["args"][0]],
            check=False,
            env=run_env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert ok.returncode == 0, ok.stderr
        assert "completion ok" in ok.stdout
        assert _Router.seen[0] == ("GET", "/health")
        assert _Router.seen[1] == (
            "POST",
            "/v1/completions",
            {"model": "model", "prompt": "Hello", "max_tokens": 4},
        )
        # A wrong key must fail the hook, not pass it.
        bad = subprocess.run(
            [sys.executable, "-c", c["args"][0]],
            check=False,
            env=run_env | {"TANDEM_API_KEY": "wrong"},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert bad.returncode != 0 and "401" in bad.stderr
    finally:
        server.shutdown()


def test_examples_only_use_known_values() -> None:
    """Every example is a subset of values.yaml's keys (the schema checks types; this catches a
    key the schema leaves open, such as a pool field)."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    # Maps whose keys are the user's (Kubernetes objects, labels, env names).
    free_form = {
        "volume",
        "resources",
        "nodeSelector",
        "affinity",
        "annotations",
        "labels",
        "podAnnotations",
        "rayStartParams",
        "extraEnv",
        "requests",
        "limits",
    }

    def walk(example: Any, base: Any, path: str) -> None:
        if not isinstance(example, dict) or not isinstance(base, dict):
            return
        if path.rstrip(".").rsplit(".", 1)[-1] in free_form:
            return
        for k, v in example.items():
            assert k in base, f"{path}{k} is not in values.yaml"
            walk(v, base[k], f"{path}{k}.")

    examples = sorted(EXAMPLES.glob("*.yaml"))
    assert {"gpu-rdma", "cpu-dev", "autoscaling-off"} <= {f.stem for f in examples}, examples
    for f in examples:
        example = yaml.safe_load(f.read_text())
        assert isinstance(example, dict) and example, f"{f.name} sets no values"
        walk(example, defaults, f"{f.name}: ")


def _run_head_script(script: str, tmp_path: Path, ray_start: str) -> subprocess.CompletedProcess:
    """Run the head container's script with stand-ins for `ray` and `tandem` on PATH: the
    health check passes once the stand-in `ray start` has written its marker file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    marker = tmp_path / "ray-up"
    (bin_dir / "ray").write_text(f'#!/bin/sh\n[ "$1" = health-check ] && test -f {marker}\n')
    (bin_dir / "tandem").write_text('#!/bin/sh\necho "tandem $*"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "KUBERAY_GEN_RAY_START_CMD": ray_start.replace("MARKER", str(marker)),
    }
    return subprocess.run(
        ["/bin/bash", "-c", "--", script.replace("sleep 2", "sleep 0.1")],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_head_script_waits_for_ray_then_execs_tandem_serve(
    rendered: dict[str, list[dict]], tmp_path: Path
) -> None:
    script = _head_container(one(rendered["default"], "RayCluster"))["args"][0]
    # `ray start --block` stays in the foreground; Ray comes up a moment later.
    blocking = _run_head_script(
        script, tmp_path, "sleep 0.3; touch MARKER; exec sleep 2 >/dev/null 2>&1"
    )
    assert blocking.returncode == 0, blocking.stderr
    assert blocking.stdout.startswith("tandem serve --model /models/model ")
    # A `ray start` that fails must fail the container, not hang it.
    (tmp_path / "ray-up").unlink()
    failing = _run_head_script(script, tmp_path, "echo boom >&2; exit 3")
    assert failing.returncode == 1 and "ray start failed" in failing.stderr
    assert "tandem serve" not in failing.stdout


@pytest.mark.parametrize("api_key", ["true", "false"])
def test_notes_tell_the_user_what_to_type(helm: Helm, api_key: str) -> None:
    proc = helm.run(
        "install",
        "tandem",
        CHART,
        "--namespace",
        "tandem",
        "--dry-run=client",
        "--set",
        f"apiKey.enabled={api_key}",
    )
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "kubectl port-forward -n tandem svc/tandem-router 8000:8000" in notes
    assert "helm test tandem -n tandem" in notes
    # Every continued line goes on with a flag: the curl command pastes as one command.
    lines = notes.splitlines()
    continued = [i for i, line in enumerate(lines) if line.endswith("\\")]
    # The completion's curl: its -H Authorization line (with a key) and its -d line.
    assert len(continued) >= (2 if api_key == "true" else 1), notes
    for i in continued:
        assert lines[i + 1].lstrip().startswith("-"), lines[i : i + 2]
    assert ("Authorization: Bearer" in notes) is (api_key == "true")


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_ray_start_params_are_flags_ray_start_accepts(
    rendered: dict[str, list[dict]], value_set: str
) -> None:
    """KubeRay turns each rayStartParams entry into `--key=value` on a shell line; Ray's own
    `ray start` CLI must accept every one, and --resources must be the JSON Ray parses."""
    import shlex

    from ray.scripts.scripts import start

    rc = one(rendered[value_set], "RayCluster")
    groups = [("head", rc["spec"]["headGroupSpec"]), *_groups(rc).items()]
    for name, group in groups:
        # The head sets its ports and num-gpus=0; each pool its GPUs and --resources.
        assert {"num-gpus", "object-manager-port"} <= set(group["rayStartParams"]), name
        line = " ".join(f"--{k}={v}" for k, v in group["rayStartParams"].items())
        argv = shlex.split(line) + (["--head"] if name == "head" else ["--address=head:6379"])
        params = start.make_context("ray start", argv).params
        if name == "head":
            assert params["num_gpus"] == 0, "the head takes no GPU"
        else:
            pool = _values(value_set)[name]
            slots = pool["gpusPerPod"] or pool["cpuSlots"]
            assert json.loads(params["resources"]) == {pool["rayResource"]: slots}
