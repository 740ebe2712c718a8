"""tandem's shared model runtime: paged KV cache, token-budget scheduler, attention backends,
Llama-family models, sampling, and the `LLM` offline entry point."""

from engine.llm import LLM
from engine.llm_engine import EngineConfig, LLMEngine
from engine.outputs import RequestOutput, TokenOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "TokenOutput"]
