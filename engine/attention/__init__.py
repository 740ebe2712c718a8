"""Attention backends behind one interface (`AttentionBackend.forward`)."""

from engine.attention.base import AttentionBackend, select_backend
from engine.attention.params import LayerAttention

__all__ = ["AttentionBackend", "LayerAttention", "select_backend"]
