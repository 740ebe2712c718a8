"""The paged KV cache: one tensor per worker, laid out block-major.

Layout: `data[num_blocks, num_layers, 2 (k|v), block_size, num_kv_heads, head_dim]`.
A block is contiguous across all layers, so moving a request's KV to another worker takes one
memory descriptor per block (NIXL cost grows with descriptor count, not bytes), and per-layer
views `data[:, layer, 0]` are strided views with no copy. A token's slot is
`block_id * block_size + offset`.

FP8 KV (`kv_dtype="fp8_e4m3"`): `data` holds float8_e4m3fn and `scales[num_blocks, num_layers,
2, block_size, num_kv_heads]` (float32) holds one scale per token and head (amax / 448), so a
block's scales are contiguous as well and travel next to it. Attention dequantizes on read.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
KV_DTYPES = ("auto", "fp8_e4m3")


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    """Everything that fixes the byte layout of a block; peers must agree on all of it."""

    model: str  # architecture name, e.g. "LlamaForCausalLM"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # model compute dtype
    kv_dtype: str = "auto"
    layout: str = "block,layer,kv,slot,head,dim"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")

    @property
    def cache_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.kv_dtype == "fp8_e4m3" else self.dtype

    @property
    def has_scales(self) -> bool:
        return self.kv_dtype == "fp8_e4m3"

    @property
    def block_numel(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        return self.block_numel * torch.empty((), dtype=self.cache_dtype).element_size()

    @property
    def scale_block_bytes(self) -> int:
        if not self.has_scales:
            return 0
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * 4

    def compat_fields(self) -> dict[str, str]:
        """The fields a transfer peer must match, as strings (for hashing and error messages)."""
        return {
            "model": self.model,
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_dtype": self.kv_dtype,
            "block_size": str(self.block_size),
            "layout": self.layout,
            "num_layers": str(self.num_layers),
            "num_kv_heads": str(self.num_kv_heads),
            "head_dim": str(self.head_dim),
        }

    def compat_hash(self) -> str:
        text = "|".join(f"{k}={v}" for k, v in sorted(self.compat_fields().items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu"):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        shape = (num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.data = torch.zeros(shape, dtype=spec.cache_dtype, device=self.device)
        self.scales = (
            torch.ones(shape[:-1], dtype=torch.float32, device=self.device)
            if spec.has_scales
            else None
        )
        # Built once: a decode step asks for every layer's views several times.
        self._views = [self._make_views(layer) for layer in range(spec.num_layers)]

    @staticmethod
    def bytes_per_block(spec: KVCacheSpec) -> int:
        return spec.block_bytes + spec.scale_block_bytes

    def copy_block(self, src: int, dst: int) -> None:
        """Block `dst` becomes a copy of block `src` (every layer, K and V, and FP8 scales)."""
        self.data[dst].copy_(self.data[src])
        if self.scales is not None:
            self.scales[dst].copy_(self.scales[src])

    def layer_views(self, layer: int):
        """(k, v, k_scale, v_scale) for one layer; k/v are [num_blocks, block_size, heads, dim]."""
        return self._views[layer]

    def _make_views(self, layer: int):
        k = self.data[:, layer, 0]
        v = self.data[:, layer, 1]
        if self.scales is None:
            return k, v, None, None
        return k, v, self.scales[:, layer, 0], self.scales[:, layer, 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v ([tokens, kv_heads, head_dim]) at `slots` ([tokens], int64)."""
        bs = self.spec.block_size
        self.write_at(layer, slots // bs, slots % bs, k, v)

    def write_at(
        self,
        layer: int,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """`write` with the slots already split into block ids and in-block offsets (a step
        writes the same slots in every layer, so a backend splits them once)."""
        kc, vc, ks, vs = self.layer_views(layer)
        if self.scales is None:
            kc[blocks, offsets] = k.to(kc.dtype)
            vc[blocks, offsets] = v.to(vc.dtype)
            return
        for cache, scale, x in ((kc, ks, k), (vc, vs, v)):
            xf = x.float()
            s = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
            cache[blocks, offsets] = (xf / s.unsqueeze(-1)).to(torch.float8_e4m3fn)
            scale[blocks, offsets] = s

    def gather(
        self, layer: int, block_table: torch.Tensor, out_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V for the blocks in `block_table` (any shape of block ids), dequantized.

        Returns tensors of shape [*block_table.shape, block_size, kv_heads, head_dim].
        """
        kc, vc, ks, vs = self.layer_views(layer)
        # index_select copies whole blocks (contiguous runs); advanced indexing (kc[table])
        # walks element by element and is 2-3x slower on CPU.
        flat = block_table.reshape(-1)
        shape = (*block_table.shape, *kc.shape[1:])
        k = kc.index_select(0, flat).view(shape)
        v = vc.index_select(0, flat).view(shape)
        if self.scales is None:
            return k.to(out_dtype), v.to(out_dtype)
        k = (k.float() * ks.index_select(0, flat).view(shape[:-1]).unsqueeze(-1)).to(out_dtype)
        v = (v.float() * vs.index_select(0, flat).view(shape[:-1]).unsqueeze(-1)).to(out_dtype)
        return k, v
