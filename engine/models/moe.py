"""Sparse mixture-of-experts decoders: Mixtral (`MixtralForCausalLM`) and Qwen3-MoE
(`Qwen3MoeForCausalLM`), over the engine's flattened token batch and paged KV cache.

The attention is engine/models/llama.py's: Mistral's for Mixtral (a sliding window on every
layer when the config sets one), Qwen3's for Qwen3-MoE (per-head q/k RMSNorms; a window only
with `use_sliding_window`, which transformers' config turns into `sliding_window`). The MLP of
a sparse layer is `SparseMoE`:

- the router (`gate`, hidden -> experts, no bias) gives each token a logit per expert; the
  softmax over all of them is taken in fp32 and the `top_k` largest probabilities pick the
  experts. Mixtral divides those k by their sum; Qwen3-MoE only with `norm_topk_prob`, and then
  rounds them to the activation dtype (Mixtral weights in fp32 and rounds the product);
- each expert is a SwiGLU `MLP` (fused gate/up, down) of the expert width (Mixtral's
  `intermediate_size`, Qwen3-MoE's `moe_intermediate_size`), run only on the tokens that chose
  it: the (token, choice) pairs are sorted by expert and each expert multiplies its rows in one
  GEMM, never every token through every expert;
- a token's output is the sum of its experts' outputs times their weights, added in expert
  order into zeros as transformers' `index_add_` does.

Qwen3-MoE keeps a dense MLP (`intermediate_size`) on the layers its config names
(`mlp_only_layers`, or those off every `decoder_sparse_step`-th: `MoEConfig.sparse_layers`).

Checkpoints: Qwen3-MoE names an expert's projections `mlp.experts.{e}.{gate,up,down}_proj`,
the router `mlp.gate`, which are this module tree's names (gate/up packed as the dense MLP's);
Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2` and `block_sparse_moe.gate` are renamed to
them (`checkpoint_name`). transformers 5 keeps the experts in memory as two 3-D tensors,
`mlp.experts.gate_up_proj` [experts, 2 x width, hidden] and `mlp.experts.down_proj` [experts,
hidden, width] (what `save_pretrained` writes back per expert, but a state dict saved as it is
carries): those fill every expert's parameters (`stacked_parameters`).

Around the model:
- quantization (int8, FP8) quantizes every expert's projections like any `Linear`; the router
  stays exact (a rounded logit would move tokens between experts);
- tensor parallelism cuts every expert's width like the dense MLP's (gate/up rows, down
  columns; engine/models/parallel.py); the experts' down projections leave partial sums, and
  the block all-reduces its weighted total once (`group`); the router is replicated, so every
  rank routes alike;
- the C++ decode loop computes a dense layer (`decode_stack_layers` off); a step's expert
  groups are sized on the host, so decode steps are not captured as CUDA graphs
  (`graph_capturable` off);
- engine/config.py refuses FP8 checkpoints and OLMoE / Qwen2-MoE by name; engine/gguf_file.py
  refuses GGUF files with experts.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.config import MIXTRAL, ModelConfig
from engine.models.llama import MLP, Backbone, CausalLM, DecoderLayer

# Mixtral's checkpoint names -> the module tree's (Qwen3-MoE's).
_MIXTRAL_NAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)
# transformers 5's 3-D expert tensors (prefix, projection); Mixtral's under either prefix.
_STACKED = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")


class SparseMoE(nn.Module):
    """Top-k routed SwiGLU experts (see the module doc)."""

    # Tensor parallelism: the group the experts' partial sums are all-reduced over (set by
    # engine.models.parallel.make_row_parallel); None: the sums are whole.
    group = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.renormalize = moe.renormalize
        self.weights_in_activation_dtype = moe.weights_in_activation_dtype
        # A plain nn.Linear: quantize_linears leaves it exact.
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(cfg, moe.intermediate_size) for _ in range(moe.num_experts)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts), each [tokens, top_k]: the experts each token goes to and the
        weights of their outputs, as the family's transformers router computes them."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_activation_dtype:
            weights = weights.to(logits.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        chosen = experts.flatten()
        # The (token, choice) pairs grouped by expert, tokens in order within a group.
        order = torch.argsort(chosen, stable=True)
        counts = torch.bincount(chosen, minlength=self.num_experts).tolist()
        rows, pair_weights = order // self.top_k, weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                idx = rows[start : start + n]
                y = expert(x[idx]) * pair_weights[start : start + n, None]
                out.index_add_(0, idx, y.to(x.dtype))
            start += n
        if self.group is not None:
            self.group.all_reduce(out)
        return out


class MoEDecoderLayer(DecoderLayer):
    def feed_forward(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return SparseMoE(cfg) if cfg.moe.sparse_layers[layer] else MLP(cfg)


class MoEBackbone(Backbone):
    layer_class = MoEDecoderLayer


class MoECausalLM(CausalLM):
    backbone_class = MoEBackbone
    decode_stack_layers = False  # the C++ loop's MLP is dense
    graph_capturable = False  # expert group sizes are read on the host every step

    def checkpoint_name(self, hf_name: str) -> str:
        if self.cfg.architecture != MIXTRAL or ".block_sparse_moe." not in hf_name:
            return hf_name
        for old, new in _MIXTRAL_NAMES:
            hf_name = hf_name.replace(old, new)
        return hf_name

    def stacked_parameters(self, hf_name: str) -> list[str] | None:
        match = _STACKED.match(hf_name)
        if match is None:
            return None
        prefix, proj = match.groups()
        return [f"{prefix}.mlp.experts.{e}.{proj}.weight" for e in range(self.cfg.moe.num_experts)]

    def _link_fp8_consumers(self, fuse: bool) -> None:
        """The dense layers' links, and each expert's SiLU op feeding its down projection; the
        norm before the experts hands them (and the exact router) full-precision rows."""
        for layer in self.model.layers:
            mlp = layer.mlp
            layer.input_layernorm.fp8_consumer = (layer.self_attn.qkv_proj,) if fuse else ()
            dense = isinstance(mlp, MLP)
            link = fuse and dense
            layer.post_attention_layernorm.fp8_consumer = (mlp.gate_up_proj,) if link else ()
            for m in [mlp] if dense else mlp.experts:
                m.fp8_fused = fuse
