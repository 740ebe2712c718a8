"""The host-memory KV tier on multi-turn chat: prompt tokens prefilled and time spent, with a
device KV cache too small for the conversations, the tier off against on, in the same run.

    .venv/bin/python benchmarks/kv_host_tier.py                       # SmolLM2-135M, fp32
    .venv/bin/python benchmarks/kv_host_tier.py --model DIR --conversations 4 --json OUT

One colocated engine per run (real engine, no sockets), the same seeded conversations. Each
round submits every conversation's next turn together (its prompt: the previous prompt, the
answer and a new user message); `max_num_seqs` and the device cache leave room for a few
conversations at a time, so by the next round most of a conversation's blocks were evicted.
Without the tier they are recomputed; with it they come back from host memory. Prefill tokens
computed are counted from the step plans themselves (every prompt position a step computed,
recomputation after preemption included). The answers must be equal in both runs (greedy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # allow `python benchmarks/kv_host_tier.py` from anywhere
    sys.path.insert(0, str(REPO))

from benchmarks.common import set_threads  # noqa: E402
from benchmarks.conversations import add_conversation_flags, load_conversations  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.protocol import SamplingParams  # noqa: E402


def _meter(engine: LLMEngine, counts: dict) -> None:
    """Count the prompt positions every step computes, and time the steps."""
    execute = engine.runner.execute

    def run(plan):
        for s in plan.scheduled:
            seq, lo = s.seq, s.seq.num_computed_tokens
            counts["prefill"] += max(0, min(lo + s.num_new_tokens, seq.num_prompt_tokens) - lo)
        t0 = time.perf_counter()
        try:
            return execute(plan)
        finally:
            counts["step_s"] += time.perf_counter() - t0

    engine.runner.execute = run


def run(args, host_gb: float, convs) -> dict:
    engine = LLMEngine(
        EngineConfig(
            model=args.model, dtype="float32", num_kv_blocks=args.num_blocks,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=512, kv_host_cache_gb=host_gb,
        )
    )  # fmt: skip
    counts = {"prefill": 0, "step_s": 0.0}
    _meter(engine, counts)
    sp = SamplingParams(max_tokens=args.answer_tokens, temperature=0, ignore_eos=True)
    history = [[] for _ in convs]
    answers, ttft, cached, prompt_tokens = [], [], 0, 0
    t0 = time.perf_counter()
    for turn in range(args.turns):
        start, first, out = {}, {}, {}
        for i, conv in enumerate(convs):
            history[i] += conv[turn]
            rid = f"c{i}t{turn}"
            engine.add_request(rid, list(history[i]), sp)
            start[rid], out[rid] = time.perf_counter(), []
            prompt_tokens += len(history[i])
        while engine.has_unfinished():
            for o in engine.step():
                first.setdefault(o.request_id, time.perf_counter())
                out[o.request_id] += o.token_ids
                if o.finish_reason is not None:
                    cached += o.num_cached_tokens
        for i in range(len(convs)):
            rid = f"c{i}t{turn}"
            history[i] += out[rid]
            answers.append(out[rid])
            if turn > 0:
                ttft.append(first[rid] - start[rid])
    st = engine.stats()
    return {
        "host_gb": host_gb,
        "seconds": round(time.perf_counter() - t0, 2),
        "step_seconds": round(counts["step_s"], 2),
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": counts["prefill"],
        "cached_tokens": cached,
        "preemptions": st["num_preemptions"],
        "ttft_ms_mean_later_turns": round(1e3 * statistics.fmean(ttft), 1) if ttft else None,
        **{k: v for k, v in st.items() if k.startswith("host_")},
        "answers": answers,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_conversation_flags(ap)
    ap.add_argument("--num-blocks", type=int, default=96, help="device KV blocks (too few)")
    ap.add_argument("--max-num-seqs", type=int, default=3)
    ap.add_argument("--host-gb", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a shared box: 1)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    convs = load_conversations(args)
    off, on = run(args, 0.0, convs), run(args, args.host_gb, convs)
    if off.pop("answers") != on.pop("answers"):
        raise SystemExit("the answers differ between the runs: the host tier changed the output")
    result = {
        "model": args.model, "conversations": args.conversations, "turns": args.turns,
        "num_blocks": args.num_blocks, "max_num_seqs": args.max_num_seqs, "off": off, "on": on,
        "prefill_ratio": off["prefill_tokens_computed"] / max(1, on["prefill_tokens_computed"]),
        "step_time_ratio": off["step_seconds"] / on["step_seconds"],
        "wall_ratio": off["seconds"] / on["seconds"],
    }  # fmt: skip
    for name, r in (("host tier off", off), ("host tier on", on)):
        print(f"{name:>13}: {r['prefill_tokens_computed']} of {r['prompt_tokens']} prompt tokens "
              f"prefilled ({r['cached_tokens']} cached), steps {r['step_seconds']} s, wall "
              f"{r['seconds']} s, TTFT mean (turns 2+) {r['ttft_ms_mean_later_turns']} ms, "
              f"{r['preemptions']} preemptions")  # fmt: skip
    print(
        f"host tier: {on.get('host_promotions')} promotions, {on.get('host_demotions')} "
        f"demotions, {on.get('host_used_blocks')}/{on.get('host_total_blocks')} slots used"
    )
    print(f"prefill tokens: {result['prefill_ratio']:.2f}x fewer; step time "
          f"{result['step_time_ratio']:.2f}x less; wall {result['wall_ratio']:.2f}x; "
          "answers identical")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
