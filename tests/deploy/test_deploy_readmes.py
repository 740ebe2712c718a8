"""What helm/README.md, cluster/README.md and the top-level README.md tell a user to type
matches what the tests render: every `helm install/upgrade/template` renders with the same
flags, every name a command refers to (Service, Secret, release) is one the chart creates, every
`ray` command parses with Ray's own CLI and names a config that exists, and every `tandem serve`
command (and every flag the prose gives `tandem serve`) is one the real CLI parser accepts.

Each scan asserts it found what it expects before checking it, so a README that moves or a
pattern that stops matching fails instead of passing on nothing."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers import (
    CHART,
    EXAMPLES,
    RAY_CONFIGS,
    REPO,
    Helm,
    find,
    parse_serve_args,
    serve_argv,
    serve_options,
)

HELM_README = REPO / "helm" / "README.md"
CLUSTER_README = REPO / "cluster" / "README.md"
TOP_README = REPO / "README.md"
READMES = (HELM_README, CLUSTER_README, TOP_README)

# `helm install`/`upgrade` flags that only matter against a live cluster.
_INSTALL_ONLY = {
    "--create-namespace",
    "--wait",
    "--atomic",
    "--reuse-values",
    "--install",
    "-i",
    "--reset-values",
    "--rollback-on-failure",
}
_INSTALL_ONLY_WITH_VALUE = {"--timeout", "--version"}


def shell_commands(readme: Path) -> list[str]:
    """Commands in the README's bash code blocks, continuation lines joined (fails when the
    README has none: every scan below starts here)."""
    text = readme.read_text()
    commands: list[str] = []
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, flags=re.DOTALL):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [
            ln.strip()
            for ln in joined.splitlines()
            if ln.strip() and not ln.strip().startswith("#")
        ]
    assert commands, f"{readme.relative_to(REPO)} has no ```bash/sh/console block"
    return commands


def _words(command: str) -> list[str]:
    """A command's words, a trailing `# comment` dropped."""
    return shlex.split(command, comments=True)


def _chart_commands(readme: Path = HELM_README) -> list[list[str]]:
    """The README's `helm install/upgrade/template` commands of this chart."""
    out = []
    for c in shell_commands(readme):
        w = _words(c)
        if w[:2] in (["helm", "install"], ["helm", "upgrade"], ["helm", "template"]) and (
            "./helm/tandem" in w
        ):
            out.append(w)
    return out


def _to_template_args(words: list[str]) -> tuple[str, list[str], str]:
    """(release, helm template args, namespace) of a README helm install/upgrade/template."""
    args = words[2:]
    release = args[0]
    assert args[1] == "./helm/tandem", words
    namespace = "default"
    rest: list[str] = []
    i = 2
    while i < len(args):
        a = args[i]
        if a in _INSTALL_ONLY:
            i += 1
        elif a in _INSTALL_ONLY_WITH_VALUE:
            i += 2
        elif a in ("--namespace", "-n"):
            namespace = args[i + 1]
            i += 2
        elif a in ("-f", "--values", "--set", "--set-string", "--set-json", "--set-file"):
            if a in ("-f", "--values"):
                path = REPO / args[i + 1]
                assert path.is_file(), f"README names {args[i + 1]}, which does not exist"
            rest += [a, args[i + 1]]
            i += 2
        else:
            pytest.fail(f"README's helm command has a flag the test does not know: {a}")
    return release, rest, namespace


def test_helm_readme_shows_operator_install_upgrade_uninstall_and_port_forward() -> None:
    commands = shell_commands(HELM_README)
    heads = {" ".join(_words(c)[:2]) for c in commands}
    assert {
        "helm install",
        "helm upgrade",
        "helm uninstall",
        "helm test",
        "kubectl port-forward",
    } <= heads
    assert any(
        "kuberay/kuberay-operator" in c and c.startswith("helm install") for c in commands
    ), "the KubeRay operator install is missing"
    assert any(c.startswith("helm repo add kuberay ") for c in commands)


def test_every_readme_helm_command_renders(helm: Helm) -> None:
    commands = _chart_commands()
    # install (defaults, gpu-rdma, cpu-dev, autoscaling-off) and an upgrade.
    assert len(commands) >= 5, commands
    assert {w[1] for w in commands} >= {"install", "upgrade"}
    examples = {p.name for p in EXAMPLES.glob("*.yaml")}
    assert {"gpu-rdma.yaml", "cpu-dev.yaml", "autoscaling-off.yaml"} <= examples, examples
    shown = {Path(w[i + 1]).name for w in commands for i, a in enumerate(w) if a == "-f"}
    assert examples <= shown, f"README does not show {sorted(examples - shown)}"
    # The top-level README's Kubernetes quick start renders too.
    top = _chart_commands(TOP_README)
    assert top, "README.md shows no `helm install ... ./helm/tandem`"
    for words in commands + top:
        release, args, namespace = _to_template_args(words)
        proc = helm.run("template", release, CHART, "--namespace", namespace, *args)
        assert proc.returncode == 0, f"{' '.join(words)}:\n{proc.stderr}"


def _rendered_for_readme(helm: Helm) -> tuple[str, str, list[dict[str, Any]]]:
    """The first `helm install` in the README, rendered: the release the rest refers to."""
    installs = [w for w in _chart_commands() if w[1] == "install"]
    assert installs, "helm/README.md has no `helm install ... ./helm/tandem`"
    words = installs[0]
    release, args, namespace = _to_template_args(words)
    return release, namespace, helm.render(*args, release=release)


def test_readme_names_match_the_rendered_release(helm: Helm) -> None:
    release, namespace, manifests = _rendered_for_readme(helm)
    services = {m["metadata"]["name"] for m in find(manifests, "Service")}
    secrets = {m["metadata"]["name"]: m for m in find(manifests, "Secret")}
    rc = find(manifests, "RayCluster")[0]
    # KubeRay names the head's Service <RayCluster name>-head-svc.
    services.add(f"{rc['metadata']['name']}-head-svc")
    router_port = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    container_ports = {p["containerPort"] for p in router_port}
    checked: dict[str, int] = dict.fromkeys(
        ("port-forward", "helm test", "helm uninstall", "kubectl get -l", "secret"), 0
    )
    for c in shell_commands(HELM_README):
        w = _words(c.split("|")[0]) if not c.startswith("export") else []
        if w[:2] == ["kubectl", "port-forward"]:
            assert w[w.index("-n") + 1] == namespace
            target = next(a for a in w if a.startswith("svc/"))[4:]
            assert target in services, f"{target} is not a Service of release {release}"
            remote = int(w[-1].split(":")[1])
            assert remote in container_ports | {
                p["port"] for s in find(manifests, "Service") for p in s["spec"]["ports"]
            }
            checked["port-forward"] += 1
        elif w[:2] in (["helm", "test"], ["helm", "uninstall"]):
            assert w[2] == release and namespace in w, c
            checked[" ".join(w[:2])] += 1
        elif w[:2] == ["kubectl", "get"] and "-l" in w:
            assert w[w.index("-l") + 1] == f"app.kubernetes.io/instance={release}"
            checked["kubectl get -l"] += 1
    for c in shell_commands(HELM_README):
        m = re.search(r"kubectl get secret -n (\S+) (\S+) -o jsonpath='\{\.data\.([\w-]+)\}'", c)
        if m:
            assert m.group(1) == namespace and m.group(2) in secrets, c
            assert m.group(3) in secrets[m.group(2)]["data"]
            checked["secret"] += 1
    # Every kind of command was found (the router and the dashboard are port-forwarded).
    assert checked["port-forward"] >= 2 and all(checked.values()), checked


def test_readme_curl_uses_the_served_model_name_of_its_install(helm: Helm) -> None:
    _, _, manifests = _rendered_for_readme(helm)
    test_pod = next(m for m in find(manifests, "Pod") if m["metadata"]["name"].endswith("-test"))
    env = {e["name"]: e.get("value") for e in test_pod["spec"]["containers"][0]["env"]}
    assert f'"model": "{env["TANDEM_MODEL"]}"' in HELM_README.read_text()


# ---- cluster/README.md -----------------------------------------------------------------------


def _ray_commands(readme: Path = CLUSTER_README) -> list[list[str]]:
    """The README's `ray ...` commands, also those inside `$(...)` and pipes."""
    out = []
    for c in shell_commands(readme):
        for part in re.split(r"\$\(|\)|\|", c):
            w = _words(part.strip()) if part.strip() else []
            if w and w[0] == "ray":
                out.append(w)
    return out


def test_cluster_readme_covers_the_lifecycle() -> None:
    verbs = {w[1] for w in _ray_commands()}
    assert {"up", "attach", "exec", "dashboard", "down"} <= verbs, verbs
    text = CLUSTER_README.read_text()
    configs = sorted(RAY_CONFIGS.glob("*.yaml"))
    assert {p.name for p in configs} >= {"aws.yaml", "gcp.yaml"}, configs
    for path in configs:
        assert f"cluster/configs/{path.name}" in text, f"README does not mention {path.name}"


def test_every_ray_command_parses_with_rays_cli_and_names_a_config() -> None:
    from ray.scripts.scripts import cli

    commands = _ray_commands()
    assert len(commands) >= 6, commands
    top = _ray_commands(TOP_README)
    assert {w[1] for w in top} >= {"up", "attach", "dashboard", "down"}, top
    for w in commands + top:
        command = cli.commands[w[1]]
        # make_context parses and validates the options without running the command.
        ctx = command.make_context(f"ray {w[1]}", list(w[2:]))
        config = ctx.params["cluster_config_file"]
        assert (REPO / config).is_file(), f"{' '.join(w)}: no file {config}"
        assert Path(config).parent == RAY_CONFIGS.relative_to(REPO)


def test_cluster_readme_ports_and_files_match_the_configs() -> None:
    config = yaml.safe_load((RAY_CONFIGS / "aws.yaml").read_text())
    serve_cmd = next(c for c in config["head_start_ray_commands"] if "tandem serve" in c)
    serve = parse_serve_args(serve_argv(serve_cmd))
    attach = [w for w in _ray_commands() if w[1] == "attach"]
    assert attach and all(str(serve.port) == w[w.index("-p") + 1] for w in attach)
    text = CLUSTER_README.read_text()
    assert f"localhost:{serve.port}/v1/completions" in text
    assert f'"model": "{serve.served_model_name}"' in text
    # The files the README reads on the head (the serve log, the API key) are the config's.
    quoted_files = re.findall(r"'(?:cat|tail -n \d+) (~/[\w.-]+)'", text)
    assert set(quoted_files) >= {"~/tandem-serve.log", "~/.tandem-api-key"}, quoted_files
    for quoted in quoted_files:
        assert quoted in " ".join(
            config["head_start_ray_commands"] + config["head_setup_commands"]
        ), quoted
    # The resource lines the README quotes are the config's (the prefill and the decode type).
    pools = {
        name: node
        for name, node in config["available_node_types"].items()
        if any(k.startswith("tandem_") for k in node["resources"])
    }
    assert len(pools) == 2, sorted(config["available_node_types"])
    for name, node in pools.items():
        res = ", ".join(f'"{k}": {v}' for k, v in node["resources"].items())
        assert f"{name}:\n  resources: {{{res}}}" in text, name


def test_readme_serve_lines_parse_with_the_real_parser() -> None:
    """Every `tandem serve` command a README shows parses with the real parser. (helm/ and
    cluster/README.md show none in code blocks; their head commands are the chart's and the
    configs', checked in test_helm_chart.py and test_ray_up_configs.py.)"""
    lines = [c for r in READMES for c in shell_commands(r) if re.search(r"\btandem serve\b", c)]
    # README.md: the local quick start and the GPU box.
    assert len(lines) >= 2, lines
    for c in lines:
        ns = parse_serve_args(serve_argv(c))
        assert ns.model, c


def test_flags_the_readmes_attribute_to_tandem_serve_exist() -> None:
    """Prose such as `tandem serve --prefill-resource tandem_prefill` names real flags."""
    options = serve_options()
    spans = [
        span
        for r in READMES
        for span in re.findall(r"`((?:\S*/)?tandem serve\b[^`]*)`", r.read_text())
    ]
    flags = {f for span in spans for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", span)}
    # helm/README.md names --address, --prefill-resource, --decode-resource, --mode, ...
    assert len(flags) >= 5, spans
    assert flags <= options, f"not flags of `tandem serve`: {sorted(flags - options)}"
