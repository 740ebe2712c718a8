"""The fake decode worker of benchmarks/router_overhead.py: streams canned tokens, no model.

Run as `python benchmarks/router_overhead_worker.py --tree TREE --tokens 1,2,3 ...` with TREE
first on sys.path (PYTHONPATH=TREE, cwd=TREE). It imports only `engine.wire` (encode/decode)
and `engine.protocol` (the constructor keywords and attributes of `GenerateRequest`,
`TokenMessage` and `AbortRequest` that every tree shares), so the same source runs against the
old tree's router and the new one, each with its own wire format.

Lifecycle: check that `engine` comes from TREE (exit 3 otherwise: the venv's editable install
would silently put /work/main in its place), bind a PULL socket on a random local port, print
`ENDPOINT tcp://...` and serve until SIGTERM/SIGINT. Each received `GenerateRequest` becomes a
job; every pass of the loop is one "decode step" that sends each job its next `--chunk`
tokens in one `TokenMessage` (one message per request per step, as a real decode step does),
up to the request's `max_tokens` (capped by `--max-output`), `finish_reason` "length" on the
last. Output token i is `tokens[i % len(tokens)]`. An `AbortRequest` drops its job; anything
else is ignored.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def check_tree(tree: str, *modules) -> None:
    """Exit 3 unless every module's file lies under `tree` (loudly: the numbers would be a lie)."""
    root = os.path.realpath(tree) + os.sep
    for mod in modules:
        path = os.path.realpath(mod.__file__)
        if not path.startswith(root):
            print(
                f"TREE MISMATCH: {mod.__name__} from {path}, wanted under {root}", file=sys.stderr
            )
            sys.exit(3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", required=True, help="the source tree engine must come from")
    p.add_argument("--tokens", required=True, help="comma-separated output token ids")
    p.add_argument("--chunk", type=int, default=1, help="tokens per TokenMessage")
    p.add_argument("--max-output", type=int, default=64, help="cap on tokens per request")
    p.add_argument("--step-ms", type=float, default=0.0, help="pause between decode steps")
    args = p.parse_args(argv)

    import zmq

    import engine.protocol
    import engine.wire
    from engine.protocol import AbortRequest, GenerateRequest, TokenMessage
    from engine.wire import decode, encode

    check_tree(args.tree, engine.wire, engine.protocol)
    tokens = [int(t) for t in args.tokens.split(",")]
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    print(f"ENDPOINT tcp://127.0.0.1:{port}", flush=True)
    print(f"ENGINE {engine.wire.__file__}", flush=True)
    push: dict[str, zmq.Socket] = {}
    jobs: dict[str, list] = {}  # request_id -> [reply_to, next index, total]

    while not stop:
        # Take every frame waiting; block (briefly, to notice a signal) only when idle.
        while pull.poll(0 if jobs else 100):
            msg = decode(pull.recv())
            if isinstance(msg, GenerateRequest):
                total = min(msg.sampling.max_tokens, args.max_output)
                jobs[msg.request_id] = [msg.reply_to, 0, total]
            elif isinstance(msg, AbortRequest):
                jobs.pop(msg.request_id, None)
        for rid, job in list(jobs.items()):
            reply_to, start, total = job
            end = min(start + args.chunk, total)
            ids = [tokens[i % len(tokens)] for i in range(start, end)]
            finish = "length" if end >= total else None
            tm = TokenMessage(
                request_id=rid, index=start, token_ids=ids, finish_reason=finish, worker_id="fake"
            )
            sock = push.get(reply_to)
            if sock is None:
                sock = push[reply_to] = ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(reply_to)
            sock.send(encode(tm))
            if finish:
                del jobs[rid]
            else:
                job[1] = end
        if args.step_ms > 0 and jobs:
            time.sleep(args.step_ms / 1000)

    for sock in push.values():
        sock.close(linger=0)
    pull.close(linger=0)
    ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
