"""tandem's shared model runtime: paged KV cache, token-budget scheduler, attention backends,
Llama-family models, sampling, and the `LLM` offline entry point.

The public names are resolved lazily (PEP 562) so the torch-free modules the router needs
(`engine.protocol`, `engine.kv_events`, `engine.roles`, `engine.config_flags`,
`engine.model_info`) can be imported without loading torch.
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "LLM": "engine.llm",
    "EngineConfig": "engine.llm_engine",
    "LLMEngine": "engine.llm_engine",
    "RequestOutput": "engine.outputs",
    "TokenOutput": "engine.outputs",
    "SamplingParams": "engine.protocol",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
