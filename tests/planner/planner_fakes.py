"""A capacity profile with round numbers and a window builder, shared by the planner tests.

The profile: prefill is linear at 20k tokens/s (a 10k-token step takes 0.5 s), a decode step
is 10 ms + 0.1 ms per sequence + 0.1 us per context token, no overheads, a 60 s start-up.
"""

from __future__ import annotations

from bench.capacity_profile import CapacityProfile
from cluster.planner.types import DECODE_POOL, PREFILL_POOL, PoolCounts
from router.signals import LatencySummary, LengthHistogram, WindowSignals

MU = 20_000.0  # prefill tokens/s of one worker


def round_profile(**overrides) -> CapacityProfile:
    fields = dict(
        model="round",
        hardware="paper",
        source="roofline",
        prefill_points=[(10_000, 0.5)],
        decode_fixed_s=0.01,
        decode_per_seq_s=1e-4,
        decode_per_ctx_token_s=1e-7,
        kv_bytes_per_token=1000,
        transfer_latency_s=0.001,
        transfer_bytes_per_s=1e9,
        kv_capacity_tokens=1_000_000,
        max_batch_tokens=10_000,
        max_num_seqs=256,
        startup_s=60.0,
    )
    fields.update(overrides)
    return CapacityProfile(**fields)


def window(
    start: float,
    rate: float,
    prompt: int = 1000,
    output: int = 100,
    duration: float = 10.0,
    uncached: float = 1.0,
    queued_tokens: int = 0,
    ttft: float | None = None,
    tpot: float | None = None,
    samples: int | None = None,
    decode_running: int = 0,
    decode_waiting: int = 0,
    kv_usage: float = 0.0,
    local_prefills: int = 0,
) -> WindowSignals:
    """A window of `rate` requests/s, every prompt `prompt` tokens and every answer `output`
    tokens (as many finished as arrived), with the given queues and observed latencies."""
    n = round(rate * duration)
    prompts, outputs = LengthHistogram(), LengthHistogram()
    if n:
        prompts.add(prompt, n)
        outputs.add(output, n)
    k = n if samples is None else samples
    return WindowSignals(
        start_s=start,
        duration_s=duration,
        arrivals=n,
        prompt_lengths=prompts,
        output_lengths=outputs,
        uncached_prompt_tokens=round(n * prompt * uncached),
        local_prefills=local_prefills,
        finished=n,
        queued_requests=queued_tokens // max(prompt, 1),
        queued_prompt_tokens=queued_tokens,
        decode_running=decode_running,
        decode_waiting=decode_waiting,
        kv_usage=kv_usage,
        ttft=LatencySummary(k, ttft, ttft, ttft) if ttft is not None else LatencySummary(),
        tpot=LatencySummary(k, tpot, tpot, tpot) if tpot is not None else LatencySummary(),
    )


def pools(prefill: int, decode: int, starting=(0, 0), draining=(0, 0)) -> PoolCounts:
    return PoolCounts(
        ready={PREFILL_POOL: prefill, DECODE_POOL: decode},
        starting={PREFILL_POOL: starting[0], DECODE_POOL: starting[1]},
        draining={PREFILL_POOL: draining[0], DECODE_POOL: draining[1]},
    )


def follow(policy, windows, start=(1, 1), ready_at_once: bool = True):
    """Run `policy` over `windows`, applying each decision at once (workers ready the next
    window when `ready_at_once`); returns the list of (prefill, decode) after each decision."""
    have = list(start)
    sizes = []
    for w in windows:
        now = w.start_s + w.duration_s
        d = policy.decide(now, w, pools(*have))
        have = [d.desired[PREFILL_POOL], d.desired[DECODE_POOL]]
        sizes.append(tuple(have))
    return sizes
