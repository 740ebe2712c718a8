"""Run by tests/faults/test_drain.py in its own process (Ray in-process): a 1P2D deployment
under streaming load, one decode worker drained away mid-load (`Deployment.drain_worker`).
Prints one JSON line: the outcomes, the drain result, and the workers left."""

from __future__ import annotations

import asyncio
import json
import sys
import time

from bench import fault_cases as fc
from bench import fault_requests as fr
from cluster.deployment import Deployment
from cluster.settings import ServeSettings


async def load_and_drain(dep: Deployment, n: int, max_tokens: int) -> tuple[list, dict]:
    texts = fc.prompts(n)
    refs = await fc.references(dep.url, texts, max_tokens)
    async with fr.session(120) as s:
        tasks, started = fc.launch_streams(s, dep.url, texts, refs, max_tokens, 90)
        await fc.wait_started(started, tasks, 10.0)
        drained = await asyncio.to_thread(dep.drain_worker, "decode-1", 60.0)
        # Requests sent after the drain must land on the worker that is left.
        after = [fr.guarded(fr.whole(s, dep.url, p, 8, None), 60) for p in fc.prompts(4)]
        outcomes = await asyncio.gather(*tasks, *after)
    return outcomes, drained


def _blocks_in_use(dep: Deployment, timeout_s: float = 15.0) -> dict[str, int]:
    """Per worker, KV blocks still in use once all are back or at the timeout (load reports
    trail the last request by a moment)."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = {
            wid: load["num_total_blocks"] - load["num_free_blocks"]
            for wid, load in dep.worker_loads().items()
        }
        if not any(used.values()) or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


def main(model: str) -> None:
    settings = ServeSettings(
        model=model,
        prefill=1,
        decode=2,
        port=0,
        num_cpus=2,
        disagg_threshold=8,
        inject_faults=json.dumps({"decode": {"step_delay_s": 0.01}}),
        engine={"dtype": "float32"},
    )
    with Deployment(settings) as dep:
        outcomes, drained = asyncio.run(load_and_drain(dep, 6, 120))
        import ray

        left = sorted(w["worker_id"] for w in ray.get(dep.controller.all_workers.remote()))
        leaked = _blocks_in_use(dep)
    print(
        "RESULT "
        + json.dumps(
            {
                "outcomes": [[o.kind, o.status, o.detail] for o in outcomes],
                "drained": drained,
                "left": left,
                "leaked": leaked,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1])
