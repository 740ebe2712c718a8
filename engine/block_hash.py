"""The prefix-cache block hash, shared by the engine (`kv_cache.BlockManager`) and the router
(`router.kv_index`), which must compute the same value from the same token ids in another
process: Python's `hash()` does not (before 3.12, `hash(None)` — the chain's seed — is an
address, different in every process). No torch here: the router imports it.

A block's hash chains the previous block's hash with this block's token ids, so equal hashes
mean equal prefixes. Values are signed 64-bit ints (they travel in msgpack frames as ints).

A request's `cache_salt` (vLLM's) seeds the chain in place of the constant seed: its blocks
hash apart from every other salt's (and the unsalted ones), so a tenant cannot learn from the
time to first token whether another tenant sent a prompt. Every hash of a salted request's
blocks must be computed with its salt: the engine's cache, the hand-off's adoption, a prefix
pull, the host tier and the router's index alike.
"""

from __future__ import annotations

import hashlib
import struct

_SEED = b"tandem-kv-block-v1"


def chain_seed(salt: str | None) -> bytes:
    """What the first block of a request salted `salt` (None: unsalted) is hashed after."""
    if salt is None:
        return _SEED
    return hashlib.blake2b(_SEED + b"\0" + salt.encode(), digest_size=16).digest()


def hash_block(prev_hash: int | None, token_ids: tuple[int, ...], salt: str | None = None) -> int:
    """The hash of a block holding `token_ids` after the block hashed `prev_hash` (None: the
    first block of a sequence, whose request is salted `salt`)."""
    head = chain_seed(salt) if prev_hash is None else struct.pack("<q", prev_hash)
    # int64 per token: a token id is never out of range for the packing (no error mid-commit).
    body = struct.pack(f"<{len(token_ids)}q", *token_ids)
    digest = hashlib.blake2b(head + body, digest_size=8).digest()
    return struct.unpack("<q", digest)[0]


def prefix_block_hashes(
    token_ids: list[int], block_size: int, max_blocks: int, salt: str | None = None
) -> list[int]:
    """The hashes of the first `max_blocks` full blocks of `token_ids`, in order."""
    n = min(max_blocks, len(token_ids) // block_size)
    # Packed once and sliced: the same bytes `hash_block` hashes, at a third of its cost.
    data = struct.pack(f"<{n * block_size}q", *token_ids[: n * block_size])
    step = 8 * block_size
    out: list[int] = []
    head = chain_seed(salt)
    for b in range(n):
        digest = hashlib.blake2b(head + data[b * step : (b + 1) * step], digest_size=8).digest()
        head = digest
        out.append(struct.unpack("<q", digest)[0])
    return out


def lookup_blocks(prompt_len: int, block_size: int) -> int:
    """How many leading blocks of a prompt a prefix cache may serve: never the last prompt
    token (its logits are needed), so at most `(prompt_len - 1) // block_size`."""
    return max(0, (prompt_len - 1) // block_size)
