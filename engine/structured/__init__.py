"""Structured outputs: token masks that hold generation to a JSON schema, a regex, a choice
of strings or a Lark grammar, compiled and matched by llguidance. Reading order: README.md.

Importable without torch (the router validates specs with it); the masking functions import
torch when called.
"""

from engine.structured.compiler import CompiledGrammar, GrammarCompiler
from engine.structured.matcher import (
    GrammarMatcher,
    apply_masks,
    apply_token_bitmask,
    bitmask_bias,
    fill_bitmasks,
    unpack_bitmask,
)
from engine.structured.specs import JSON_OPTIONS, StructuredError, validate

__all__ = [
    "JSON_OPTIONS",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarMatcher",
    "StructuredError",
    "apply_masks",
    "apply_token_bitmask",
    "bitmask_bias",
    "fill_bitmasks",
    "unpack_bitmask",
    "validate",
]
