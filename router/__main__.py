"""`python -m router MODEL_DIR --workers workers.json`: the router alone, in front of workers
started some other way (debugging, single box). workers.json is a list of
`{"worker_id", "role", "request_endpoint"}` objects; their load is reported as idle.
Under Ray, `tandem serve` runs `RouterServer` with a directory backed by the controller."""

from __future__ import annotations

import argparse
import json
import logging

from engine.protocol import WorkerLoad
from router.config import add_arguments, config_from_args
from router.directory import StaticDirectory, WorkerInfo
from router.server import RouterServer


def load_workers(path: str) -> list[WorkerInfo]:
    with open(path) as f:
        entries = json.load(f)
    workers = []
    for e in entries:
        load = WorkerLoad(e["worker_id"], e["role"], 1, 1, 0, 0, 0)
        workers.append(WorkerInfo(e["worker_id"], e["role"], e["request_endpoint"], load))
    return workers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router", description=__doc__.splitlines()[0])
    parser.add_argument("model_path", help="local Hugging Face model directory")
    parser.add_argument("--workers", required=True, help="JSON list of workers")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = config_from_args(args, args.model_path)
    RouterServer(config, StaticDirectory(load_workers(args.workers))).run_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
