"""`LayerAttention`: one layer's attention parameters, where a model's layers differ in them.

A backend is built with the model's softmax scale and window (`select_backend`); Gemma 3's
layers alternate between a sliding window and full attention and scale by
`query_pre_attn_scalar ** -0.5`, so its layers pass their own with each call. A leaf module:
the backends import it, and `base.select_backend` imports the backends.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """One layer's softmax scale and window (keys a query sees, itself included; None: all)."""

    scale: float
    window: int | None
