"""Block manager: reference counts, prefix reuse, eviction, and (hypothesis) that no sequence
of operations leaks or double-frees a block."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_cache import BlockManager


def test_prefix_reuse_and_eviction():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = list(range(10))  # 2 full blocks + 2 tokens
    table_a, cached = bm.allocate(a)
    assert cached == 0 and len(table_a) == 3
    bm.commit(table_a, a, 10)
    table_b, cached = bm.allocate(a[:8] + [99, 98, 97])
    assert cached == 8 and table_b[:2] == table_a[:2]
    assert bm.blocks[table_a[0]].ref_count == 2
    bm.free(table_a)
    bm.free(table_b)
    assert bm.num_free_blocks == 8
    # Cached blocks survive the free and are hit again...
    table_c, cached = bm.allocate(a)
    assert cached == 8
    bm.free(table_c)
    # ...until fresh allocations need every block and evict them.
    filler = bm.allocate_blocks(8)
    bm.free(filler)
    _, cached = bm.allocate(a)
    assert cached == 0


def test_whole_prompt_hit_still_computes_last_token():
    bm = BlockManager(num_blocks=4, block_size=4)
    ids = list(range(8))
    t, _ = bm.allocate(ids)
    bm.commit(t, ids, 8)
    t2, cached = bm.allocate(ids)
    assert cached == 4  # not 8: the last block is recomputed for the logits
    bm.free(t)
    bm.free(t2)


def test_double_free_raises():
    bm = BlockManager(num_blocks=2, block_size=4)
    t = bm.allocate_blocks(1)
    again = list(t)
    bm.free(t)
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(again)


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "append", "free", "commit"]),
        st.integers(0, 7),
        st.lists(st.integers(0, 3), min_size=1, max_size=40),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, caching=st.booleans())
def test_no_leaks_under_random_operations(ops, caching):
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=caching)
    live: dict[int, tuple[list[int], list[int], int]] = {}  # slot -> (table, tokens, computed)
    for op, slot, tokens in ops:
        if op == "alloc" and slot not in live:
            if bm.can_allocate(len(tokens), tokens):
                table, cached = bm.allocate(tokens)
                assert cached % 4 == 0 and cached < len(tokens)
                live[slot] = (table, list(tokens), cached)
            else:
                with pytest.raises(MemoryError):
                    bm.allocate(tokens)
        elif op == "append" and slot in live:
            table, toks, computed = live[slot]
            toks = toks + tokens[:3]
            if bm.can_append(table, len(toks)):
                bm.append_slots(table, len(toks))
                live[slot] = (table, toks, computed)
        elif op == "commit" and slot in live:
            table, toks, _ = live[slot]
            bm.commit(table, toks, len(toks))
            live[slot] = (table, toks, len(toks))
        elif op == "free" and slot in live:
            bm.free(live.pop(slot)[0])
        # Invariants after every operation.
        refs = [0] * bm.num_blocks
        for table, _, _ in live.values():
            for b in table:
                refs[b] += 1
        assert [b.ref_count for b in bm.blocks] == refs
        assert bm.num_free_blocks == sum(1 for r in refs if r == 0)
    for table, _, _ in live.values():
        bm.free(table)
    assert bm.num_free_blocks == bm.num_blocks


def test_pinned_prefix_blocks_survive_eviction_and_adopted_blocks_are_hits():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = list(range(12))  # 3 full blocks
    table, _ = bm.allocate(a)
    bm.commit(table, a, 12)
    ids = list(table)
    bm.free(table)
    # A peer reads blocks 1.. : pinned, they are not evicted by allocations meanwhile.
    lent = bm.pin_prefix(a, first=1)
    assert lent == ids[1:3] and bm.num_free_blocks == 6
    bm.free(bm.allocate_blocks(6))  # evicts block 0 only
    assert bm.cached_prefix_tokens(a + [0]) == 0
    bm.free(lent)
    # Blocks a READ filled become cache hits for the same tokens, as if computed here...
    stored = []
    bm.event_sink = lambda kind, h, tier: stored.append((kind, tier))
    filled = bm.allocate_blocks(3)
    b = list(range(100, 112))
    assert bm.adopt(filled, b, first=0) == 3 and stored == [("stored", "device")] * 3
    assert bm.cached_prefix_tokens(b + [0]) == 12
    # ... and a hash the cache holds already keeps its block: the copy stays uncached.
    dup = bm.allocate_blocks(1)
    assert bm.adopt(dup, b, first=0) == 0 and bm.blocks[dup[0]].hash is None
    bm.free(filled + dup)
    assert bm.num_free_blocks == 8
