"""When a CPU decode step may run as one C++ call (engine.kernels.decode_stack), and its inputs.

The C++ loop makes exactly the kernel calls the Python layers make for a step of 1-3 decode
rows, so it is used only where the Python path would have made those calls: every projection
a plain `Linear` (no tensor parallelism) routed to the GEMV kernel (bf16 weights with the CPU
kernels on, or int8 weights with their kernels), the fused norm/RoPE/SiLU ops on, no q/k
norm, and the attention backend on its CPU paged-decode kernel with a cache in the model's
dtype (no FP8 scales). Anything else keeps the Python path, and so does every model whose
layer is not the loop's (`CausalLM.decode_stack_layers`: Gemma 3's four norms, GELU MLP and
per-layer scale, window and rotary table; the MoE decoders' routed experts).
`TANDEM_DECODE_STACK=0` turns it off (the benchmark compares the two).
"""

from __future__ import annotations

import os

from torch import nn

from engine.kernels.decode_stack import PER_LAYER
from engine.models.linear import GEMV_MAX_ROWS, KERNEL_DTYPES, Linear


def enabled() -> bool:
    return os.environ.get("TANDEM_DECODE_STACK", "1") != "0"


def _gemv_args(lin: nn.Module, dtype) -> tuple | None:
    """(weight, scale, bias) the Python path passes to the GEMV kernel for this projection at
    1-3 rows, or None when it would not call the kernel."""
    if type(lin) is not Linear:  # a tensor-parallel subclass all-reduces: not here
        return None
    if lin.scheme is None:
        ops = lin.cpu_ops
        ok = ops is not None and ops.gemv is not None and lin.weight.dtype.is_floating_point
        return (lin.weight, None, lin.bias) if ok else None
    if lin.scheme == "int8":
        ops = lin.int8_ops
        ok = ops is not None and ops.gemv is not None and dtype in KERNEL_DTYPES
        return (lin.qweight, lin.wscale, lin.bias) if ok else None
    return None


def build(model: nn.Module):
    """A `DecodeStack` for this model, or None when it does not qualify (see the module doc)."""
    cfg = model.cfg
    ops = model.model.norm.fused
    stack_cls = getattr(ops, "decode_stack", None)
    if not enabled() or stack_cls is None or cfg.qk_norm or ops.rope_ is None:
        return None
    if not model.decode_stack_layers:  # another layer than the loop's (Gemma 3's)
        return None
    if cfg.layer_types:  # layers with different windows (the loop attends with one)
        return None
    dtype = model.model.norm.weight.dtype
    tensors: list = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(m.fused is not ops for m in (*norms, attn, mlp)):
            return None
        if any(n.fp8_consumer for n in norms):
            return None
        args = [_gemv_args(lin, dtype) for lin in (attn.qkv_proj, attn.o_proj)]
        args += [_gemv_args(lin, dtype) for lin in (mlp.gate_up_proj, mlp.down_proj)]
        if any(a is None for a in args) or args[2][2] is not None or args[3][2] is not None:
            return None
        (qkv_w, qkv_s, qkv_b), (o_w, o_s, o_b) = args[0], args[1]
        tensors += [norms[0].weight, qkv_w, qkv_s, qkv_b, o_w, o_s, o_b, norms[1].weight]
        tensors += [args[2][0], args[2][1], args[3][0], args[3][1]]
    assert len(tensors) == PER_LAYER * len(model.model.layers)
    tensors.append(model.model.norm.weight)
    eps = model.model.norm.eps
    # "int8-w8a8": the stack takes the Python path's choice, which every int8 layer shares.
    q8 = {m.int8_q8 for m in model.model.layers.modules() if getattr(m, "scheme", 0) == "int8"}
    if len(q8) > 1:
        return None
    return stack_cls(
        tensors, len(model.model.layers), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
        eps, q8 == {True},
    )  # fmt: skip


def rows_qualify(num_tokens: int) -> bool:
    return 0 < num_tokens <= GEMV_MAX_ROWS
