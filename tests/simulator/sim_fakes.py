"""What the simulator tests share: a capacity profile of round numbers, and small policies
(fixed pools, a script of pool sizes, a recorder of the windows a policy is shown)."""

from __future__ import annotations

from bench.capacity_profile import CapacityProfile
from cluster.planner.types import Decision, PoolCounts
from cluster.simulator.traces import SimRequest
from router.signals import WindowSignals

# Round numbers, so the hand computations in the tests read easily:
#   prefill_s(t) = t * 1e-4 s (0.1 s per 1000 tokens)
#   decode step  = 0.01 + 0.001 * batch + 1e-6 * context
#   transfer_s(t) = 0.005 + t * 1000 B / 1e8 B/s = 0.005 + t * 1e-5
PROFILE = dict(
    model="test",
    hardware="test",
    source="roofline",
    prefill_points=[(1000, 0.1)],
    decode_fixed_s=0.01,
    decode_per_seq_s=0.001,
    decode_per_ctx_token_s=1e-6,
    kv_bytes_per_token=1000,
    transfer_latency_s=0.005,
    transfer_bytes_per_s=1e8,
    kv_capacity_tokens=100_000,
    max_batch_tokens=1000,
    max_num_seqs=8,
    startup_s=30.0,
)


def make_profile(**overrides) -> CapacityProfile:
    return CapacityProfile(**{**PROFILE, **overrides})


def decode_steps_s(profile: CapacityProfile, contexts: list[int], batch: int = 1) -> float:
    """Seconds of decode steps reading the given total contexts, one step each."""
    return sum(
        profile.decode_fixed_s
        + profile.decode_per_seq_s * batch
        + profile.decode_per_ctx_token_s * c
        for c in contexts
    )


def req(t: float, prompt: int, output: int, hash_ids: tuple[int, ...] = ()) -> SimRequest:
    return SimRequest(t, prompt, output, hash_ids)


class FixedPolicy:
    """Keeps the pools at fixed sizes."""

    name = "fixed"

    def __init__(self, **sizes: int) -> None:
        self.sizes = sizes

    def initial(self) -> dict[str, int]:
        return dict(self.sizes)

    def decide(self, now: float, window: WindowSignals, pools: PoolCounts) -> Decision:
        return Decision(dict(self.sizes), reasons=dict.fromkeys(self.sizes, "fixed"))


class ScriptedPolicy:
    """Starts with `initial`; from each (time, sizes) of `script` on, desires those sizes.
    Keeps every window and pool count it was shown."""

    name = "scripted"

    def __init__(self, initial: dict[str, int], script: list[tuple[float, dict[str, int]]]):
        self._initial = initial
        self.script = sorted(script, key=lambda s: s[0])
        self.windows: list[WindowSignals] = []
        self.pools: list[PoolCounts] = []

    def initial(self) -> dict[str, int]:
        return dict(self._initial)

    def decide(self, now: float, window: WindowSignals, pools: PoolCounts) -> Decision:
        self.windows.append(window)
        self.pools.append(pools)
        sizes = dict(self._initial)
        for t, s in self.script:
            if now >= t:
                sizes = dict(s)
        return Decision(sizes, reasons=dict.fromkeys(sizes, f"script at {now:g}s"))
