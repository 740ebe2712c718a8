"""Decode-side KV reuse on multi-turn chat: what the decode worker READs over NIXL and how long
the hand-off takes, with its prefix cache on (it takes the blocks an earlier turn left and
reads only the rest) against off (every block read), measured in the same run.

    .venv/bin/python benchmarks/kv_reuse.py                       # SmolLM2-135M, fp32
    .venv/bin/python benchmarks/kv_reuse.py --model DIR --conversations 4 --turns 3 --json OUT

Both runs: one prefill and one decode worker in this process (real engines, ZMQ sockets and
NIXL agents, as tests/workers/test_handoff.py builds them), the same seeded conversations.
Each turn's prompt is the previous turn's prompt, its answer and a new user message (token
ids); every turn is prefilled on the prefill worker (whose own prefix cache works in both
runs) and decoded on the decode worker. Per turn after the first, each conversation's
hand-off time is the gap between its first token (from the prefill worker) and its second
(from the decode worker: the READ plus one decode step). The answers must be the same in both
runs (greedy), so reuse changes what moves, not what is said.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import zmq

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # allow `python benchmarks/kv_reuse.py` from anywhere
    sys.path.insert(0, str(REPO))

from benchmarks.conversations import add_conversation_flags, load_conversations  # noqa: E402
from decode_worker.server import decode_server  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.protocol import PrefillRequest, SamplingParams, TokenMessage, decode, encode  # noqa: E402
from kv_transfer.agent import KVTransferAgent  # noqa: E402
from prefill_worker.server import prefill_server  # noqa: E402


class Workers:
    """A prefill and a decode worker, a sink for their tokens, a socket to each."""

    def __init__(self, model: str, reuse: bool, num_blocks: int, tag: str):
        kw = dict(
            model=model, dtype="float32", max_num_batched_tokens=512, num_kv_blocks=num_blocks
        )
        pe = LLMEngine(EngineConfig(**kw, role="prefill"))
        de = LLMEngine(EngineConfig(**kw, role="decode", enable_prefix_caching=reuse))
        self.p = prefill_server(f"p-{tag}", pe, KVTransferAgent(f"p-{tag}", pe.cache))
        self.d = decode_server(f"d-{tag}", de, KVTransferAgent(f"d-{tag}", de.cache))
        self.ctx = zmq.Context()
        self.sink = self.ctx.socket(zmq.PULL)
        self.sink.bind("tcp://127.0.0.1:*")
        self.reply_to = self.sink.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(self.p.endpoint)
        self.p.start()
        self.d.start()

    def turn(self, prompts: dict[str, list[int]], sp: SamplingParams) -> dict[str, tuple]:
        """Send every prompt; returns rid -> (output ids, hand-off seconds)."""
        first, second, out, done = {}, {}, {r: {} for r in prompts}, set()
        for rid, prompt in prompts.items():
            msg = PrefillRequest(rid, prompt, sp, self.reply_to, self.d.worker_id, self.d.endpoint)
            self.push.send(encode(msg))
        deadline = time.time() + 300
        while done != set(prompts):
            if time.time() > deadline:
                raise TimeoutError(f"turn not done: {sorted(set(prompts) - done)}")
            if not self.sink.poll(100):
                continue
            m = decode(self.sink.recv(), expect=TokenMessage)
            if m.finish_reason == "error":
                raise RuntimeError(f"{m.request_id}: {m.error}")
            now = time.perf_counter()
            for i, t in enumerate(m.token_ids):
                out[m.request_id][m.index + i] = t
                (first if m.index + i == 0 else second).setdefault(m.request_id, now)
            if m.finish_reason:
                done.add(m.request_id)
        return {r: ([v[i] for i in sorted(v)], second[r] - first[r]) for r, v in out.items()}

    def close(self) -> None:
        self.p.stop()
        self.d.stop()
        self.sink.close(0)
        self.push.close(0)
        self.ctx.term()


def run(args, reuse: bool, convs) -> dict:
    w = Workers(args.model, reuse, args.num_blocks, "reuse" if reuse else "base")
    sp = SamplingParams(max_tokens=args.answer_tokens, temperature=0, ignore_eos=True)
    prompts = {f"c{i}": list(turns[0]) for i, turns in enumerate(convs)}
    answers, handoffs, t0 = [], [], time.perf_counter()
    try:
        for turn in range(args.turns):
            got = w.turn({f"{c}-t{turn}": p for c, p in prompts.items()}, sp)
            for i, c in enumerate(prompts):
                ids, gap = got[f"{c}-t{turn}"]
                answers.append(ids)
                if turn:
                    handoffs.append(gap)
                if turn + 1 < args.turns:
                    prompts[c] = prompts[c] + ids + convs[i][turn + 1]
            print(
                f"  {'reuse' if reuse else 'base '} turn {turn + 1}/{args.turns} done", flush=True
            )
        load = w.d.connector.extra_load()
        stats = w.d.connector.agent.stats()
    finally:
        w.close()
    return {
        "reuse": reuse,
        "seconds": round(time.perf_counter() - t0, 2),
        "bytes_read": stats.bytes_read,
        "read_blocks": load["read_blocks"],
        "reused_blocks": load["reused_blocks"],
        "handoff_ms_p50": round(1e3 * statistics.median(handoffs), 2),
        "handoff_ms_mean": round(1e3 * statistics.fmean(handoffs), 2),
        "answers": answers,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_conversation_flags(ap)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    convs = load_conversations(args)
    base, reuse = run(args, False, convs), run(args, True, convs)
    if base.pop("answers") != reuse.pop("answers"):
        raise SystemExit("the answers differ between the runs: reuse changed what was said")
    result = {
        "model": args.model, "conversations": args.conversations, "turns": args.turns,
        "base": base, "reuse": reuse,
        "bytes_ratio": base["bytes_read"] / max(1, reuse["bytes_read"]),
        "handoff_p50_ratio": base["handoff_ms_p50"] / reuse["handoff_ms_p50"],
    }  # fmt: skip
    for r in (base, reuse):
        name = "reuse" if r["reuse"] else "every block read"
        print(f"{name:>17}: {r['bytes_read'] / 2**20:8.1f} MiB read, {r['read_blocks']} blocks "
              f"read, {r['reused_blocks']} reused, hand-off p50 {r['handoff_ms_p50']} ms "
              f"(mean {r['handoff_ms_mean']}), {r['seconds']} s")  # fmt: skip
    print(f"bytes read: {result['bytes_ratio']:.2f}x less; hand-off p50: "
          f"{result['handoff_p50_ratio']:.2f}x faster; answers identical")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
