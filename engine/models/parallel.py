"""Tensor parallelism for `CausalLM`: which slice of every weight a rank holds, and the
row-parallel projections' all-reduce.

A rank builds the ordinary `CausalLM` from a rank-local `ModelConfig` (`Shard.local_config`:
its query heads, its KV heads, its slice of the MLP width), so attention, the fused layouts
and the KV cache need no TP code; the loader reads the checkpoint through `ShardedCheckpoint`,
which hands each weight over already cut to the rank's slice (read from safetensors as a
slice, never whole):

- column-parallel, split by output rows: q_proj, k_proj, v_proj (and their biases: qwen2),
  gate_proj, up_proj. Each part is cut on its own and the loader places it in the rank's
  fused qkv / gate_up tensor, so the fused layout is [q_r | k_r | v_r] per rank. A
  pre-fused checkpoint tensor (Phi-3's qkv_proj, gate_up_proj) is cut part by part the same
  way and the rank's cuts concatenated: the same per-rank layout, read as the same slices;
- row-parallel, split by input columns: o_proj and down_proj (`RowParallelLinear`: the
  partial products are summed over the ranks by an all-reduce; a bias, if any, is added
  by rank 0 only);
- replicated: embeddings, norms, the head. Rank 0 alone computes logits, from the whole
  head, so logprobs are those of the unsplit model (no vocab-parallel gather to reorder);
- a MoE's experts (engine/models/moe.py) each like the dense MLP: gate/up by rows, down by
  columns, over `MoEConfig.intermediate_size` (a 3-D expert tensor along that width,
  `Shard.stacked_cut`); the router is replicated, so every rank routes alike. An expert's
  down projection leaves its partial sum (`RowParallelLinear.reduce_output` off) and the
  block all-reduces the weighted total once.

KV heads: with TP <= KV heads each rank holds KV heads // TP of them; with more ranks than KV
heads, each rank holds a copy of the one KV head its query heads read (TP must then be a
multiple of the KV heads, so no rank's query heads straddle two groups).

Quantized weights keep the unsplit model's scales: per-channel scales of column-parallel
layers follow their rows; a row-parallel layer quantized after loading takes each row's
scale from the whole row (`amax` all-reduced with MAX), and an FP8 checkpoint's block-wise
scales are cut at block boundaries (the column split must fall on one: a clear error if not).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from engine.config import ModelConfig
from engine.models.linear import Linear
from engine.models.moe import SparseMoE
from engine.quantization import fp8, quantize_int8

# HF weight name -> (split, part): "col" cuts dim 0, "row" cuts dim 1.
_RULES = (
    (re.compile(r"\.self_attn\.q_proj\.(weight|bias)$"), "col", "q"),
    (re.compile(r"\.self_attn\.[kv]_proj\.(weight|bias)$"), "col", "kv"),
    (re.compile(r"\.mlp\.(gate|up)_proj\.weight$"), "col", "mlp"),
    (re.compile(r"\.self_attn\.o_proj\.weight$"), "row", "q"),
    (re.compile(r"\.mlp\.down_proj\.weight$"), "row", "mlp"),
    # A MoE's experts, each cut like the dense MLP (Qwen3-MoE's names, then Mixtral's).
    (re.compile(r"\.mlp\.experts\.\d+\.(gate|up)_proj\.weight$"), "col", "moe"),
    (re.compile(r"\.mlp\.experts\.\d+\.down_proj\.weight$"), "row", "moe"),
    (re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$"), "col", "moe"),
    (re.compile(r"\.block_sparse_moe\.experts\.\d+\.w2\.weight$"), "row", "moe"),
)
# transformers 5's 3-D expert tensors: (dimension cut, its parts in order) per expert.
_STACKED_RULES = (
    (re.compile(r"\.experts\.gate_up_proj$"), 1, ("moe", "moe")),
    (re.compile(r"\.experts\.down_proj$"), 2, ("moe",)),
)
# A pre-fused checkpoint tensor -> its parts, in row order (each cut as the split tensor is).
_FUSED_RULES = (
    (re.compile(r"\.self_attn\.qkv_proj\.(weight|bias)$"), ("q", "kv", "kv")),
    (re.compile(r"\.mlp\.gate_up_proj\.weight$"), ("mlp", "mlp")),
)
_ROW_BIAS = re.compile(r"\.self_attn\.o_proj\.bias$")
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `size`: the slices of `cfg` (the whole model's config) it holds."""

    rank: int
    size: int
    cfg: ModelConfig

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> Shard:
        check_tp(cfg, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside tensor_parallel_size {size}")
        return cls(rank, size, cfg)

    @property
    def num_heads(self) -> int:
        return self.cfg.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.cfg.num_kv_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        kv = self.cfg.num_kv_heads
        if self.size <= kv:
            return self.rank * self.num_kv_heads
        return self.rank // (self.size // kv)  # replicated: the KV head of my query heads

    @property
    def intermediate(self) -> int:
        return self.cfg.intermediate_size // self.size

    @property
    def expert_width(self) -> int:
        """The rank's slice of each MoE expert's width (0 without experts)."""
        moe = self.cfg.moe
        return 0 if moe is None else moe.intermediate_size // self.size

    def local_config(self) -> ModelConfig:
        """The config of this rank's model: its heads, MLP and expert widths, everything else
        whole."""
        moe = self.cfg.moe
        if moe is not None:
            moe = dataclasses.replace(moe, intermediate_size=self.expert_width)
        return dataclasses.replace(
            self.cfg,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate,
            moe=moe,
        )

    def _spans(self) -> dict[str, tuple[int, int]]:
        """part -> (start, length) of the rank's slice within that part's rows (or columns)."""
        d = self.cfg.head_dim
        return {
            "q": (self.rank * self.num_heads * d, self.num_heads * d),
            "kv": (self.kv_head_start * d, self.num_kv_heads * d),
            "mlp": (self.rank * self.intermediate, self.intermediate),
            "moe": (self.rank * self.expert_width, self.expert_width),
        }

    def cut(self, hf_name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of the rank's slice of checkpoint tensor `hf_name`, or None for
        a replicated (or pre-fused: `fused_rows`) tensor."""
        spans = self._spans()
        for pattern, split, part in _RULES:
            if pattern.search(hf_name):
                start, n = spans[part]
                return (0 if split == "col" else 1), start, start + n
        return None

    def stacked_cut(self, hf_name: str) -> tuple[int, list[tuple[int, int]]] | None:
        """(dim, [(start, stop), ...]) of the rank's parts of a 3-D expert tensor along the
        dimension that holds each expert's width; None for any other tensor."""
        for pattern, dim, parts in _STACKED_RULES:
            if pattern.search(hf_name):
                start, n = self._spans()["moe"]
                whole = self.cfg.moe.intermediate_size
                return dim, [(i * whole + start, i * whole + start + n) for i in range(len(parts))]
        return None

    def fused_rows(self, hf_name: str) -> list[tuple[int, int]] | None:
        """The (start, stop) row ranges of the rank's parts of pre-fused checkpoint tensor
        `hf_name`, in the rank's fused order; None for any other tensor."""
        cfg, spans = self.cfg, self._spans()
        whole = {
            "q": cfg.num_heads * cfg.head_dim,
            "kv": cfg.num_kv_heads * cfg.head_dim,
            "mlp": cfg.intermediate_size,
        }
        for pattern, parts in _FUSED_RULES:
            if pattern.search(hf_name):
                rows, offset = [], 0
                for part in parts:
                    start, n = spans[part]
                    rows.append((offset + start, offset + start + n))
                    offset += whole[part]
                return rows
        return None


def check_tp(cfg: ModelConfig, size: int) -> None:
    """ValueError naming the setting when `size` ranks cannot split this model."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    h, kv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if h % size:
        raise ValueError(f"tensor_parallel_size {size} must divide num_attention_heads ({h})")
    if size <= kv and kv % size:
        raise ValueError(f"tensor_parallel_size {size} must divide num_key_value_heads ({kv})")
    if size > kv and size % kv:
        raise ValueError(
            f"tensor_parallel_size {size} exceeds num_key_value_heads ({kv}) and must be a "
            "multiple of it (each rank then keeps a copy of one KV head)"
        )
    if inter % size:
        raise ValueError(f"tensor_parallel_size {size} must divide intermediate_size ({inter})")
    if cfg.moe is not None and cfg.moe.intermediate_size % size:
        width = cfg.moe.intermediate_size
        raise ValueError(
            f"tensor_parallel_size {size} must divide each expert's intermediate size ({width})"
        )


def check_tp_settings(tp, role: str, load_format: str) -> None:
    """EngineConfig's check: what tensor parallelism does not support yet is refused by name.
    Every role runs TP (a decode group's ranks READ their own KV heads); `role` stays for the
    callers, which name the pool a refusal is about."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
    if tp > 1 and load_format == "dummy":
        raise ValueError(
            f"tensor_parallel_size {tp} needs a checkpoint: load_format 'dummy' draws "
            "each rank's weights on their own, which would not be one model"
        )


class ShardedCheckpoint:
    """A checkpoint (`engine.loader`'s safetensors or GGUF reader) seen by one rank: `get`
    returns the rank's slice of each tensor, `scale_of` the matching slice of its FP8 scales."""

    def __init__(self, inner, shard: Shard):
        self.inner, self.shard = inner, shard
        self.path, self.where = inner.path, inner.where

    def get(self, name: str) -> torch.Tensor:
        if _ROW_BIAS.search(name):
            bias = self.inner.get(name)
            return bias if self.shard.rank == 0 else torch.zeros_like(bias)
        rows = self.shard.fused_rows(name)
        if rows is not None:
            return torch.cat([self._read(name, 0, start, stop) for start, stop in rows])
        stacked = self.shard.stacked_cut(name)
        if stacked is not None:
            dim, parts = stacked
            return torch.cat([self._read(name, dim, a, b) for a, b in parts], dim=dim)
        cut = self.shard.cut(name)
        if cut is None:
            return self.inner.get(name)
        return self._read(name, *cut)

    def _read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices [start, stop) of dimension `dim` of tensor `name` (rows, columns, or a 3-D
        expert tensor's widths)."""
        handle = getattr(self.inner, "files", {}).get(self.where.get(name))
        if handle is not None:  # safetensors: read only the slice
            return handle.get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]
        return self.inner.get(name).narrow(dim, start, stop - start).contiguous()

    def shape(self, name: str) -> tuple[int, ...]:
        handle = getattr(self.inner, "files", {}).get(self.where.get(name))
        if handle is not None:
            return tuple(handle.get_slice(name).get_shape())
        return tuple(self.inner.get(name).shape)

    def scale_of(self, ckpt, scale_name: str, hf_name: str, n: int, k: int) -> torch.Tensor:
        """The rank's rows (column-parallel) or K blocks (row-parallel) of `hf_name`'s scales,
        converted from the whole tensor's (n, k: the rank's shape, unused)."""
        full_n, full_k = self.shape(hf_name)
        s = self.inner.scale_of(ckpt, scale_name, hf_name, full_n, full_k)
        rows = self.shard.fused_rows(hf_name)
        if rows is not None:  # per row (scale_rows): the rows the weight's parts kept
            return torch.cat([s[start:stop] for start, stop in rows]).contiguous()
        cut = self.shard.cut(hf_name)
        if cut is None:
            return s
        dim, start, stop = cut
        if dim == 0:
            return s[start:stop].contiguous()
        if s.dim() == 1:  # per output channel: the row's scale, whole on every rank
            return s
        bk = ckpt.block_k
        # Checked at both ends, so every rank (rank 0 first, before the others) refuses it.
        cut_at = next((c for c in (start, stop) if c % bk and c != full_k), None)
        if cut_at is not None:
            raise ValueError(
                f"{hf_name}: tensor_parallel_size {self.shard.size} splits its {full_k} "
                f"columns at {cut_at}, inside a {bk}-column FP8 scale block"
            )
        return s[:, start // bk : -(-stop // bk)].contiguous()


class RowParallelLinear(Linear):
    """A `Linear` holding some input columns: its output is a partial sum, completed by an
    all-reduce over the group (`group.all_reduce(tensor, op)`, engine.distributed)."""

    group = None
    # False for a MoE expert's down projection: its block sums the experts' weighted partial
    # outputs and all-reduces once (engine.models.moe.SparseMoE.group).
    reduce_output = True

    @property
    def takes_fp8_tokens(self) -> bool:
        return False  # a fused kernel would scale the tokens by this rank's columns only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dynamic = self.scheme == "fp8" and self.fp8_activations and not self.block_k
        if dynamic and self.input_scale is None:
            # W8A8 per-token scales from the whole token (max over the ranks' columns), as the
            # unsplit layer quantizes it; block-wise groups and static scales need no help.
            x = x.reshape(-1, x.shape[-1])
            amax = x.float().abs().amax(dim=1, keepdim=True)
            self.group.all_reduce(amax, op="max")
            x = fp8.FP8Tokens(*fp8.quantize_fp8_tokens(x, amax=amax), x.dtype)
        y = super().forward(x)
        if self.reduce_output:
            self.group.all_reduce(y)
        return y

    def _row_amax(self) -> torch.Tensor:
        amax = self.weight.data.float().abs().amax(dim=1)
        self.group.all_reduce(amax, op="max")
        return amax

    def quantize_int8(self) -> None:
        self._replace_weight("int8", *quantize_int8(self.weight.data, self._row_amax()))

    def quantize_fp8(self, activations: bool) -> None:
        self._replace_weight("fp8", *fp8.quantize_fp8_weight(self.weight.data, self._row_amax()))
        self.fp8_activations = activations


def make_row_parallel(model: torch.nn.Module, group) -> int:
    """Turn the model's o_proj and down_proj into `RowParallelLinear`s reducing over `group`
    (the class is swapped in place so parameter names and loaders stay those of `Linear`); a
    MoE expert's down_proj leaves its partial sum to its block, which reduces over `group`."""
    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and name.rsplit(".", 1)[-1] in ROW_PARALLEL:
            mod.__class__ = RowParallelLinear
            mod.group = group
            mod.reduce_output = ".experts." not in name
            n += 1
        elif isinstance(mod, SparseMoE):
            mod.group = group
    return n
