"""Gemma 3's text decoder (`Gemma3ForCausalLM`, model_type `gemma3_text`) over the engine's
flattened token batch and paged KV cache.

It reuses engine/models/llama.py's classes where transformers' Gemma3 computes the same thing
(fused q/k/v and gate/up projections, RoPE, the attention backends, the head) and differs where
Gemma does:

- its RMSNorm scales by (1 + w), in fp32, and rounds to the activation dtype once
  (`GemmaRMSNorm`); the parameter holds 1 + w, added when the checkpoint is read
  (`GemmaCausalLM.checkpoint_tensor`);
- four norms a layer (`GemmaDecoderLayer`): input and pre-feedforward norms before the
  attention and the MLP, post-attention and post-feedforward norms on their outputs before
  each residual add; per-head q/k norms before RoPE;
- a GELU-tanh-gated MLP (`GemmaMLP`);
- embeddings times sqrt(hidden_size), rounded to the weight dtype as transformers does;
- per layer type (`config.layer_types`): a sliding layer attends within `sliding_window` keys
  and rotates with the local base's table, a full layer sees every key and rotates with the
  global base's (the model's rope scaling); every layer scales q.k by
  `query_pre_attn_scalar ** -0.5`. Each layer passes its scale and window to the backend
  (`LayerAttention`).

What engine/config.py refuses for this architecture (soft-capping, bidirectional attention,
another activation or layer type, length-dependent rope) is never built here.

The fast paths:
- the fused CPU ops (`engine.kernels.ops()`) and the GPU's Triton ops: RoPE where the op set
  has it (exact: the same formula as HF's); the residual add + norm only in fp32, where the
  op's rounding (weight * dtype(norm)) is Gemma's (nothing rounds before the product). In
  bf16/fp16 Gemma rounds once after the fp32 product, so its norms keep the torch path there;
  SiLU-and-mul does not apply (GELU stays in torch ops);
- the FP8 W8A8 projections quantize their own inputs: the GPU's norm + FP8 quantization op
  rounds as Llama's norm does (`_link_fp8_consumers` links none);
- the C++ decode loop is Llama's layer, not this one (`decode_stack_layers`);
- int8/FP8 quantization, tensor parallelism (replicated norms, the o/down all-reduce before
  the post-norms), CUDA graphs (the per-layer numbers are constants of the captured calls)
  apply unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import FULL, SLIDING, ModelConfig
from engine.kv_cache import KVCache
from engine.models.llama import MLP, Attention, CausalLM, RMSNorm


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w) in fp32, rounded to x's dtype once (HF's Gemma3RMSNorm); `weight`
    holds 1 + w in fp32 whatever the serving dtype, as transformers forms it every call."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (xf * self.weight).to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == torch.float32:  # the fused op's rounding is this norm's (see module doc)
            return super().add_forward(x, residual)
        r = x if residual is None else x + residual
        return self.forward(r), r


class GemmaAttention(Attention):
    """Llama's attention with Gemma's q/k norms; each layer's scale and window are set by
    `Attention` from `layer_types`, which Gemma 3 always has."""

    norm_class = GemmaRMSNorm


class GemmaMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        # HF's gelu_pytorch_tanh: torch's tanh-approximated GELU, in x's dtype.
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        norm = functools.partial(GemmaRMSNorm, cfg.hidden_size, cfg.rms_norm_eps)
        # Registered in the order a step reads them (the CPU weight arena streams so).
        self.input_layernorm = norm()
        self.self_attn = GemmaAttention(cfg, layer)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = norm()
        self.layer_type = cfg.layer_types[layer]  # picks its rotary table

    def forward(self, x, residual, cos, sin, cache: KVCache, backend):
        """x: the previous layer's post-feedforward output (or the embeddings, with residual
        None); returns this layer's (post-feedforward output, residual stream before it). HF's
        residual adds, each fused with the norm after it: the input norm's add is the previous
        layer's second add, the pre-feedforward norm's this layer's first."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, cos, sin, cache, backend))
        h, residual = self.pre_feedforward_layernorm.add_forward(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # sqrt(hidden_size) filled into the weight dtype, as HF's buffer (bf16: 25.298 ->
        # 25.25 for hidden 640); the product with the embeddings is in that dtype too.
        scale = torch.full((), cfg.hidden_size**0.5, dtype=self.embed_tokens.weight.dtype)
        self.register_buffer("embed_scale", scale, persistent=False)


class GemmaCausalLM(CausalLM):
    backbone_class = GemmaBackbone
    decode_stack_layers = False

    def _register_rope(self, cfg: ModelConfig, layer_type=None, prefix: str = "rope") -> None:
        """Full layers' tables as `rope_cos`/`rope_sin` (global base, the model's scaling),
        the sliding layers' as `rope_local_cos`/`rope_local_sin` (local base)."""
        super()._register_rope(cfg, FULL, "rope")
        super()._register_rope(cfg, SLIDING, "rope_local")

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A norm holds 1 + w in fp32 of the checkpoint's w as transformers loads it (in the
        serving dtype); other tensors are the checkpoint's."""
        if not name.endswith("norm.weight"):
            return tensor
        return 1.0 + tensor.to(self.model.embed_tokens.weight.dtype).float()

    def _link_fp8_consumers(self, fuse: bool) -> None:
        """None: the fused norm + FP8 quantization rounds as Llama's norm (module doc)."""

    def forward(self, input_ids, positions, cache: KVCache, backend) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids) * self.model.embed_scale
        dtype = x.dtype
        rows = {
            FULL: self.rope_rows(self.rope_cos, self.rope_sin, positions, dtype),
            SLIDING: self.rope_rows(self.rope_local_cos, self.rope_local_sin, positions, dtype),
        }
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, *rows[layer.layer_type], cache, backend)
        return self.model.norm.add_forward(x, residual)[0]
