"""Model definitions. One implementation covers the Llama family (Llama 2/3, Mistral,
Qwen2/2.5, Qwen3, Phi-3); the differences are configuration (biases, q/k norm, head_dim, tying,
sliding window) and, for Phi-3, checkpoints that store q/k/v and gate/up already fused.
`llama.py` is the decoder, `linear.py` its projection layer (CPU GEMM routing, int8 weights),
`rope.py` the rotary tables. Gemma 3's text decoder (`gemma.py`) is those classes with its own
norms, layer, MLP and per-layer attention; `model_class` picks the class for a config."""

from engine.config import GEMMA3, ModelConfig
from engine.models.gemma import GemmaCausalLM
from engine.models.llama import CausalLM


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    """The decoder class that computes `cfg`'s architecture."""
    return GemmaCausalLM if cfg.architecture == GEMMA3 else CausalLM


__all__ = ["CausalLM", "GemmaCausalLM", "model_class"]
