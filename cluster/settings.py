"""`ServeSettings`: everything `tandem serve` needs, each setting and default written once.

Its flags are generated from these fields, from `RouterConfig`'s (group "router") and from
`EngineConfig`'s (group "engine"); `cluster.deployment.Deployment` runs what it describes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from cluster.planner.config import PlannerConfig
from decode_worker.server import FAILURE_POLICIES
from engine.config_flags import field_default, setting
from engine.llm_engine import EngineConfig
from engine.quantization import QUANTIZATIONS
from engine.quantization import validate as validate_quantization
from engine.roles import COLOCATED, DECODE, PREFILL
from router.config import RouterConfig

MODES = ("disagg", "colocated")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# A TP group is packed on one node (STRICT_PACK): no node has more GPUs than this today
# (8 is the common maximum, 16 on a few), so a larger size is a typo, refused at once.
MAX_TP = 16


# The router's SLO metrics judge by the targets the planner sizes for: `tandem serve` passes
# the planner's --slo-* values (set or default) to the router.
SLO_FIELDS = ("slo_ttft_ms", "slo_ttft_ms_per_1k", "slo_tpot_ms")
# RouterConfig fields that `tandem serve` sets itself (from its own settings or the engine's),
# so they are not offered again in the router flag group.
ROUTER_FIELDS_FROM_SERVE = frozenset(
    {
        "model_path",
        "served_model_name",
        "host",
        "port",
        "bind_host",
        "api_key",
        "disagg_threshold",
        "max_frame_bytes",
        "max_model_len",
        "default_block_size",
        "tokenizer",
        "scheduling_policy",
        *SLO_FIELDS,
    }
)
# PlannerConfig fields `tandem serve` sets from its own settings (one flag, one meaning).
PLANNER_FIELDS_FROM_SERVE = frozenset(
    {"disagg_threshold", "prefill_gpus_per_worker", "decode_gpus_per_worker"}
)
# EngineConfig fields a deployment sets per worker, never from the command line.
ENGINE_FIELDS_FROM_SERVE = frozenset(
    {"model", "role", "device", "quantization", "tensor_parallel_size"}
)


def _router_default(name: str):
    return field_default(RouterConfig, name)


@dataclass(slots=True)
class ServeSettings:
    """Everything `tandem serve` needs. Its flags are generated from these fields, from
    `RouterConfig`'s (group "router") and from `EngineConfig`'s (group "engine"), so every
    setting and default is written once. `engine` and `router` hold overrides of those two
    configs' fields (by name) beyond what this class sets itself.

    Quantization is per pool: `prefill_quantization` and `decode_quantization` (the decode pool
    and colocated replicas) take the names of engine/quantization/__init__.py, and `quantized`
    switches on the quantized profile (FP8 W8A8 prefill, weight-only decode, FP8 KV) for what
    is left at "auto"."""

    model: str = setting(help="local Hugging Face model directory (config.json + safetensors)")
    mode: str = setting("disagg", "prefill + decode pools, or colocated replicas", choices=MODES)
    prefill: int = setting(1, "prefill actors (disagg)")
    decode: int = setting(1, "decode actors (disagg)")
    replicas: int = setting(2, "engine replicas (colocated)")
    # Tensor parallelism per pool: a worker is a group of this many ranks (GPUs), packed on
    # one node (cluster/worker_launch.py); the planner counts workers x TP GPUs.
    prefill_tp: int = setting(1, f"GPUs (tensor-parallel ranks) per prefill worker, 1..{MAX_TP}")
    decode_tp: int = setting(1, f"GPUs (tensor-parallel ranks) per decode worker, 1..{MAX_TP}")
    tp: int = setting(1, f"GPUs (tensor-parallel ranks) per colocated replica, 1..{MAX_TP}")
    host: str = setting(_router_default("host"), "HTTP listen address")
    port: int = setting(_router_default("port"), "HTTP port (0: any free port)")
    address: str | None = setting(
        None, "Ray cluster to attach to ('auto' or HOST:PORT); default: start a local one"
    )
    api_key: str | None = setting(
        None,
        "require 'Authorization: Bearer KEY' on every route but /health (or set TANDEM_API_KEY)",
    )
    served_model_name: str | None = setting(
        None, "model name in the API (default: the model directory's name; its path works too)"
    )
    bind_host: str = setting(
        _router_default("bind_host"),
        "address internal ZMQ/NIXL sockets bind to; 'auto' = this node's IP",
    )
    prefill_resource: str | None = setting(
        None, "custom Ray resource every prefill actor requires (1 unit)"
    )
    decode_resource: str | None = setting(
        None, "custom Ray resource every decode actor requires (1 unit)"
    )
    num_cpus: int | None = setting(None, "CPUs of a local Ray cluster (default: all)")
    disagg_threshold: int = setting(
        _router_default("disagg_threshold"),
        "prompts shorter than this many tokens are prefilled on the decode worker",
    )
    lease_seconds: float = setting(30.0, "how long a prefill worker holds KV for its decode peer")
    kv_read_timeout_s: float = setting(30.0, "a KV READ (hand-off) taking longer than this fails")
    on_transfer_failure: str = setting(
        "recompute",
        "when KV cannot be fetched: recompute the prompt on the decode worker, or fail",
        choices=FAILURE_POLICIES,
    )
    log_level: str = setting(
        "WARNING", "log level of the workers and the router", parse=str.upper, choices=LOG_LEVELS
    )
    max_frame_mb: float = setting(
        16.0, "largest ZMQ frame a worker or the router accepts; larger ones are dropped"
    )
    # Projection weights per pool (names and what each means: engine/quantization/__init__.py).
    # "auto" keeps what the checkpoint has: full weights, or an FP8 checkpoint's own.
    prefill_quantization: str = setting(
        "auto",
        "projection weights of the prefill pool: fp8 is W8A8 (FP8 weights and activations)",
        choices=QUANTIZATIONS,
    )
    decode_quantization: str = setting(
        "auto",
        "projection weights of the decode pool and colocated replicas (weight-only: FP8 on "
        "GPUs with FP8, CUDA 8.9+; int8 elsewhere)",
        choices=QUANTIZATIONS,
    )
    # The quantized profile in one switch; see `_apply_quantized_profile`.
    quantized: bool = setting(
        False,
        "quantized profile: fp8 (W8A8) prefill, weight-only decode, FP8 KV (--kv-dtype "
        "fp8_e4m3); a per-pool quantization or --kv-dtype other than auto wins",
    )
    max_worker_restarts: int = setting(
        -1, "times Ray restarts a dead worker actor (-1: always; 0: never)"
    )
    drain_timeout_s: float = setting(
        30.0, "on SIGTERM: how long in-flight requests may take to finish before exit"
    )
    router_only: bool = setting(
        False,
        "start only a router, attached (--address) to the controller of a running deployment",
    )
    inject_faults: str | None = setting(
        None,
        "testing only: JSON {role: {step_delay_s, and KV fault knobs of kv_transfer/faults.py}}, "
        "e.g. "
        '\'{"decode": {"read_delay_s": 2}}\'',
    )
    autoscale: bool = setting(
        False,
        "size the prefill and decode pools with the planner (cluster/planner/): the bounds, "
        "SLO targets and interval are the planner flags; needs --capacity-profile",
    )
    capacity_profile: str | None = setting(
        None,
        "capacity profile JSON of one worker (`tandem profile --capacity` or `tandem plan --out`)"
        " that the planner sizes the pools with",
    )
    planner: dict = setting(default_factory=dict, cli=False)  # PlannerConfig overrides
    engine: dict = setting(default_factory=dict, cli=False)  # EngineConfig overrides
    router: dict = setting(default_factory=dict, cli=False)  # RouterConfig overrides

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("prefill", "decode", "replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1")
        for name in ("prefill_tp", "decode_tp", "tp"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_TP:
                flag = name.replace("_", "-")
                raise ValueError(f"--{flag} must be an integer in [1, {MAX_TP}], got {n!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.on_transfer_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_transfer_failure must be one of {FAILURE_POLICIES}")
        if not self.max_frame_mb > 0:
            raise ValueError(f"max_frame_mb must be > 0, got {self.max_frame_mb}")
        for name in ("lease_seconds", "kv_read_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_worker_restarts < -1:
            raise ValueError("max_worker_restarts must be >= -1")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.router_only and not self.address:
            raise ValueError("--router-only attaches to a running deployment: give --address")
        self.fault_plans()  # a malformed plan fails here, not in a worker
        self.prefill_quantization = validate_quantization(self.prefill_quantization)
        self.decode_quantization = validate_quantization(self.decode_quantization)
        for what, overrides, owned in (
            ("engine", self.engine, ENGINE_FIELDS_FROM_SERVE),
            ("router", self.router, ROUTER_FIELDS_FROM_SERVE),
            ("planner", self.planner, PLANNER_FIELDS_FROM_SERVE),
        ):
            clash = sorted(set(overrides) & owned)
            if clash:
                raise ValueError(f"{what} overrides {clash} are set by ServeSettings itself")
        if self.quantized:
            self._apply_quantized_profile()
        if self.autoscale:
            self._check_autoscale()

    def _check_autoscale(self) -> None:
        if self.mode != "disagg":
            raise ValueError("--autoscale sizes the prefill and decode pools: use --mode disagg")
        if self.router_only:
            raise ValueError("--autoscale runs in the deployment's controller, not --router-only")
        if not self.capacity_profile:
            raise ValueError(
                "--autoscale needs --capacity-profile (write one with `tandem profile "
                "--capacity` on this hardware, or `tandem plan --out` for other hardware)"
            )
        # Unreadable or invalid: fail here, not in the controller.
        gpus = self.capacity_profile_data().gpus_per_worker
        if gpus not in (self.prefill_tp, self.decode_tp):
            raise ValueError(
                f"--capacity-profile describes a worker of {gpus} GPU(s) (TP {gpus}), but the "
                f"pools run --prefill-tp {self.prefill_tp} --decode-tp {self.decode_tp}: write "
                "it at one of those (`tandem plan --tp N`, or profile a TP-N worker)"
            )
        config = self.planner_config()
        for pool, n in (("prefill", self.prefill), ("decode", self.decode)):
            lo, hi = getattr(config, f"min_{pool}"), getattr(config, f"max_{pool}")
            if not lo <= n <= hi:
                raise ValueError(f"--{pool} {n} is outside the planner's bounds [{lo}, {hi}]")

    def planner_config(self):
        """The planner's settings (cluster.planner.config.PlannerConfig) from `planner`; it
        counts a pool's GPUs as its workers x that pool's TP size."""
        from cluster.planner.config import PlannerConfig

        return PlannerConfig(
            **self.planner,
            disagg_threshold=self.disagg_threshold,
            prefill_gpus_per_worker=self.prefill_tp,
            decode_gpus_per_worker=self.decode_tp,
        )

    def tp_size(self, role: str) -> int:
        """Ranks (GPUs) of one worker of `role`."""
        return {PREFILL: self.prefill_tp, DECODE: self.decode_tp, COLOCATED: self.tp}[role]

    @staticmethod
    def tp_flag(role: str) -> str:
        """The flag that sets the TP size of a worker of `role`."""
        return "--tp" if role == COLOCATED else f"--{role}-tp"

    def check_tp(self) -> None:
        """Refuse, before any worker starts, a TP size the model or the engine cannot run: the
        engine's own checks (engine.models.parallel: heads, KV heads and MLP width divisible;
        what TP does not support yet, by role), which would otherwise only fail inside each
        worker's constructor, once per restart. Reads the model's config.json."""
        from engine.config import ModelConfig
        from engine.models.parallel import check_tp, check_tp_settings

        roles = {role for _, role in self.pools()}
        if all(self.tp_size(r) == 1 for r in roles):
            return
        mc = ModelConfig.from_pretrained(self.model)
        load_format = self.engine.get("load_format", field_default(EngineConfig, "load_format"))
        for role in sorted(roles):
            n = self.tp_size(role)
            flag = self.tp_flag(role)
            try:
                check_tp_settings(n, role, load_format)
                check_tp(mc, n)
            except ValueError as e:
                raise ValueError(f"{flag} {n}: {e}") from e

    def capacity_profile_data(self):
        """The capacity profile (bench.capacity_profile.CapacityProfile) --autoscale sizes with."""
        from bench.capacity_profile import CapacityProfile

        return CapacityProfile.load(self.capacity_profile)

    def max_workers(self) -> int:
        """The most workers this deployment may run at once."""
        if not self.autoscale:
            return len(self.pools())
        config = self.planner_config()
        return config.max_prefill + config.max_decode

    def max_ranks(self) -> int:
        """The most ranks (processes, each with a GPU or a CPU share) it may run at once."""
        if not self.autoscale:
            return sum(self.tp_size(role) for _, role in self.pools())
        config = self.planner_config()
        return config.max_prefill * self.prefill_tp + config.max_decode * self.decode_tp

    def _apply_quantized_profile(self) -> None:
        """`quantized`: FP8 W8A8 prefill ("fp8": FP8 e4m3 weights with per-channel scales,
        activations scaled per token at run time, `torch._scaled_mm`), weight-only decode
        ("weight-only": FP8 weights where the GPU has FP8, int8 on CPU and older GPUs) and FP8
        KV (kv_dtype "fp8_e4m3"). It fills in only what is still at "auto" (or, for the KV,
        absent from `engine`), so a setting given explicitly wins; an explicit "auto" cannot be
        told from the default and is overridden too."""
        if self.prefill_quantization == "auto":
            self.prefill_quantization = "fp8"
        if self.decode_quantization == "auto":
            self.decode_quantization = "weight-only"
        if self.engine.get("kv_dtype", "auto") == "auto":
            self.engine = {**self.engine, "kv_dtype": "fp8_e4m3"}

    def fault_plans(self) -> dict[str, dict]:
        """role -> KV fault plan (a dict for kv_transfer.faults.FaultPlan.from_dict)."""
        if not self.inject_faults:
            return {}
        try:
            plans = json.loads(self.inject_faults)
        except json.JSONDecodeError as e:
            raise ValueError(f"inject_faults is not JSON: {e}") from e
        if not isinstance(plans, dict) or not all(
            r in (PREFILL, DECODE) and isinstance(p, dict) for r, p in plans.items()
        ):
            raise ValueError('inject_faults must be {"prefill"|"decode": {knob: value}}')
        from kv_transfer.faults import FaultPlan

        for plan in plans.values():
            delay = plan.get("step_delay_s", 0.0)
            if isinstance(delay, bool) or not isinstance(delay, int | float) or delay < 0:
                raise ValueError(f"step_delay_s must be a number >= 0, got {delay!r}")
            FaultPlan.from_dict({k: v for k, v in plan.items() if k != "step_delay_s"})
        return plans

    @property
    def max_frame_bytes(self) -> int:
        return int(self.max_frame_mb * 2**20)

    def pools(self) -> list[tuple[str, str]]:
        """(worker id, role) for every worker to start."""
        if self.mode == "colocated":
            return [(f"replica-{i}", COLOCATED) for i in range(self.replicas)]
        return [(f"prefill-{i}", PREFILL) for i in range(self.prefill)] + [
            (f"decode-{i}", DECODE) for i in range(self.decode)
        ]

    def router_config(self, bind_host: str) -> RouterConfig:
        """The router's settings; `bind_host` is `self.bind_host` with 'auto' resolved."""
        return RouterConfig(
            **self.router,
            model_path=self.model,
            served_model_name=self.served_model_name,
            host=self.host,
            port=self.port,
            bind_host=bind_host,
            api_key=self.api_key,
            # Colocated replicas prefill everything themselves.
            disagg_threshold=self.disagg_threshold if self.mode == "disagg" else 1 << 30,
            max_frame_bytes=self.max_frame_bytes,
            default_block_size=self.engine.get(
                "block_size", field_default(EngineConfig, "block_size")
            ),
            max_model_len=self.engine.get("max_model_len"),
            tokenizer=self.engine.get("tokenizer"),
            scheduling_policy=self.engine.get(
                "scheduling_policy", field_default(EngineConfig, "scheduling_policy")
            ),
            **{name: self._planner_value(name) for name in SLO_FIELDS},
        )

    def _planner_value(self, name: str):
        return self.planner.get(name, field_default(PlannerConfig, name))
