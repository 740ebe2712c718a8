"""Router settings: one validated dataclass, filled from CLI flags or by the cluster layer."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(slots=True)
class RouterConfig:
    """Everything the router needs to serve; no environment variables are read.

    `port=0` / `zmq_port=0` let the OS pick (read `RouterServer.port` / `.reply_endpoint` after
    `start()`). `advertise_host` is the host written into `reply_to` endpoints; it defaults to
    `bind_host`, and must be set when binding a wildcard address such as 0.0.0.0.
    """

    model_path: str
    served_model_name: str | None = None  # defaults to model_path
    host: str = "127.0.0.1"  # HTTP listen address
    port: int = 8000
    bind_host: str = "127.0.0.1"  # ZMQ PULL (token sink) bind address
    zmq_port: int = 0
    advertise_host: str | None = None
    api_key: str | None = None
    max_model_len: int | None = None  # caps the model's max_position_embeddings
    disagg_threshold: int = 256  # prompts with fewer tokens are prefilled on the decode worker
    max_body_bytes: int = 8 * 1024 * 1024
    max_frame_bytes: int = 16 * 1024 * 1024
    token_gap_timeout_s: float = 10.0  # an index gap older than this fails the request
    request_timeout_s: float = 600.0  # whole-request limit (first token to last)
    refresh_interval_s: float = 0.5  # worker directory snapshot period
    send_timeout_s: float = 5.0  # a PUSH that cannot be queued within this fails the request
    # Routing policy knobs (see router/policy.py).
    affinity_prefix_tokens: int = 64
    affinity_slack_tokens: int = 2048
    decode_batch_norm: int = 32
    default_block_size: int = 16
    completion_default_max_tokens: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError("model_path must be a non-empty string")
        if self.served_model_name is None:
            self.served_model_name = self.model_path
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        for name in ("port", "zmq_port"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= 65535:
                raise ValueError(f"{name} must be an int in [0, 65535], got {value!r}")
        if self.advertise_host is None:
            if self.bind_host in ("0.0.0.0", "*", "::"):
                raise ValueError(
                    f"bind_host {self.bind_host!r} is a wildcard: set advertise_host to the "
                    "address workers should send tokens to"
                )
            self.advertise_host = self.bind_host
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be None (no auth) or a non-empty string")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        positive = (
            "max_body_bytes",
            "max_frame_bytes",
            "token_gap_timeout_s",
            "request_timeout_s",
            "refresh_interval_s",
            "send_timeout_s",
            "affinity_prefix_tokens",
            "decode_batch_norm",
            "default_block_size",
            "completion_default_max_tokens",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        for name in ("disagg_threshold", "affinity_slack_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")

    def __repr__(self) -> str:
        # Never print the key (configs end up in logs).
        key = None if self.api_key is None else "***"
        return (
            f"RouterConfig(model_path={self.model_path!r}, served_model_name="
            f"{self.served_model_name!r}, host={self.host!r}, port={self.port}, bind_host="
            f"{self.bind_host!r}, zmq_port={self.zmq_port}, api_key={key}, "
            f"disagg_threshold={self.disagg_threshold})"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Router flags for a CLI (`tandem serve`, `python -m router`); the model path is the
    caller's own flag, passed to `config_from_args`."""
    d = RouterConfig.__dataclass_fields__
    g = parser.add_argument_group("router")
    g.add_argument("--host", default=d["host"].default, help="HTTP listen address")
    g.add_argument("--port", type=int, default=d["port"].default, help="HTTP port (0: any)")
    g.add_argument("--served-model-name", default=None, help="model name in the API")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    g.add_argument("--bind-host", default=d["bind_host"].default, help="ZMQ token sink address")
    g.add_argument("--zmq-port", type=int, default=0, help="ZMQ token sink port (0: any)")
    g.add_argument("--advertise-host", default=None, help="host workers send tokens to")
    g.add_argument("--max-model-len", type=int, default=None, help="cap the context window")
    g.add_argument(
        "--disagg-threshold",
        type=int,
        default=d["disagg_threshold"].default,
        help="prompts shorter than this are prefilled on the decode worker",
    )
    g.add_argument("--max-body-bytes", type=int, default=d["max_body_bytes"].default)
    g.add_argument("--token-gap-timeout-s", type=float, default=d["token_gap_timeout_s"].default)
    g.add_argument("--request-timeout-s", type=float, default=d["request_timeout_s"].default)


def config_from_args(args: argparse.Namespace, model_path: str) -> RouterConfig:
    return RouterConfig(
        model_path=model_path,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        bind_host=args.bind_host,
        zmq_port=args.zmq_port,
        advertise_host=args.advertise_host,
        api_key=args.api_key,
        max_model_len=args.max_model_len,
        disagg_threshold=args.disagg_threshold,
        max_body_bytes=args.max_body_bytes,
        token_gap_timeout_s=args.token_gap_timeout_s,
        request_timeout_s=args.request_timeout_s,
    )
