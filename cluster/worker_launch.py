"""Starting one worker actor: the same options wherever it is started from.

`tandem serve` starts the first pools from the driver (cluster/deployment.py); with
`--autoscale` the controller starts more later (cluster/autoscaler.py). Both build the actor
from one `WorkerSpec` (a plain dict on its way to the controller, so Ray carries it without
pickling code), so a worker added by the planner is exactly like one started at launch.

Lifecycle of a launch: `launch_worker(spec, wid, role)` creates the named, restartable actor
(`tandem-worker-<id>`) asking Ray for its CPU share or a GPU, and for the pool's custom
resource (`tandem_prefill` / `tandem_decode` on clusters whose autoscaler adds nodes for
them); its constructor loads the model and binds its sockets; the caller then reads
`info()` and registers it with the controller.

A worker is a tensor-parallel group of `tp` ranks (`WorkerSpec.tp`, per role). With tp > 1
`place_worker` first creates its placement group `tandem-group-<id>`: one bundle per rank
(one GPU, or the rank's CPU share, and one unit of the pool's resource), STRICT_PACK so every
rank is on one node; the actor (rank 0) is scheduled into bundle 0, and starts ranks 1..N-1
as its own subprocesses (engine/distributed.py) inside the bundles the group reserved; with
GPUs, `cluster.worker_actor.share_group_gpus` makes the bundles' GPUs visible to them. A
group that fits no node stays pending (Ray's autoscaler sees the whole group as demand and
adds a node; the ranks are never spread), and the actor waits in it. The group is detached
from whoever created it (the driver, or the controller, which Ray may restart) and named, so
it outlives them and goes only by `remove_worker_group`: when the worker is drained, stopped
or its start cancelled. Ray restarts a dead rank-0 actor in the same group (same node, same
GPUs); a lost node's group is re-placed by Ray as a whole. With tp == 1 there is no group:
one actor, as before.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine.roles import DECODE, PREFILL

WORKER_PREFIX = "tandem-worker-"
GROUP_PREFIX = "tandem-group-"


@dataclass(slots=True)
class WorkerSpec:
    """Everything a worker actor is built from, per role where it differs."""

    engine_kwargs: dict  # EngineConfig fields shared by every role (model, dtype, ...)
    quantization: dict[str, str]  # role -> EngineConfig.quantization
    bind_host: str
    use_gpu: bool
    cpus_per_worker: float  # Ray CPUs each rank asks for (without a GPU): a TP-N worker N x
    lease_seconds: float
    on_transfer_failure: str
    log_level: str
    max_frame_bytes: int
    kv_read_timeout_s: float
    max_restarts: int
    resources: dict[str, str] = field(default_factory=dict)  # role -> custom Ray resource
    faults: dict[str, dict] = field(default_factory=dict)  # role -> testing-only fault plan
    tp: dict[str, int] = field(default_factory=dict)  # role -> ranks (GPUs) per worker; 1 if absent

    def __post_init__(self) -> None:
        if not self.cpus_per_worker > 0:
            raise ValueError(f"cpus_per_worker must be > 0, got {self.cpus_per_worker}")
        for role, n in self.tp.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"tp[{role!r}] must be an integer >= 1, got {n!r}")

    def tp_size(self, role: str) -> int:
        return self.tp.get(role, 1)

    @property
    def num_threads(self) -> int:
        """Torch threads of one worker: its whole CPU share, at least one."""
        return max(1, int(self.cpus_per_worker))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> WorkerSpec:
        return cls(**d)

    def engine_config(self, role: str) -> dict:
        """EngineConfig fields of a worker of `role`: the shared ones, its pool's weights and
        its TP size."""
        return {
            **self.engine_kwargs,
            "quantization": self.quantization.get(role, "auto"),
            "tensor_parallel_size": self.tp_size(role),
        }

    def _rank_resources(self, role: str) -> dict[str, float]:
        """What one rank holds: a GPU (and a CPU for its host side), or its CPU share; and one
        unit of the pool's custom resource (the node types advertise one unit per GPU)."""
        one: dict[str, float] = {"GPU": 1, "CPU": 1} if self.use_gpu else {}
        if not self.use_gpu:
            one["CPU"] = self.cpus_per_worker
        resource = self.resources.get(role) if role in (PREFILL, DECODE) else None
        if resource:
            one[resource] = 1
        return one

    def bundles(self, role: str) -> list[dict[str, float]]:
        """The placement group of a worker of `role`: one bundle per rank."""
        return [self._rank_resources(role) for _ in range(self.tp_size(role))]

    def actor_options(self, worker_id: str, role: str, group=None) -> dict:
        """Ray options of the worker actor (rank 0); `group`: its placement group (tp > 1),
        whose bundle 0 it is scheduled into, asking exactly that bundle's resources."""
        opts: dict = {
            "name": f"{WORKER_PREFIX}{worker_id}",
            # watch (always open), load polls, set_peers, drain, stop: never queued.
            "max_concurrency": 8,
            # Ray replaces a dead worker (a new incarnation, see cluster/controller.py);
            # calls are never retried: a request is the router's to fail or resend.
            "max_restarts": self.max_restarts,
            "max_task_retries": 0,
        }
        mine = self._rank_resources(role)
        opts["num_cpus"] = mine.pop("CPU")
        if "GPU" in mine:
            opts["num_gpus"] = mine.pop("GPU")
        if mine:
            opts["resources"] = mine
        if group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            # Rank 0 in bundle 0; its own tasks (the GPU probes) name their bundles.
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=0, placement_group_capture_child_tasks=False
            )
        return opts


def place_worker(spec: WorkerSpec, worker_id: str, role: str) -> dict:
    """The actor options of a worker, after creating its placement group when it is a TP
    group (not waiting for it: the actor waits in it). A group left under this name with no
    worker in it (one drained while its group's removal failed) is replaced: a new worker
    never starts in a reservation it did not ask for."""
    if spec.tp_size(role) == 1:
        return spec.actor_options(worker_id, role)
    import ray
    from ray.util.placement_group import placement_group

    try:  # a live worker of this id keeps its group (its actor's name clash then fails)
        ray.get_actor(WORKER_PREFIX + worker_id)
    except ValueError:
        remove_worker_group(worker_id)
    group = placement_group(
        spec.bundles(role),
        strategy="STRICT_PACK",
        name=GROUP_PREFIX + worker_id,
        lifetime="detached",
    )
    return spec.actor_options(worker_id, role, group)


def remove_worker_group(worker_id: str) -> bool:
    """End a TP worker for good: its actor (if still there) and its placement group, so its
    node's resources are free again; False if it has no group. The actor is killed first,
    without restart: one left in a removed group would wait for it forever, holding its
    name (found by test_tp_placement.py)."""
    import ray
    from ray.util.placement_group import get_placement_group, remove_placement_group

    try:
        group = get_placement_group(GROUP_PREFIX + worker_id)
    except ValueError:  # no such group: a TP-1 worker, or removed already
        return False
    try:
        ray.kill(ray.get_actor(WORKER_PREFIX + worker_id), no_restart=True)
    except ValueError:  # gone already (a drain kills it first)
        pass
    remove_placement_group(group)
    return True


def launch_worker(spec: WorkerSpec, worker_id: str, role: str):
    """Create the worker actor (its constructor runs in the background); returns its handle."""
    import ray

    from cluster.worker_actor import WorkerActor

    return (
        ray.remote(WorkerActor)
        .options(**place_worker(spec, worker_id, role))
        .remote(
            worker_id,
            role,
            spec.engine_config(role),
            spec.bind_host,
            spec.num_threads,
            spec.lease_seconds,
            spec.on_transfer_failure,
            spec.log_level,
            spec.max_frame_bytes,
            spec.faults.get(role),
            spec.kv_read_timeout_s,
        )
    )
