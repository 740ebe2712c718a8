"""One contiguous, huge-page-backed block for the weights a CPU decode step reads, in the order
it reads them.

A batch-1 decode step streams every projection once, so its floor is bytes / read bandwidth.
With each weight in an allocation of its own (4 KiB pages, wherever the loader put it), the
121 GEMVs of a SmolLM2 step read at ~0.65 of a plain `sum()`'s bandwidth on the project's
2-core AMD EPYC, although one GEMV over a large matrix reads at ~1.0x: each new matrix restarts
the hardware prefetcher's stream and walks fresh page tables. Laid end to end in forward order
(as a GGUF file lays them out for llama.cpp's mmap) and backed by 2 MiB pages, the same sweep
reads at ~0.8x and takes ~0.78x the time (`benchmarks/cpu_decode.py` measures the whole step).

`pack_weights(model)` moves the decoder layers' tensors, the final norm and the head into such
a block (the tensors become views of it; values unchanged) and returns its size. CPU only; the
input embedding stays where it is unless it is the (tied) head. `TANDEM_WEIGHT_ARENA=0` turns
it off. Huge pages are asked for with `madvise(MADV_HUGEPAGE)` (Linux; the kernel's
transparent-huge-page mode must be "always" or "madvise"); without them the block still gives
the prefetcher one stream.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import torch
from torch import nn

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line (the kernels' loads are unaligned-safe anyway)


def enabled() -> bool:
    return os.environ.get("TANDEM_WEIGHT_ARENA", "1") != "0"


def stream_order(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(module, attribute, tensor) for every parameter and buffer a decode step reads, in the
    order it reads them: each decoder layer's, then the final norm's, then the head's. A
    tensor shared by two modules (a tied head) appears once."""
    parts = [*model.model.layers, model.model.norm, model.lm_head]
    seen: set[int] = set()
    out = []
    for part in parts:
        for mod in part.modules():
            tensors = list(mod._parameters.items()) + list(mod._buffers.items())
            for name, t in tensors:
                if t is None or id(t) in seen or "rope_" in name:
                    continue
                seen.add(id(t))
                out.append((mod, name, t))
    return out


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of `nbytes`, 2 MiB-aligned and advised to be backed by
    huge pages (best effort: on failure it is an ordinary aligned buffer)."""
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    buf = raw[start : start + nbytes]
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and nbytes >= HUGE_PAGE:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            length = nbytes - nbytes % mmap.PAGESIZE
            if libc.madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(length), advice):
                log.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        except (OSError, AttributeError) as exc:  # no libc symbol: keep 4 KiB pages
            log.debug("no madvise (%s)", exc)
    return buf


def pack_weights(model: nn.Module) -> int:
    """Move the decode step's weights of a CPU model into one block (see the module doc);
    returns its size in bytes (0 when off or not on CPU). Values and shapes are unchanged."""
    entries = stream_order(model)
    if not enabled() or not entries or any(t.device.type != "cpu" for _, _, t in entries):
        return 0
    offsets, total = [], 0
    for _, _, t in entries:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    arena = huge_page_bytes(total)
    with torch.no_grad():
        for (mod, name, t), off in zip(entries, offsets, strict=True):
            nbytes = t.numel() * t.element_size()
            view = arena[off : off + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            if name in mod._parameters:
                mod._parameters[name].data = view
            else:
                mod._buffers[name] = view
    return total
