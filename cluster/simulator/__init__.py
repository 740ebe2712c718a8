"""The trace-driven simulator of the router and the worker pools under a scaling policy
(`tandem simulate`); see README.md. The same `Policy` objects as the live autoscaler decide."""

from cluster.simulator.run import SimConfig, SimResult, simulate
from cluster.simulator.sweep import SweepResult, best_colocated, best_static
from cluster.simulator.traces import SimRequest, load_requests, shape_requests

__all__ = [
    "SimConfig",
    "SimRequest",
    "SimResult",
    "SweepResult",
    "best_colocated",
    "best_static",
    "load_requests",
    "shape_requests",
    "simulate",
]
