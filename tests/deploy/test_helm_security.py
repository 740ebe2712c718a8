"""The chart's pods are locked down and probed, rendered by the real helm and validated offline.

For every value set (defaults, examples/gpu-rdma.yaml with GPUs and RDMA, and the other
examples) and a few `--set` variants, every container the chart starts (head, prefill and
decode workers, the `helm test` pod, and Ray's autoscaler sidecar through autoscalerOptions):

- runs as non-root with a RuntimeDefault seccomp profile, no privilege escalation, not
  privileged, a read-only root filesystem and every capability dropped; IPC_LOCK is added back
  only on prefill/decode containers and only when rdma.enabled and rdma.ipcLock;
- has what it must write on emptyDirs: /tmp, Ray's /tmp/ray (the `ray-logs` volume KubeRay
  shares with the autoscaler) and HOME, which the HOME variable names;

the head container probes the router port (the `http` container port): startup and liveness
GET /health, readiness GET /ready, none with a header (the router exempts both paths from the
API key: checked against router/server.py); and the NetworkPolicy opens, to anything outside
the release, only the router's `http` port (a port name only the head declares) and, for the
peers metricsFrom names and no one else, Ray's `metrics` port.

Each pod template is validated offline as a core/v1 Pod by kubernetes-validate (strict), the
RayCluster against the KubeRay CRD, the other objects as the chart tests do."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_helpers import CHART, K8S_VERSION, VALUE_SETS, Helm, find, one

CRD_KINDS = {"RayCluster", "ServiceMonitor", "PrometheusRule"}
ALLOWED_CAPS = {"IPC_LOCK"}


def _values(value_set: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Merged values: defaults, then the example file, then `overrides`."""
    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    layers = [yaml.safe_load(f.read_text()) for f in VALUE_SETS[value_set]]
    for layer in [*layers, overrides or {}]:
        _merge(merged, layer)
    return merged


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def _render(helm: Helm, value_set: str, *sets: str) -> list[dict[str, Any]]:
    args: list[str | Path] = []
    for f in VALUE_SETS[value_set]:
        args += ["-f", f]
    return helm.render(*args, *sets)


def pod_specs(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod spec the chart creates, by component: head, prefill, decode (RayCluster
    templates) and test (the `helm test` Pod). Fails when one is missing."""
    rc = one(manifests, "RayCluster")
    specs = {"head": rc["spec"]["headGroupSpec"]["template"]["spec"]}
    for group in rc["spec"]["workerGroupSpecs"]:
        specs[group["groupName"]] = group["template"]["spec"]
    specs["test"] = one(manifests, "Pod", "-test")["spec"]
    assert sorted(specs) == ["decode", "head", "prefill", "test"], sorted(specs)
    return specs


def autoscaler(manifests: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The autoscaler sidecar as KubeRay builds it from autoscalerOptions (None when off):
    its settings plus the /tmp/ray mount of the `ray-logs` volume KubeRay adds."""
    options = one(manifests, "RayCluster")["spec"].get("autoscalerOptions")
    if options is None:
        return None
    mounts = [*options.get("volumeMounts", []), {"name": "ray-logs", "mountPath": "/tmp/ray"}]
    return {
        "name": "autoscaler",
        "image": "rayproject/ray:2.60.0",
        "securityContext": options["securityContext"],
        "env": options.get("env", []),
        "volumeMounts": mounts,
        "resources": options["resources"],
    }


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return spec.get("initContainers", []) + spec["containers"]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def assert_locked_down(pod: dict[str, Any], c: dict[str, Any], ipc_lock: bool) -> None:
    """One container (with its pod's securityContext): the whole lockdown."""
    sc, where = c["securityContext"], c["name"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0, (where, pod)
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, where
    assert sc.get("runAsNonRoot", True) is True and sc.get("runAsUser", 1) != 0, (where, sc)
    assert sc.get("seccompProfile", pod["seccompProfile"]) == {"type": "RuntimeDefault"}, where
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False, (where, sc)
    assert sc["readOnlyRootFilesystem"] is True, (where, sc)
    assert sc["capabilities"]["drop"] == ["ALL"], (where, sc)
    added = set(sc["capabilities"].get("add", []))
    assert added == ({"IPC_LOCK"} if ipc_lock else set()), (where, added)


def assert_scratch(spec: dict[str, Any], c: dict[str, Any]) -> None:
    """A Ray container writes only to emptyDirs: /tmp, /tmp/ray, HOME (and /dev/shm)."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    home = _env(c).get("HOME")
    assert home and home.startswith("/"), (c["name"], _env(c))
    for path in ("/tmp", "/tmp/ray", home):
        assert path in mounts, (c["name"], path, sorted(mounts))
        volume = volumes[mounts[path]["name"]]
        assert "emptyDir" in volume and not mounts[path].get("readOnly"), (path, volume)
    assert mounts["/tmp/ray"]["name"] == "ray-logs", "KubeRay's autoscaler shares this name"
    for path, m in mounts.items():  # anything else mounted is memory or read-only
        v = volumes[m["name"]]
        writable = "emptyDir" in v or not m.get("readOnly", False)
        assert path in ("/tmp", "/tmp/ray", home, "/dev/shm") or not writable, (path, m)


def assert_valid_pod(spec: dict[str, Any], name: str) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}
    try:
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"pod template {name}: {e.message} at {list(e.path)}")


# ---- every container, every value set ---------------------------------------------------------


def check_release(manifests: list[dict[str, Any]], values: dict[str, Any]) -> None:
    specs = pod_specs(manifests)
    rdma_lock = bool(values["rdma"]["enabled"] and values["rdma"]["ipcLock"])
    home = values["scratch"]["home"]["mountPath"]
    for component, spec in specs.items():
        containers = _containers(spec)
        assert containers, component
        for c in containers:
            assert_locked_down(spec["securityContext"], c, rdma_lock and component != "head"
                               and component != "test")  # fmt: skip
            if component != "test":
                assert_scratch(spec, c)
                assert _env(c)["HOME"] == home
        assert_valid_pod(copy.deepcopy(spec), f"tandem-{component}")
    side = autoscaler(manifests)
    assert (side is not None) == values["autoscaling"]["enabled"]
    if side is not None:
        head = specs["head"]
        assert_locked_down(head["securityContext"], side, ipc_lock=False)
        assert_scratch(head, side)
        # The head pod as KubeRay runs it, sidecar included, is a valid Pod.
        assert_valid_pod(copy.deepcopy(head) | {"containers": [*head["containers"], side]}, "h")
    for m in manifests:
        if m["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(m, K8S_VERSION, strict=True)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_container_is_locked_down(
    rendered: dict[str, list[dict]], raycluster_schema: dict, value_set: str
) -> None:
    import jsonschema

    manifests = rendered[value_set]
    check_release(manifests, _values(value_set))
    jsonschema.validate(one(manifests, "RayCluster"), raycluster_schema)


def test_gpu_rdma_adds_ipc_lock_to_the_workers_only(rendered: dict[str, list[dict]]) -> None:
    assert {"default", "gpu-rdma"} <= set(VALUE_SETS)
    gpu = pod_specs(rendered["gpu-rdma"])
    for pool in ("prefill", "decode"):
        c = gpu[pool]["containers"][0]
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
    for component, spec in pod_specs(rendered["default"]).items():
        for c in _containers(spec):
            assert "add" not in c["securityContext"]["capabilities"], component


@pytest.mark.parametrize(
    "sets",
    [
        # RDMA without IPC_LOCK: nothing is added back.
        ("--set", "rdma.enabled=true", "--set", "rdma.ipcLock=false"),
        # Size limits on the scratch volumes, another HOME, autoscaler off.
        (
            "--set",
            "scratch.tmp.sizeLimit=2Gi",
            "--set",
            "scratch.ray.sizeLimit=20Gi",
            "--set",
            "scratch.home.mountPath=/scratch/home",
            "--set",
            "autoscaling.enabled=false",
        ),
    ],
    ids=["rdma-no-ipc-lock", "scratch-limits"],
)
def test_variants_stay_locked_down(helm: Helm, raycluster_schema: dict, sets: tuple) -> None:
    import jsonschema

    manifests = _render(helm, "gpu-rdma", *sets)
    overrides: dict[str, Any] = {}
    for key, value in (s.split("=", 1) for s in sets[1::2]):
        node = overrides
        *path, leaf = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = {"true": True, "false": False}.get(value, value)
    check_release(manifests, _values("gpu-rdma", overrides))
    jsonschema.validate(one(manifests, "RayCluster"), raycluster_schema)
    if "scratch.tmp.sizeLimit=2Gi" in sets:
        volumes = {v["name"]: v for v in pod_specs(manifests)["decode"]["volumes"]}
        assert volumes["tmp"]["emptyDir"] == {"sizeLimit": "2Gi"}
        assert volumes["ray-logs"]["emptyDir"] == {"sizeLimit": "20Gi"}
        assert volumes["home"]["emptyDir"] == {}


def test_lockdown_check_fails_on_a_writable_root_or_an_added_capability(
    rendered: dict[str, list[dict]],
) -> None:
    """The checks above can fail: a broken copy of a rendered worker does not pass them."""
    spec = pod_specs(rendered["default"])["decode"]
    c = spec["containers"][0]
    for fault in (
        {"readOnlyRootFilesystem": False},
        {"capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN"]}},
        {"allowPrivilegeEscalation": True},
        {"seccompProfile": {"type": "Unconfined"}},
    ):
        broken = copy.deepcopy(c)
        broken["securityContext"] |= fault
        with pytest.raises(AssertionError):
            assert_locked_down(spec["securityContext"], broken, ipc_lock=False)
    no_tmp = copy.deepcopy(c)
    no_tmp["volumeMounts"] = [m for m in c["volumeMounts"] if m["mountPath"] != "/tmp"]
    with pytest.raises(AssertionError):
        assert_scratch(spec, no_tmp)


# ---- probes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_head_probes_health_and_ready_on_the_router_port(
    rendered: dict[str, list[dict]], value_set: str
) -> None:
    values = _values(value_set)
    head = pod_specs(rendered[value_set])["head"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["http"] == values["router"]["port"]
    expected = {"startupProbe": "/health", "livenessProbe": "/health", "readinessProbe": "/ready"}
    for probe, path in expected.items():
        assert head[probe]["httpGet"] == {"path": path, "port": "http"}, (probe, head[probe])
        timing = values["head"]["probes"][probe.removesuffix("Probe")]
        assert {k: head[probe][k] for k in timing} == timing
    # The startup probe waits for every worker actor (autoscaled pods, model load).
    startup = head["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    # KubeRay injects its own probes only where the chart gives none: the workers.
    for pool in ("prefill", "decode"):
        worker = pod_specs(rendered[value_set])[pool]["containers"][0]
        assert not {"livenessProbe", "readinessProbe", "startupProbe"} & set(worker)
        assert "http" not in {p["name"] for p in worker.get("ports", [])}


def test_probe_paths_need_no_api_key() -> None:
    """The router answers the probe paths without the key (orchestrators do not hold it);
    the probes send no header, so the chart depends on exactly this exemption."""
    import router.server as server

    exempt = getattr(server, "_PROBE_PATHS", None)
    assert exempt is not None, "router/server.py no longer names the paths exempt from the key"
    assert {"/health", "/ready"} <= set(exempt), exempt


def test_probe_timings_are_checked(helm: Helm) -> None:
    bad = helm.template("--set", "head.probes.liveness.failureThreshold=0")
    assert bad.returncode != 0 and "failureThreshold" in bad.stderr, bad.stderr
    extra = helm.template("--set", "head.probes.readiness.path=/other")
    assert extra.returncode != 0 and "path" in extra.stderr, extra.stderr
    size = helm.template("--set", "scratch.tmp.sizeLimit=lots")
    assert size.returncode != 0 and "sizeLimit" in size.stderr, size.stderr
    home = helm.template("--set", "scratch.home.mountPath=/tmp")
    assert home.returncode != 0 and "scratch.home.mountPath" in home.stderr, home.stderr


# ---- the NetworkPolicy -------------------------------------------------------------------------


def _release_peer() -> list[dict[str, Any]]:
    release = {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": "tandem"}
    return [{"podSelector": {"matchLabels": release}}]


def assert_policy(manifests: list[dict[str, Any]], values: dict[str, Any]) -> None:
    np = one(manifests, "NetworkPolicy")
    assert np["spec"]["policyTypes"] == ["Ingress"]
    assert np["spec"]["podSelector"] == _release_peer()[0]["podSelector"]
    internal = [r for r in np["spec"]["ingress"] if r.get("from") == _release_peer()]
    external = [r for r in np["spec"]["ingress"] if r.get("from") != _release_peer()]
    assert len(internal) == 1 and "ports" not in internal[0]
    by_port = {tuple(p["port"] for p in r["ports"]): r for r in external}
    router_from = values["networkPolicy"]["routerFrom"]
    metrics_from = values["networkPolicy"]["metricsFrom"]
    assert by_port[("http",)].get("from", []) == router_from
    assert by_port[("http",)]["ports"] == [{"port": "http", "protocol": "TCP"}]
    if metrics_from:
        assert by_port[("metrics",)]["from"] == metrics_from
    assert set(by_port) == ({("http",), ("metrics",)} if metrics_from else {("http",)}), by_port
    # `http` names the router's port on the head only: the rule reaches nothing else.
    holders = [
        (component, c["name"])
        for component, spec in pod_specs(manifests).items()
        for c in _containers(spec)
        if "http" in {p["name"] for p in c.get("ports", [])}
    ]
    assert holders == [("head", "ray-head")], holders
    kubernetes_validate.validate(np, K8S_VERSION, strict=True)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_networkpolicy_opens_only_the_router_port_outside_the_release(
    rendered: dict[str, list[dict]], value_set: str
) -> None:
    assert_policy(rendered[value_set], _values(value_set))


def test_networkpolicy_peers_come_from_router_from_and_metrics_from(helm: Helm) -> None:
    scraper = [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    clients = [{"podSelector": {"matchLabels": {"role": "gateway"}}}]
    manifests = _render(
        helm,
        "gpu-rdma",
        "--set-json",
        f"networkPolicy.metricsFrom={json.dumps(scraper)}",
        "--set-json",
        f"networkPolicy.routerFrom={json.dumps(clients)}",
    )
    values = _values("gpu-rdma", {"networkPolicy": {"metricsFrom": scraper, "routerFrom": clients}})
    assert_policy(manifests, values)
    off = _render(helm, "default", "--set", "networkPolicy.enabled=false")
    assert not find(off, "NetworkPolicy")
