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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine.roles import DECODE, PREFILL

WORKER_PREFIX = "tandem-worker-"


@dataclass(slots=True)
class WorkerSpec:
    """Everything a worker actor is built from, per role where it differs."""

    engine_kwargs: dict  # EngineConfig fields shared by every role (model, dtype, ...)
    quantization: dict[str, str]  # role -> EngineConfig.quantization
    bind_host: str
    use_gpu: bool
    cpus_per_worker: float  # Ray CPUs each worker asks for (without a GPU)
    lease_seconds: float
    on_transfer_failure: str
    log_level: str
    max_frame_bytes: int
    kv_read_timeout_s: float
    max_restarts: int
    resources: dict[str, str] = field(default_factory=dict)  # role -> custom Ray resource
    faults: dict[str, dict] = field(default_factory=dict)  # role -> testing-only fault plan

    def __post_init__(self) -> None:
        if not self.cpus_per_worker > 0:
            raise ValueError(f"cpus_per_worker must be > 0, got {self.cpus_per_worker}")

    @property
    def num_threads(self) -> int:
        """Torch threads of one worker: its whole CPU share, at least one."""
        return max(1, int(self.cpus_per_worker))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> WorkerSpec:
        return cls(**d)

    def actor_options(self, worker_id: str, role: str) -> dict:
        opts: dict = {
            "name": f"{WORKER_PREFIX}{worker_id}",
            # watch (always open), load polls, set_peers, drain, stop: never queued.
            "max_concurrency": 8,
            # Ray replaces a dead worker (a new incarnation, see cluster/controller.py);
            # calls are never retried: a request is the router's to fail or resend.
            "max_restarts": self.max_restarts,
            "max_task_retries": 0,
        }
        if self.use_gpu:
            opts.update(num_gpus=1, num_cpus=1)
        else:
            opts["num_cpus"] = self.cpus_per_worker
        resource = self.resources.get(role) if role in (PREFILL, DECODE) else None
        if resource:
            opts["resources"] = {resource: 1}
        return opts


def launch_worker(spec: WorkerSpec, worker_id: str, role: str):
    """Create the worker actor (its constructor runs in the background); returns its handle."""
    import ray

    from cluster.worker_actor import WorkerActor

    return (
        ray.remote(WorkerActor)
        .options(**spec.actor_options(worker_id, role))
        .remote(
            worker_id,
            role,
            {**spec.engine_kwargs, "quantization": spec.quantization.get(role, "auto")},
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
