"""The sentences a decision gives for each pool's size (`Decision.reasons`): the load the plan
was sized for, the workers it needs at what per-worker rate, the target and the prediction.
Pure text; `policy.Planner` picks which sentence applies."""

from __future__ import annotations

from .plans import PoolPlan
from .sizing import Targets, ms
from .types import PREFILL_POOL


def explain(pool: str, plan: PoolPlan, targets: Targets) -> tuple[str, str]:
    """(cause, a sentence with the numbers) of `pool`'s size under `plan`."""
    if pool == PREFILL_POOL:
        pre = plan.prefill
        if pre.load is None or plan.local_only:
            return "demand", f"{pre.note or 'no prompts for the prefill pool'}"
        load = pre.load
        text = (
            f"{tokens(load.tokens_per_s)} prompt tok/s forecast + {tokens(load.backlog_tokens)} "
            f"queued tokens need {pre.workers} workers at {tokens(load.mu)} tok/s each for "
            f"TTFT p90 <= {ms(targets.slo_ttft_s)}{per_1k(targets)} "
            f"(predicted {ms(pre.ttft_p90_s)})"
        )
        return pre.cause, text + (f"; {pre.note}" if pre.note else "")
    dec = plan.decode
    load = dec.load
    text = (
        f"{tokens(load.tokens_per_s)} output tok/s forecast need {dec.workers} workers at "
        f"{tokens(dec.tokens_per_s_per_worker)} tok/s each (batch {dec.batch} at "
        f"{load.context:.0f} context tokens) for TPOT p50 <= {ms(targets.slo_tpot_s)} "
        f"(predicted {ms(dec.tpot_p50_s)})"
    )
    if load.local_rate > 0:
        busy = load.local_work / max(dec.workers, 1)
        text += f", {busy:.0%} of their time prefilling {load.local_rate:.1f} prompts/s"
    return dec.cause, text + (f"; {dec.note}" if dec.note else "")


def per_1k(targets: Targets) -> str:
    return f" + {ms(targets.ttft_per_1k_s)} per 1k tokens" if targets.ttft_per_1k_s else ""


def tokens(n: float) -> str:
    """A token count or rate in short form: 950, 41.3k, 1.1M."""
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e3:.1f}k" if n >= 1e3 else f"{n:.0f}"
