"""Router settings: one validated dataclass, filled from CLI flags or by the cluster layer.

Each field's default and help are written once, here; `add_arguments` turns every field into a
`--field-name` flag (engine.config_flags) and `config_from_args` reads them back.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from engine.config_flags import add_flags, setting, values_from_args
from engine.gguf_file import is_gguf, served_name
from engine.model_info import load_chat_template
from engine.protocol import SCHEDULING_POLICIES
from engine.slo import SloTargets
from router.cors import parse_origins
from router.reasoning import REASONING_PARSERS
from router.tools import TOOL_FORMATS

_WILDCARD_HOSTS = ("0.0.0.0", "*", "::")
ROUTING_POLICIES = ("kv-events", "affinity")


@dataclass(slots=True)
class RouterConfig:
    """Everything the router needs to serve; no environment variables are read.

    `port=0` / `zmq_port=0` let the OS pick (read `RouterServer.port` / `.reply_endpoint` after
    `start()`). `advertise_host` is the host written into `reply_to` endpoints; it defaults to
    `bind_host`, and must be set when binding a wildcard address such as 0.0.0.0.
    """

    model_path: str = setting(help="local Hugging Face model directory")
    served_model_name: str | None = setting(
        None,
        "model name in the API (default: the model directory's name; the path is accepted too)",
    )
    tokenizer: str | None = setting(
        None, "tokenizer directory or GGUF file (default: the model's own)"
    )
    chat_template: str | None = setting(
        None,
        "a Jinja chat template, or a file holding one, in place of the tokenizer's (checked at "
        "start-up; read into this setting, so the router needs no copy of the file)",
    )
    tool_call_parser: str | None = setting(
        None,
        "the format of the model's tool calls, for `auto` tool choice (vLLM's flag); default: "
        "the one the chat template shows, or none (tools are then described in a system message)",
        choices=TOOL_FORMATS,
    )
    reasoning_parser: str | None = setting(
        None,
        "split a reasoning model's <think>...</think> from its chat answers into `reasoning` "
        "(vLLM's flag): deepseek_r1 (thinks from the first token) or qwen3",
        choices=REASONING_PARSERS,
    )
    allowed_origins: str = setting(
        "*",
        "web origins whose pages may call the API from a browser (CORS): '*' (vLLM's default), "
        "comma-separated scheme://host[:port], or '' for none",
    )
    host: str = setting("127.0.0.1", "HTTP listen address")
    port: int = setting(8000, "HTTP port (0: any free port)")
    bind_host: str = setting("127.0.0.1", "ZMQ token sink bind address")
    zmq_port: int = setting(0, "ZMQ token sink port (0: any free port)")
    advertise_host: str | None = setting(
        None, "host workers send tokens to; none: the bind host (set it for a wildcard bind)"
    )
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY'")
    max_model_len: int | None = setting(None, "cap the model's context window")
    disagg_threshold: int = setting(
        256, "prompts with fewer tokens are prefilled on the decode worker"
    )
    max_body_bytes: int = setting(8 * 1024 * 1024, "largest HTTP request body (413 above)")
    body_timeout_s: float = setting(
        10.0, "a request body must arrive within this (408 after: a slow client holds nothing)"
    )
    max_frame_bytes: int = setting(16 * 1024 * 1024, "largest ZMQ frame the token sink accepts")
    token_gap_timeout_s: float = setting(
        10.0, "an index gap in a token stream older than this fails the request"
    )
    request_timeout_s: float = setting(600.0, "whole-request limit, arrival to last token")
    refresh_interval_s: float = setting(0.5, "worker directory snapshot period")
    send_timeout_s: float = setting(
        5.0, "a request that cannot be queued to a worker within this fails"
    )
    # Routing policy knobs (see router/routing.py).
    routing: str = setting(
        "kv-events",
        "kv-events: route by the prefix blocks each worker really holds (its KV events); "
        "affinity: by a hash of the prompt's first tokens",
        choices=ROUTING_POLICIES,
    )
    prefix_pull: bool = setting(
        True,
        "kv-events routing: a prefill worker READs the prompt's leading blocks from the worker "
        "whose cache holds more of them than its own, instead of computing them again",
    )
    kv_index_max_entries: int = setting(
        1 << 22, "(block, worker) pairs the kv-events index holds at most (beyond: not indexed)"
    )
    affinity_prefix_tokens: int = setting(
        64, "prompt tokens hashed to pick a prefill worker with the prefix cached"
    )
    affinity_slack_tokens: int = setting(
        2048, "queued prefill tokens the affine worker may exceed the least loaded one by"
    )
    decode_batch_norm: int = setting(32, "running requests that weigh as much as a full KV cache")
    decode_affinity_slack: float = setting(
        0.25,
        "decode cost the worker holding a prompt's blocks may exceed the least loaded one's by: "
        "kv-events routing, (running + 2 waiting)/decode_batch_norm x the share it holds; "
        "affinity, KV usage + that, for the worker the prompt's prefix hashes to",
    )
    default_block_size: int = setting(16, "KV block size assumed for workers that report none")
    scheduling_policy: str = setting(
        "fcfs",
        "the workers' (engine --scheduling-policy): fcfs refuses a request's priority",
        choices=SCHEDULING_POLICIES,
    )
    completion_default_max_tokens: int = setting(
        16, "max_tokens of a /v1/completions request that gives none"
    )
    # Bounded admission (router/admission.py): requests waiting for their first token.
    max_queued_requests: int = setting(
        512, "requests waiting for their first token before new ones get 429 (0: unlimited)"
    )
    max_queued_prompt_tokens: int = setting(
        1 << 20,
        "prompt tokens waiting for their first output token before new requests get 429 "
        "(0: unlimited; a larger prompt is still admitted when nothing waits)",
    )
    metrics_require_key: bool = setting(
        True, "/metrics asks for the API key too (--no-metrics-require-key: open to scrapers)"
    )
    # Planner signals (router/signal_recorder.py): one traffic window per interval, pushed to
    # the directory's report_signals when it has one (the controller's planner reads them).
    signal_interval_s: float = setting(
        2.0, "seconds per planner signal window pushed to the controller (0: none pushed)"
    )

    # Service-level targets (engine/slo.py): each request served to its end is counted in
    # /metrics' tandem_slo_requests as met or missed. `tandem serve` sets them from the
    # planner's --slo-* flags, so the pools are sized for the targets the metrics judge by.
    slo_ttft_ms: float | None = setting(
        None, "time-to-first-token target the SLO metrics judge by, ms (none: not judged)"
    )
    slo_ttft_ms_per_1k: float = setting(
        0.0, "TTFT allowance per 1k prompt tokens on top of --slo-ttft-ms, ms (0: one target)"
    )
    slo_tpot_ms: float | None = setting(
        None, "time-per-output-token target the SLO metrics judge by, ms (none: not judged)"
    )

    # /v1/responses (router/response_store.py): responses kept for previous_response_id.
    responses_max_stored: int = setting(
        1024, "/v1/responses kept for previous_response_id and GET (LRU; 0: none kept)"
    )
    responses_max_stored_bytes: int = setting(
        64 * 1024 * 1024, "bytes of stored /v1/responses (their JSON; LRU beyond this)"
    )

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError("model_path must be a non-empty string")
        if self.served_model_name is None:
            # The directory's name (a GGUF file's without .gguf), not the path: clients split
            # model names on "/".
            self.served_model_name = (
                served_name(self.model_path)
                if is_gguf(self.model_path)
                else os.path.basename(self.model_path.rstrip("/")) or self.model_path
            )
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        for name in ("port", "zmq_port"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= 65535:
                raise ValueError(f"{name} must be an int in [0, 65535], got {value!r}")
        if self.advertise_host is None:
            if self.bind_host in _WILDCARD_HOSTS:
                raise ValueError(
                    f"bind_host {self.bind_host!r} is a wildcard: set advertise_host to the "
                    "address workers should send tokens to"
                )
            self.advertise_host = self.bind_host
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be None (no auth) or a non-empty string")
        parse_origins(self.allowed_origins)
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}")
        if self.tool_call_parser not in (None, *TOOL_FORMATS):
            raise ValueError(f"tool_call_parser must be one of {TOOL_FORMATS}")
        if self.chat_template is not None:
            self.chat_template = load_chat_template(self.chat_template)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        self.slo_targets()  # refuses a bad target by name
        self._check_limits()

    def slo_targets(self) -> SloTargets:
        """The targets each request is judged by (engine/slo.py's rule)."""
        return SloTargets(self.slo_ttft_ms, self.slo_ttft_ms_per_1k, self.slo_tpot_ms)

    def _check_limits(self) -> None:
        positive = (
            "max_body_bytes",
            "body_timeout_s",
            "max_frame_bytes",
            "token_gap_timeout_s",
            "request_timeout_s",
            "refresh_interval_s",
            "send_timeout_s",
            "affinity_prefix_tokens",
            "decode_batch_norm",
            "default_block_size",
            "completion_default_max_tokens",
            "kv_index_max_entries",
        )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if not isinstance(self.metrics_require_key, bool):
            raise ValueError(
                f"metrics_require_key must be a bool, got {self.metrics_require_key!r}"
            )
        interval = self.signal_interval_s
        if isinstance(interval, bool) or not isinstance(interval, int | float) or interval < 0:
            raise ValueError(f"signal_interval_s must be >= 0 (0: off), got {interval!r}")
        if not math.isfinite(interval):
            raise ValueError(f"signal_interval_s must be finite, got {interval!r}")
        slack = self.decode_affinity_slack
        if isinstance(slack, bool) or not isinstance(slack, int | float) or not 0 <= slack < 1e9:
            raise ValueError(f"decode_affinity_slack must be a finite number >= 0, got {slack!r}")
        non_negative = (
            "disagg_threshold",
            "affinity_slack_tokens",
            "max_queued_requests",
            "max_queued_prompt_tokens",
            "responses_max_stored",
            "responses_max_stored_bytes",
        )
        for name in non_negative:
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


def add_arguments(parser: argparse.ArgumentParser, exclude: Iterable[str] = ()) -> None:
    """One `--field-name` flag per RouterConfig field, in a "router" group. The model path is
    the caller's own argument (passed to `config_from_args`); `exclude` leaves out fields the
    caller sets itself."""
    add_flags(parser, RouterConfig, title="router", exclude={"model_path", *exclude})


def config_from_args(args: argparse.Namespace, model_path: str, **overrides: Any) -> RouterConfig:
    """A RouterConfig from parsed flags; a field with no flag in `args` keeps its default and
    `overrides` win over both."""
    values = values_from_args(RouterConfig, args, exclude={"model_path"})
    return RouterConfig(**{**values, "model_path": model_path, **overrides})
