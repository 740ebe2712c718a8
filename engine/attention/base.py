"""The attention backend interface and backend selection.

A backend writes the step's new K/V into the paged cache and returns attention output for
the step's queries. It reads the per-step metadata with
`engine.model_runner.get_forward_context()`. It is built with the model's softmax scale and
window; a model whose layers differ in them (Gemma 3) passes each layer's own with the call
(`engine.attention.params.LayerAttention`).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Protocol

import torch

from engine.attention.params import LayerAttention
from engine.kv_cache import KVCache

BACKENDS = ("auto", "torch", "triton", "flash_attn")


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [tokens, heads, head_dim], rope applied
        k: torch.Tensor,  # [tokens, kv_heads, head_dim]
        v: torch.Tensor,
        cache: KVCache,
        attn: LayerAttention | None = None,  # None: the backend's own scale and window
    ) -> torch.Tensor: ...


def flash_attn_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None


def triton_available(device: torch.device) -> bool:
    """Triton kernels run on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (tests)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def select_backend(
    name: str,
    device: torch.device,
    scale: float,
    sliding_window: int | None,
    kv_dtype: str = "auto",
) -> AttentionBackend:
    """`auto`: on CUDA the Triton backend (graph-capturable; not for FP8 KV caches), else
    flash-attn when installed, else the torch reference."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    fp8_kv = kv_dtype != "auto"
    if name == "triton" or (
        name == "auto" and device.type == "cuda" and not fp8_kv and triton_available(device)
    ):
        if not triton_available(device) or fp8_kv:
            raise ValueError(
                "attention_backend='triton' needs CUDA (or TRITON_INTERPRET=1), the triton "
                "package and a full-precision KV cache"
            )
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(scale, sliding_window)
    if name == "flash_attn" or (name == "auto" and flash_attn_available(device)):
        if not flash_attn_available(device):
            raise ValueError("attention_backend='flash_attn' needs CUDA and the flash-attn package")
        from engine.attention.flash_attn_backend import FlashAttentionBackend

        return FlashAttentionBackend(scale, sliding_window)
    from engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(scale, sliding_window, cpu_kernel=device.type == "cpu")
