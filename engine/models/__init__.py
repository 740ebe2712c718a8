"""Model definitions. One implementation covers the Llama family (Llama 2/3, Mistral,
Qwen2/2.5, Qwen3, Phi-3); the differences are configuration (biases, q/k norm, head_dim, tying,
sliding window) and, for Phi-3, checkpoints that store q/k/v and gate/up already fused.
`llama.py` is the decoder, `linear.py` its projection layer (CPU GEMM routing, int8 weights),
`rope.py` the rotary tables. Gemma 3's text decoder (`gemma.py`) is those classes with its own
norms, layer, MLP and per-layer attention; the mixture-of-experts decoders (`moe.py`: Mixtral,
Qwen3-MoE) are those classes with routed experts in place of the MLP; `model_class` picks the
class for a config."""

from engine.config import GEMMA3, MOE_ARCHITECTURES, ModelConfig
from engine.models.gemma import GemmaCausalLM
from engine.models.llama import CausalLM
from engine.models.moe import MoECausalLM


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    """The decoder class that computes `cfg`'s architecture."""
    if cfg.architecture == GEMMA3:
        return GemmaCausalLM
    return MoECausalLM if cfg.architecture in MOE_ARCHITECTURES else CausalLM


__all__ = ["CausalLM", "GemmaCausalLM", "MoECausalLM", "model_class"]
