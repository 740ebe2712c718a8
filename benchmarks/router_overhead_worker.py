"""The fake decode worker of benchmarks/router_overhead.py: streams canned tokens, no model.

Run as `python benchmarks/router_overhead_worker.py --tree TREE --tokens 1,2,3 ...` with TREE
first on sys.path (PYTHONPATH=TREE, cwd=TREE). It imports only the codec (encode/decode:
`engine.protocol` since 2026-11-29, `engine.wire` in older trees) and `engine.protocol` (the
constructor keywords and attributes of `GenerateRequest`, `TokenMessage` and `AbortRequest`
that every tree shares), so the same source runs against the old tree's router and the new
one, each with its own wire format.

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


def codec_module():
    """The module holding encode/decode: engine.protocol (engine/wire.py merged into it on
    2026-11-29) or, in an older tree, engine.wire."""
    import importlib

    import engine.protocol

    if hasattr(engine.protocol, "decode"):
        return engine.protocol
    return importlib.import_module("engine.wire")


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


class FakeDecode:
    """Requests in, canned tokens out: one `TokenMessage` of `chunk` tokens per request per step."""

    def __init__(self, ctx, tokens: list[int], chunk: int, max_output: int) -> None:
        import zmq

        from engine.protocol import AbortRequest, GenerateRequest, TokenMessage

        codec = codec_module()
        self._zmq, self._decode, self._encode = zmq, codec.decode, codec.encode
        self._types = (GenerateRequest, AbortRequest, TokenMessage)
        self.ctx, self.tokens, self.chunk, self.max_output = ctx, tokens, chunk, max_output
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.push: dict[str, object] = {}
        self.jobs: dict[str, list] = {}  # request_id -> [reply_to, next index, total]

    def take_requests(self) -> None:
        """Every frame waiting; block (briefly, to notice a signal) only when idle."""
        generate, abort, _ = self._types
        while self.pull.poll(0 if self.jobs else 100):
            msg = self._decode(self.pull.recv())
            if isinstance(msg, generate):
                total = min(msg.sampling.max_tokens, self.max_output)
                self.jobs[msg.request_id] = [msg.reply_to, 0, total]
            elif isinstance(msg, abort):
                self.jobs.pop(msg.request_id, None)

    def step(self) -> None:
        token_message = self._types[2]
        for rid, job in list(self.jobs.items()):
            reply_to, start, total = job
            end = min(start + self.chunk, total)
            ids = [self.tokens[i % len(self.tokens)] for i in range(start, end)]
            finish = "length" if end >= total else None
            tm = token_message(
                request_id=rid, index=start, token_ids=ids, finish_reason=finish, worker_id="fake"
            )
            self._socket(reply_to).send(self._encode(tm))
            if finish:
                del self.jobs[rid]
            else:
                job[1] = end

    def _socket(self, reply_to: str):
        sock = self.push.get(reply_to)
        if sock is None:
            sock = self.push[reply_to] = self.ctx.socket(self._zmq.PUSH)
            sock.setsockopt(self._zmq.LINGER, 0)
            sock.connect(reply_to)
        return sock

    def close(self) -> None:
        for sock in self.push.values():
            sock.close(linger=0)
        self.pull.close(linger=0)


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

    codec = codec_module()
    check_tree(args.tree, codec, engine.protocol)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    ctx = zmq.Context()
    worker = FakeDecode(ctx, [int(t) for t in args.tokens.split(",")], args.chunk, args.max_output)
    print(f"ENDPOINT tcp://127.0.0.1:{worker.port}", flush=True)
    print(f"ENGINE {codec.__file__}", flush=True)
    while not stop:
        worker.take_requests()
        worker.step()
        if args.step_ms > 0 and worker.jobs:
            time.sleep(args.step_ms / 1000)
    worker.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
