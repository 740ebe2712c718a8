"""Placement of tensor-parallel workers on a local multi-node Ray cluster
(`ray.cluster_utils.Cluster`; each node's fake GPU count and `tandem_prefill` units stand in
for its GPUs): a TP group's bundles land on one node and its rank 0 sees one GPU per bundle, a
group that fits no node stays pending instead of spreading, removing a group (what a drain,
a stop or a cancelled start does) frees its node, and a restarted rank 0 comes back in its
group.

The actor here is a trivial stand-in for `WorkerActor` (no model is loaded), created with the
options `cluster.worker_launch.place_worker` returns, and it calls
`cluster.worker_actor.share_group_gpus` as the worker does: the placement code is the real
worker's, only the payload differs."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import get_placement_group, placement_group_table  # noqa: E402

from cluster.worker_launch import (  # noqa: E402
    GROUP_PREFIX,
    WorkerSpec,
    place_worker,
    remove_worker_group,
)
from engine.roles import DECODE, PREFILL  # noqa: E402

HERE = Path(__file__).resolve().parent
GPUS_PER_NODE = 3  # two TP-2 groups leave one GPU free on each node: 2 free, none together


class RankZero:
    """What WorkerActor does about placement, and nothing else."""

    def __init__(self, tp: int):
        from cluster.worker_actor import share_group_gpus

        self.gpus = share_group_gpus(tp)

    def where(self) -> dict:
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "gpus": self.gpus,
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "pid": os.getpid(),
        }


def _spec(**kw) -> WorkerSpec:
    base = dict(
        engine_kwargs={"model": "/m"},
        quantization={},
        bind_host="127.0.0.1",
        use_gpu=True,
        cpus_per_worker=1.0,
        lease_seconds=1.0,
        on_transfer_failure="recompute",
        log_level="WARNING",
        max_frame_bytes=1 << 20,
        kv_read_timeout_s=1.0,
        max_restarts=-1,
        resources={PREFILL: "tandem_prefill"},
        tp={PREFILL: 2, DECODE: 1},
    )
    return WorkerSpec(**{**base, **kw})


@pytest.fixture(scope="module")
def cluster():
    # Ray's workers import RankZero from this file (never pickled by value).
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), old]))
    # Two nodes of 3 fake GPUs and 3 units of tandem_prefill each (the head is one of them:
    # a raylet fewer to start).
    node = {"num_cpus": 3, "num_gpus": GPUS_PER_NODE, "resources": {"tandem_prefill": 3}}
    c = Cluster(initialize_head=True, head_node_args=node)
    nodes = [c.head_node, c.add_node(**node)]
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="tandem-tp-test", logging_level="ERROR")
    yield c, {n.node_id for n in nodes}
    ray.shutdown()
    c.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


def _start(spec: WorkerSpec, wid: str, role: str = PREFILL):
    actor_class = ray.remote(RankZero)
    return actor_class.options(**place_worker(spec, wid, role)).remote(spec.tp_size(role))


def _free_gpus() -> dict[str, float]:
    """Node id -> GPUs not reserved, from each node's own view."""
    out = {}
    for node in ray.nodes():
        if node["Alive"] and node["Resources"].get("GPU"):
            out[node["NodeID"]] = node["Resources"]["GPU"]
    # Ray's per-node view (no public call has it without the dashboard).
    avail = ray._private.state.available_resources_per_node()
    return {nid: avail.get(nid, {}).get("GPU", 0.0) for nid in out}


def _where_after_restart(actor, old_pid: int, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            w = ray.get(actor.where.remote(), timeout=timeout)
        except ray.exceptions.RayActorError:  # dead or restarting: ask again
            time.sleep(0.2)
            continue
        if w["pid"] != old_pid:
            return w
        time.sleep(0.2)
    raise AssertionError("rank 0 did not come back")


def _named(name: str) -> bool:
    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


def _wait(cond, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def test_bundles_per_rank_with_the_pool_resource():
    spec = _spec(use_gpu=False, cpus_per_worker=0.5)
    assert spec.bundles(PREFILL) == [{"CPU": 0.5, "tandem_prefill": 1}] * 2
    assert spec.bundles(DECODE) == [{"CPU": 0.5}]
    gpu = _spec()
    assert gpu.bundles(PREFILL) == [{"GPU": 1, "CPU": 1, "tandem_prefill": 1}] * 2
    # Rank 0 asks exactly bundle 0's share; a TP-1 worker is the plain actor of before.
    opts = gpu.actor_options("p", PREFILL)
    assert (opts["num_gpus"], opts["num_cpus"], opts["resources"]) == (1, 1, {"tandem_prefill": 1})
    assert "scheduling_strategy" not in place_worker(gpu, "d", DECODE)
    with pytest.raises(ValueError, match="tp"):
        _spec(tp={PREFILL: 0})


def test_groups_pack_wait_and_free(cluster):
    _, gpu_nodes = cluster
    spec = _spec()
    a, b = _start(spec, "prefill-0"), _start(spec, "prefill-1")
    where = ray.get([a.where.remote(), b.where.remote()], timeout=60)
    for wid, w in zip(("prefill-0", "prefill-1"), where, strict=True):
        table = placement_group_table(get_placement_group(GROUP_PREFIX + wid))
        assert table["strategy"] == "STRICT_PACK" and table["state"] == "CREATED"
        nodes = set(table["bundles_to_node_id"].values())
        assert nodes == {w["node"]} and w["node"] in gpu_nodes, table
        # Rank 0 sees one GPU per bundle, its own first: the ranks it starts inherit them.
        assert len(set(w["gpus"])) == 2 and w["visible"] == ",".join(w["gpus"])
    assert where[0]["node"] != where[1]["node"]  # 3 GPUs a node: the second group moved on
    assert sorted(_free_gpus().values()) == [1.0, 1.0]

    # Two GPUs are free, one on each node: a third group waits whole, reserving nothing.
    c = _start(spec, "prefill-2")
    pending = get_placement_group(GROUP_PREFIX + "prefill-2")
    ready, _ = ray.wait([pending.ready()], timeout=2.0)
    assert not ready and placement_group_table(pending)["state"] == "PENDING"
    assert sorted(_free_gpus().values()) == [1.0, 1.0]

    # Removing a group (a drained worker's) frees its node: the waiting group gets it.
    assert remove_worker_group("prefill-0")
    assert not remove_worker_group("prefill-0")  # idempotent
    w = ray.get(c.where.remote(), timeout=60)
    assert w["node"] == where[0]["node"] and len(set(w["gpus"])) == 2

    # A rank 0 that dies is restarted by Ray in its group: same node, the same GPUs.
    os.kill(where[1]["pid"], signal.SIGKILL)
    again = _where_after_restart(b, where[1]["pid"])
    assert (again["node"], sorted(again["gpus"])) == (where[1]["node"], sorted(where[1]["gpus"]))

    for wid in ("prefill-1", "prefill-2"):
        assert remove_worker_group(wid)
    assert _wait(lambda: sorted(_free_gpus().values()) == [3.0, 3.0])

    # The planner reuses the id of a drained worker: a fresh group under the same name, once
    # the old actor's name is released (ray.kill is asynchronous).
    assert _wait(lambda: not _named("tandem-worker-prefill-1"))
    again = _start(spec, "prefill-1")
    assert len(set(ray.get(again.where.remote(), timeout=60)["gpus"])) == 2
    assert remove_worker_group("prefill-1")


def test_a_local_ray_refuses_a_group_larger_than_its_gpus(cluster):
    """On a Ray it started itself (one node, no autoscaler) a deployment refuses at start a
    TP group that would wait forever: here 8 GPUs asked, 6 in the cluster."""
    from cluster.deployment import Deployment
    from cluster.settings import ServeSettings
    from engine.roles import COLOCATED

    dep = Deployment(ServeSettings(model="/m", mode="colocated", tp=8))
    with pytest.raises(ValueError, match="--tp 8 needs 8 GPUs on one node; this machine has 6"):
        dep._check_local_gpus(_spec(tp={COLOCATED: 8}), {COLOCATED})
    dep._check_local_gpus(_spec(tp={COLOCATED: 2}), {COLOCATED})
