"""Helpers the e2e tests import (kept out of conftest.py so they can be imported by name)."""

from __future__ import annotations

import functools
import time
from pathlib import Path


def kv_block_bytes(
    model: Path, block_size: int = 16, dtype_bytes: int = 4, kv_dtype: str = "auto"
) -> int:
    """Bytes of one KV block of `model` (every layer's K and V): what a hand-off moves.
    `kv_dtype="auto"` stores KV in the model dtype (`dtype_bytes` an element); "fp8_e4m3"
    stores one byte an element plus one float32 scale per token and head, which travel with
    the block (engine/kv_cache.py), whatever the model dtype."""
    from engine.model_info import load_hf_config  # a directory's config.json or a GGUF's

    cfg = load_hf_config(model)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    vectors = 2 * cfg.num_hidden_layers * kv_heads * block_size  # one per token, head, K/V
    if kv_dtype == "fp8_e4m3":
        return vectors * (head_dim * 1 + 4)
    if kv_dtype != "auto":
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}")
    return vectors * head_dim * dtype_bytes


@functools.cache
def _hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # full length, as ignore_eos asks
    return model


def hf_greedy_ids(model: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' fp32 greedy continuation of `prompt` (token ids), `max_tokens` long
    whatever it samples (the server's `ignore_eos`); the model is loaded once per process."""
    import torch

    hf = _hf_model(str(model))
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


class TransferCheck:
    """Proof that remote requests were served from transferred KV: snapshot the decode
    pool's counters before a batch, then `verify(prompt_lengths)` after it. `kv_dtype` is the
    servers' --kv-dtype (the bytes a block moves depend on it)."""

    def __init__(self, server, model: Path, block_size: int = 16, kv_dtype: str = "auto"):
        self.server, self.model, self.block_size = server, model, block_size
        self.kv_dtype = kv_dtype
        self.before = self._settled()

    def _settled(self, timeout: float = 15.0) -> dict[str, float]:
        """The counters once the load reports of earlier requests have reached /metrics
        (they lag by up to a directory refresh): unchanged across two refreshes."""
        deadline = time.time() + timeout
        last = self._read()
        while time.time() < deadline:
            time.sleep(1.2)
            now = self._read()
            if now == last:
                return now
            last = now
        raise AssertionError(f"transfer counters never settled: {last}")

    def _read(self) -> dict[str, float]:
        names = (
            "tandem_kv_remote_prefills_total",
            "tandem_kv_recomputes_total",
            "tandem_kv_transfer_failures_total",
            "tandem_kv_transfer_bytes_total",
            "tandem_kv_read_blocks_total",
            "tandem_kv_reused_blocks_total",
        )
        return {n: self.server.counter(n, "decode") for n in names}

    def verify(self, remote_prompt_lengths: list[int]) -> None:
        n = len(remote_prompt_lengths)
        assert n > 0, "the batch had no remote requests: nothing would be proved"
        want = self.before["tandem_kv_remote_prefills_total"] + n
        self.server.wait_counter("tandem_kv_remote_prefills_total", "decode", want)
        delta = {k: v - self.before[k] for k, v in self._read().items()}
        assert delta["tandem_kv_recomputes_total"] == 0, f"prompts were recomputed: {delta}"
        assert delta["tandem_kv_transfer_failures_total"] == 0, f"transfers failed: {delta}"
        assert delta["tandem_kv_remote_prefills_total"] == n, delta
        # Every block of every remote prompt was READ, or taken from the decode worker's own
        # prefix cache (the leading blocks an earlier prompt left there: decode-side reuse).
        blocks = sum(-(-length // self.block_size) for length in remote_prompt_lengths)
        read, reused = delta["tandem_kv_read_blocks_total"], delta["tandem_kv_reused_blocks_total"]
        assert read + reused == blocks, (delta, blocks)
        expected = read * kv_block_bytes(self.model, self.block_size, kv_dtype=self.kv_dtype)
        assert delta["tandem_kv_transfer_bytes_total"] == expected, (delta, expected)
