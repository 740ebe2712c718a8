"""The Llama-family decoder over a flattened token batch and the paged KV cache.

Inputs are [num_tokens] ids and positions for all sequences of a step, concatenated; the
attention backend splits them per sequence with the step's metadata. Parameter names follow
Hugging Face's except that q/k/v and gate/up are fused (`qkv_proj`, `gate_up_proj`): one GEMM
instead of three or two. `packed_modules` tells the loader how to fill the fused weights (Phi-3's
checkpoints hold them fused already, in the same [q | k | v] and [gate | up] order, and its
layer is this one: same norms, SiLU-gated MLP and residual adds).
The projections are `engine.models.linear.Linear` (CPU GEMM routing, int8 weights).
Gemma 3's decoder (engine/models/gemma.py) subclasses these classes through the hooks they
leave (`Attention.norm_class` / `layer_attention`, `CausalLM.backbone_class`, `_register_rope`,
`_link_fp8_consumers`, `checkpoint_tensor`, `decode_stack_layers`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import kernels, quantization
from engine.attention.params import LayerAttention
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.models.decode_stack import build as build_decode_stack
from engine.models.decode_stack import rows_qualify
from engine.models.linear import Linear, cpu_has_native_bf16_gemm, quantize_linears
from engine.models.rope import rope_tables, rotate
from engine.quantization.fp8 import FP8Tokens

# Steps of up to this many tokens use the fused elementwise ops (engine.kernels.fused): they
# save per-op overhead, which matters for decode; the scalar loops lose to torch's vectorised
# ops on prefill-sized inputs.
FUSED_MAX_ROWS = 64
# int8 heads (CPU): one scale per this many weights of a row, as GGUF's Q8_0.
HEAD_INT8_GROUP = 32
UNBUILT = object()  # CausalLM._decode_stack before the stack is (re)built


def _fused(ops, rows: int):
    """The fused ops for a step of `rows` tokens, or None for the torch path: the CPU kernels
    only up to FUSED_MAX_ROWS, the GPU's (engine.kernels.triton_fused, `max_rows` None) always."""
    if ops is None:
        return None
    limit = getattr(ops, "max_rows", FUSED_MAX_ROWS)
    return ops if limit is None or rows <= limit else None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    fused = None  # engine.kernels.CpuOps with the fused ops, when the CPU kernels are on
    # (the projection after this norm,) when the fused ops can quantize (GPU): while it is W8A8
    # with per-token scales, add_forward returns `FP8Tokens` instead of the bf16 row. Checked
    # per call: quantization and FP8 checkpoints are applied after the ops are chosen. A
    # tuple, so the Linear is not registered as a submodule here too.
    fp8_consumer: tuple = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same math as transformers' LlamaRMSNorm: normalize in fp32 (torch's fused kernel:
        # x * rsqrt(mean(x^2) + eps), one op instead of five), scale in x's dtype.
        dtype = x.dtype
        xf = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * xf.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): HF's residual add (in x's dtype) fused with the
        next norm; with residual None, (norm(x), x)."""
        fused = _fused(self.fused, x.shape[0])
        if fused is not None and self.fp8_consumer and self.fp8_consumer[0].takes_fp8_tokens:
            q, scale, res = fused.add_rms_norm_fp8(x, residual, self.weight, self.eps)
            return FP8Tokens(q, scale, x.dtype), res
        if fused is not None:
            out, res = fused.add_rms_norm(x, residual, self.weight, self.eps)
            return out, res
        r = x if residual is None else x + residual
        return self.forward(r), r


class Attention(nn.Module):
    norm_class = RMSNorm  # the q/k norms' (Gemma's scale by 1 + w)
    # The scale and window this layer attends with (`engine.attention.params.LayerAttention`);
    # None: the backend's own, the model's one scale and window.
    layer_attention = None

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.layer_types:  # layers that attend with different windows (Qwen2's, Gemma's)
            self.layer_attention = LayerAttention(cfg.attention_scale, cfg.window_of(layer))
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = self.norm_class(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = self.norm_class(cfg.head_dim, cfg.rms_norm_eps)

    fused = None  # engine.kernels.CpuOps with the fused ops, when the CPU kernels are on

    def forward(self, x, cos, sin, cache: KVCache, backend) -> torch.Tensor:
        """cos/sin: [tokens, 1, head_dim] in x's dtype, or with a fused RoPE the fp32 tables'
        rows [tokens, head_dim] (the kernel rounds them to x's dtype itself)."""
        t, h, kvh = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, h + 2 * kvh, self.head_dim)
        v = qkv[:, h + kvh :]
        fused = _fused(self.fused, t)
        if fused is not None and fused.rope_ is not None:
            if self.qk_norm:
                q, k = self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h : h + kvh])
                fused.rope_(q, cos, sin, h)
                fused.rope_(k, cos, sin, kvh)
            else:  # in place on the fresh projection output: q and k heads are adjacent
                fused.rope_(qkv, cos, sin, h + kvh)
                q, k = qkv[:, :h], qkv[:, h : h + kvh]
        elif self.qk_norm:
            q = rotate(self.q_norm(qkv[:, :h]), cos, sin)
            k = rotate(self.k_norm(qkv[:, h : h + kvh]), cos, sin)
        else:
            # q and k heads are adjacent: rotate them in one pass (same math, half the ops).
            qk = rotate(qkv[:, : h + kvh], cos, sin)
            q, k = qk[:, :h], qk[:, h:]
        o = backend.forward(self.layer, q, k, v, cache, self.layer_attention)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        """`intermediate_size`: the width when it is not the config's (a MoE expert's)."""
        super().__init__()
        self.intermediate = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = Linear(self.intermediate, cfg.hidden_size, bias=False)

    fused = None  # engine.kernels.CpuOps with the fused ops, when the CPU kernels are on
    fp8_fused = False  # the fused ops quantize too (GPU): down_proj may take FP8 tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = _fused(self.fused, x.shape[0])
        if fused is not None and self.fp8_fused and self.down_proj.takes_fp8_tokens:
            return self.down_proj(FP8Tokens(*fused.silu_mul_fp8(gate_up), gate_up.dtype))
        if fused is not None:
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.feed_forward(cfg, layer)

    def feed_forward(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """This layer's MLP (a mixture-of-experts decoder's experts where its config has them)."""
        return MLP(cfg)

    def forward(self, x, residual, cos, sin, cache, backend):
        """x: the previous layer's MLP output (or the embeddings, with residual None); returns
        this layer's (MLP output, residual stream before it). Same adds as HF's layer, each
        fused with the norm that follows it."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, cache, backend)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class Backbone(nn.Module):
    layer_class = DecoderLayer

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    backbone_class = Backbone  # the embeddings, the decoder layers and the final norm
    # The C++ decode loop (engine.models.decode_stack) computes this class's layer.
    decode_stack_layers = True
    # Decode steps may be captured as CUDA graphs (engine.cuda_graphs): no step reads a
    # tensor's values on the host.
    graph_capturable = True
    # fused parameter -> the checkpoint's names of its parts, in concatenation order. A
    # pre-fused checkpoint (Phi-3: `ModelConfig.prefused_checkpoint`) stores the fused
    # tensors themselves, in this same order, so its model packs nothing.
    packed_modules = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        if cfg.prefused_checkpoint:
            self.packed_modules = {}
        self.model = self.backbone_class(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # The model may be built under a bf16 default dtype; the tables stay fp32 like HF's.
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            self._register_rope(cfg)
        finally:
            torch.set_default_dtype(prev)
        on_cpu = self.lm_head.weight.device.type == "cpu"
        self.use_cpu_bf16_kernels(
            prev == torch.bfloat16 and on_cpu, gemv_only=cpu_has_native_bf16_gemm()
        )
        self.use_fused_cpu_ops(on_cpu and prev in (torch.float32, torch.bfloat16))
        if self.lm_head.weight.device.type == "cuda":
            self.use_fused_ops(kernels.gpu_ops(self.lm_head.weight.device))

    def _register_rope(self, cfg: ModelConfig, layer_type=None, prefix: str = "rope") -> None:
        """Buffers `{prefix}_cos` / `{prefix}_sin`: the fp32 tables of every position."""
        cos, sin = rope_tables(
            cfg.hf_config, cfg.architecture, cfg.max_position, cfg.head_dim, layer_type
        )
        device = self.lm_head.weight.device
        self.register_buffer(f"{prefix}_cos", cos.to(device), persistent=False)
        self.register_buffer(f"{prefix}_sin", sin.to(device), persistent=False)

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """What parameter `name` holds of the checkpoint's `tensor` (here: the tensor itself)."""
        return tensor

    def checkpoint_name(self, hf_name: str) -> str:
        """Checkpoint tensor `hf_name` under the names this model's modules carry (here: the
        same; `packed_modules` then maps parts to fused projections)."""
        return hf_name

    def stacked_parameters(self, hf_name: str) -> list[str] | None:
        """The parameters that checkpoint tensor `hf_name` holds stacked along its first
        dimension, one per index (a MoE's experts in one 3-D tensor); None for any other."""
        return None

    def quantize(self, method: str | None) -> int:
        """Quantize the decoder layers' projections (`method`: one of
        engine.quantization.RESOLVED; the embeddings stay exact); on CPU the int8 layers use
        the compiled kernels when they are available, and with them the head is int8 too, in
        groups of 32 (as a GGUF Q8_0 file's): at batch 1 the head is a third of a small int8
        model's bytes a step (SmolLM2: 57 of 164 MB with a bf16 head), and int8 halves them.
        Elsewhere the head stays exact (a GPU would dequantize it every call). Returns how many
        decoder projections were quantized (an FP8 checkpoint's layers already are and do not
        count)."""
        self._decode_stack = UNBUILT
        n = quantize_linears(self.model.layers, method)
        if not n or self.model.norm.weight.device.type != "cpu":
            return n
        ops = kernels.ops()
        if ops is None or ops.tiled_linear is None:
            return n
        method = quantization.validate(method)
        if method in quantization.INT8_LAYOUTS and type(self.lm_head) is Linear:
            # One scale per 32 weights of a row (GGUF Q8_0's): per-row scales cost SmolLM2
            # 60x bf16's KL on the head alone. A tied head gets its own int8 copy.
            k = self.lm_head.in_features
            self.lm_head.quantize_int8(group=HEAD_INT8_GROUP if k % HEAD_INT8_GROUP == 0 else 0)
        for m in self.modules():
            if isinstance(m, Linear) and m.scheme == "int8":
                m.int8_ops = ops
                m.int8_q8 = method == "int8-w8a8" and ops.gemv_q8 is not None
        return n

    def use_fused_cpu_ops(self, enabled: bool) -> None:
        """Norms, RoPE and SiLU-and-multiply through engine.kernels' fused ops (CPU only: one
        call instead of several small aten ops each). Off, or without the kernels: torch."""
        ops = kernels.ops() if enabled else None
        if ops is not None and ops.add_rms_norm is None:
            ops = None
        self.use_fused_ops(ops)

    def use_fused_ops(self, ops) -> None:
        """The fused norm / RoPE / SiLU ops every layer uses (CPU kernels or the GPU's Triton
        ops; None: torch), and the GPU's one-pass FP8 activation quantization for W8A8."""
        self._decode_stack = UNBUILT
        for m in self.modules():
            if isinstance(m, RMSNorm | Attention | MLP):
                m.fused = ops
            if isinstance(m, Linear):
                m.token_quantizer = getattr(ops, "quantize_fp8_tokens", None)
        self._link_fp8_consumers(getattr(ops, "add_rms_norm_fp8", None) is not None)

    def _link_fp8_consumers(self, fuse: bool) -> None:
        """W8A8 projections take their activations quantized by the op that makes them."""
        for layer in self.model.layers:
            layer.input_layernorm.fp8_consumer = (layer.self_attn.qkv_proj,) if fuse else ()
            layer.post_attention_layernorm.fp8_consumer = (layer.mlp.gate_up_proj,) if fuse else ()
            layer.mlp.fp8_fused = fuse

    def use_cpu_bf16_kernels(self, enabled: bool, gemv_only: bool = False) -> None:
        """Route bf16 GEMMs through engine.kernels' bf16 ops and widened fp32 GEMMs (see
        `Linear`); without the kernels, only the widened fp32 path is used. `gemv_only` (a CPU
        with native bf16 GEMMs): the GEMV kernel for 1-3 rows, torch's bf16 GEMM otherwise."""
        self._decode_stack = UNBUILT
        ops = kernels.ops() if enabled else None
        for m in self.modules():
            if isinstance(m, Linear):
                m.cpu_ops = ops
                m.widen_fallback = enabled and not gemv_only
                m.gemv_only = gemv_only

    def rope_rows(self, cos, sin, positions, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables' rows of the step's positions, as the layers' RoPE takes them."""
        cos, sin = cos[positions], sin[positions]
        fused = _fused(self.model.norm.fused, positions.shape[0])
        if fused is None or fused.rope_ is None:
            # HF casts the fp32 tables to the activation dtype before use; so do we (the
            # fused RoPE does that cast itself).
            cos, sin = cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)
        return cos, sin

    def forward(self, input_ids, positions, cache: KVCache, backend) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_rows(self.rope_cos, self.rope_sin, positions, x.dtype)
        stack = self._stack() if rows_qualify(input_ids.shape[0]) else None
        args = None
        if stack is not None and hasattr(backend, "stack_args"):
            args = backend.stack_args(cache, x.dtype, input_ids.shape[0])
        if args is not None:  # the whole step in one C++ call, same kernels, same result
            return stack.run(x, cos, sin, *args)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, cache, backend)
        return self.model.norm.add_forward(x, residual)[0]

    _decode_stack = UNBUILT  # then the stack for this configuration, or None (no stack)

    def _stack(self):
        """The C++ decode loop for this model's current configuration, built on first use (the
        kernel routing and quantization are set after construction; changing either resets it)."""
        if self._decode_stack is UNBUILT:
            self._decode_stack = build_decode_stack(self)
        return self._decode_stack

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
