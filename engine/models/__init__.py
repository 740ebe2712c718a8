"""Model definitions. One implementation covers the Llama family (Llama 2/3, Mistral,
Qwen2/2.5, Qwen3, Phi-3); the differences are configuration (biases, q/k norm, head_dim, tying,
sliding window) and, for Phi-3, checkpoints that store q/k/v and gate/up already fused.
`llama.py` is the decoder, `linear.py` its projection layer (CPU GEMM routing, int8 weights),
`rope.py` the rotary tables."""

from engine.models.llama import CausalLM

__all__ = ["CausalLM"]
