"""The planner: sizes the prefill and decode pools from the traffic (README.md: reading order).

`make_policy(spec, profile, config)` builds any policy by its command-line name; the live
autoscaler (cluster/autoscaler.py) and the simulator (cluster/simulator/) both call it.
"""

from __future__ import annotations

from bench.capacity_profile import CapacityProfile

from .baselines import ColocatedPolicy, DynamoStylePolicy, StaticPolicy, ThresholdPolicy
from .config import PlannerConfig
from .policy import Planner
from .types import Policy

POLICY_SPECS = ("planner", "static:P:D", "colocated:K", "dynamo", "threshold")

__all__ = [
    "POLICY_SPECS",
    "ColocatedPolicy",
    "DynamoStylePolicy",
    "Planner",
    "PlannerConfig",
    "StaticPolicy",
    "ThresholdPolicy",
    "make_policy",
]


def make_policy(spec: str, profile: CapacityProfile, config: PlannerConfig) -> Policy:
    """`planner`, `static:P:D` (P prefill and D decode workers), `colocated:K`, `dynamo` or
    `threshold`; a ValueError naming the spec otherwise."""
    name, *args = spec.strip().split(":")
    if name == "planner" and not args:
        return Planner(profile, config)
    if name == "dynamo" and not args:
        return DynamoStylePolicy(profile, config)
    if name == "threshold" and not args:
        return ThresholdPolicy(profile, config)
    try:
        if name == "static" and len(args) == 2:
            prefill, decode = (int(a) for a in args)
            return StaticPolicy(prefill, decode)
        if name == "colocated" and len(args) == 1:
            return ColocatedPolicy(int(args[0]))
    except ValueError as e:  # int() or the policy's own check
        raise ValueError(f"policy {spec!r}: {e}") from None
    raise ValueError(f"unknown policy {spec!r}; policies are {', '.join(POLICY_SPECS)}")
