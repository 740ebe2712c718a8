"""How `make test` splits the suite over pytest-xdist's workers (`-n 2` on a 2-core box).

The suite spends ~40% of its wall time waiting (on live deployments starting, planners'
intervals, timeouts being proven), so two workers finish it sooner: 22:15 against 36:09 in
one process on the 2-core AMD EPYC box (2026-11-28, the same tests, the same box). Each
worker's torch takes its share of the cores (tests/conftest.py).
What may not be split: a module's tests share its module-scoped live server, and a package with
a package-scoped server (fuzz: the HTTP fuzz proves the frame fuzz left that server whole;
interop: one server for lm-eval, the agents and the OpenAI client) must run in one worker, in
its collection order. So a unit of work is a file, or one of those packages whole.

Units start longest first, so that the last one to finish is a short one: the order comes from
a measured `--durations=0` run (2-core AMD EPYC, 2026-11-27). A stale list costs balance only,
never correctness: an unlisted unit runs after the listed ones.
"""

from __future__ import annotations

from collections import OrderedDict

from xdist.scheduler import LoadScopeScheduling

# Packages whose tests share a package-scoped live server: one unit each.
WHOLE_PACKAGES = ("tests/fuzz/", "tests/interop/")

# The longest units, longest first (seconds measured in one worker, rounded).
LONGEST_FIRST = (
    "tests/interop/",  # 195 s (+~30 s: guidellm, 2026-11-29)
    "tests/autoscale/test_live_autoscale.py",  # 158
    "tests/faults/test_worker_faults.py",  # 147
    "tests/e2e/test_serve_quantized.py",  # 142
    "tests/e2e/test_serve_logprobs.py",  # 108 (+~30 s: gemma3; +~40 s: the MoE pair, 2026-11-29)
    "tests/e2e/test_serve_parity.py",  # 95
    "tests/e2e/test_serve_kv_reuse.py",  # ~90 (added 2026-11-28, not in that run)
    "tests/fuzz/",  # 84
    "tests/engine/test_tensor_parallel.py",  # 77
    "tests/faults/test_transfer_policies.py",  # 72
    "tests/engine/test_quant_accuracy.py",  # 69
    "tests/cluster/test_compare_smoke.py",  # 58
    "tests/bench/test_sim_validation_smoke.py",  # 55
    "tests/faults/test_drain.py",  # 54
    "tests/bench/test_gpu_run_smoke.py",  # 53
    "tests/bench/test_overload_smoke.py",  # 44
    "tests/kv_transfer/test_tp_decode.py",  # 43
    "tests/kv_transfer/test_tp_handoff.py",  # 42
    "tests/bench/test_soak_smoke.py",  # 36
    "tests/engine/test_moe.py",  # ~35 (added 2026-11-29)
    "tests/engine/test_gemma3.py",  # ~30 (added 2026-11-29)
)


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its package for WHOLE_PACKAGES, else its file."""
    path = nodeid.split("::", 1)[0]
    return next((pkg for pkg in WHOLE_PACKAGES if path.startswith(pkg)), path)


def longest_first(units: list[str]) -> list[str]:
    """`units` with LONGEST_FIRST's in its order at the front, the rest after them."""
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    return sorted(units, key=lambda u: rank.get(u, len(rank)))


class FileOrPackageScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with `unit_of` as the scope and longest units first."""

    _ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node) -> None:
        # The queue is complete before its first unit is handed out: order it then, once.
        if not self._ordered:
            queue = self.workqueue
            self.workqueue = OrderedDict((u, queue[u]) for u in longest_first(list(queue)))
            self._ordered = True
        super()._assign_work_unit(node)
