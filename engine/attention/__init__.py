"""Attention backends behind one interface (`AttentionBackend.forward`)."""

from engine.attention.base import AttentionBackend, select_backend

__all__ = ["AttentionBackend", "select_backend"]
