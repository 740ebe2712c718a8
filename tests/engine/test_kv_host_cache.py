"""The host-memory KV tier (engine/kv_host_cache.py): multi-turn chats through a device cache
too small for them equal the engine without the tier (and transformers) token for token while
the evicted prefixes really come back from host memory; `num_cached_tokens` is exactly the
prompt tokens not computed; the pool stays within its size; a demoted-then-promoted block keeps
every byte (FP8 scales too); a block leased to a hand-off is never demoted or overwritten."""

from __future__ import annotations

import random

import pytest
import torch
from kv_copy import CopyConnector
from test_parity_hf import hf_greedy

from engine import LLM, SamplingParams
from engine.kv_cache import KVCache, hash_block
from engine.llm_engine import EngineConfig, LLMEngine

BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(make_tiny_model):
    return make_tiny_model("llama")


def _host_gb(engine_kw: dict, model, blocks: int) -> float:
    """GiB for exactly `blocks` host slots of this model's KV (half a block over, so float
    rounding cannot lose one)."""
    probe = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=1, **engine_kw))
    return (blocks + 0.5) * KVCache.bytes_per_block(probe.kv_spec) / 2**30


def _conversations(n=3, turns=3, seed=0):
    rng = random.Random(seed)
    convs = [[rng.randrange(5, 400) for _ in range(40)] for _ in range(n)]
    return convs, [
        [[rng.randrange(5, 400) for _ in range(12)] for _ in range(turns)] for _ in convs
    ]


class ComputeMeter:
    """Wraps the runner: prompt tokens each request really computed (its chunks' positions
    inside the prompt), from the step plans themselves."""

    def __init__(self, engine: LLMEngine):
        self.prompt_computed: dict[str, int] = {}
        execute = engine.runner.execute

        def run(plan):
            for s in plan.scheduled:
                seq = s.seq
                lo, hi = seq.num_computed_tokens, seq.num_computed_tokens + s.num_new_tokens
                inside = max(0, min(hi, seq.num_prompt_tokens) - lo)
                key = seq.group_id
                self.prompt_computed[key] = self.prompt_computed.get(key, 0) + inside
            return execute(plan)

        engine.runner.execute = run


def _chat(llm: LLM, meter: ComputeMeter, convs, turns) -> tuple[list, list]:
    """Round-robin turns of every conversation; each turn's prompt is the whole history."""
    history = [list(c) for c in convs]
    outs, prompts = [], []
    for t in range(len(turns[0])):
        for i in range(len(convs)):
            history[i] += turns[i][t]
            out = llm.generate([history[i]], GREEDY)[0]
            computed = meter.prompt_computed[out.request_id]
            # Counted once: what was not computed, device and host hits together.
            assert out.num_cached_tokens == len(history[i]) - computed
            prompts.append(list(history[i]))
            outs.append(out)
            history[i] += out.token_ids
    return prompts, outs


def _llm(model, host_blocks: int, kv_dtype="auto", device_blocks=10):
    kw = dict(dtype="float32", kv_dtype=kv_dtype, block_size=BS, max_num_batched_tokens=64)
    gb = _host_gb(kw, model, host_blocks) if host_blocks else 0.0
    llm = LLM(str(model), num_kv_blocks=device_blocks, kv_host_cache_gb=gb, **kw)
    return llm, ComputeMeter(llm.engine)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_multi_turn_matches_no_tier_and_hf_with_promotions(model, kv_dtype):
    convs, turns = _conversations()
    base, base_meter = _llm(model, 0, kv_dtype)
    tier, tier_meter = _llm(model, 64, kv_dtype)
    prompts, ref = _chat(base, base_meter, convs, turns)
    _, got = _chat(tier, tier_meter, convs, turns)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    if kv_dtype == "auto":  # fp32 KV: the exact model; FP8 KV is compared with itself above
        assert [o.token_ids for o in got] == [hf_greedy(model, p, 6) for p in prompts]
    host = tier.engine.host_cache
    st = tier.engine.stats()
    assert host.promotions > 0 and host.demotions > 0 and st["host_hit_tokens"] > 0
    assert st["host_bytes_promoted"] == host.promotions * host.block_bytes
    computed = sum(tier_meter.prompt_computed.values())
    assert computed < sum(base_meter.prompt_computed.values())
    # The worker's hit counter (the planner's demand) counts both tiers, once.
    assert st["prefix_hit_tokens"] == sum(o.num_cached_tokens for o in got)
    assert tier.engine.block_manager.num_free_blocks == 10


def test_pool_is_bounded_and_lru(model):
    convs, turns = _conversations(n=4, turns=3, seed=1)
    llm, meter = _llm(model, 4)
    host = llm.engine.host_cache
    assert host.num_slots == 4
    _chat(llm, meter, convs, turns)
    assert host.num_used == 4 and host.data.shape[0] == 4
    assert host.demotions > 4  # slots were reused: the LRU evicted older blocks


def test_host_tier_moves_reach_the_kv_event_sink_in_an_order_an_index_can_follow(model):
    """A demotion is told as "removed" from the device tier, then "stored" in the host tier
    (router/kv_index.py keeps one tier per block: the other order would lose the host copy);
    a host slot reused for another block is "removed" from the host tier. Replaying the events
    leaves exactly what both tiers hold."""
    convs, turns = _conversations(n=4, turns=3, seed=1)
    llm, meter = _llm(model, 4)
    bm, host = llm.engine.block_manager, llm.engine.host_cache
    events: list[tuple[str, int, str]] = []
    bm.event_sink = lambda kind, h, tier: events.append((kind, h, tier))
    _chat(llm, meter, convs, turns)
    demoted = [i for i, e in enumerate(events) if e[0] == "stored" and e[2] == "host"]
    assert demoted and host.demotions > host.num_slots  # slots reused: host removals too
    for i in demoted:  # between the two: the host slot it takes may be told freed
        before = [e for e in events[:i] if e[1] == events[i][1]]
        assert before[-1] == ("removed", events[i][1], "device")
    held: dict[str, set[int]] = {"device": set(), "host": set()}
    for kind, h, tier in events:
        (held[tier].add if kind == "stored" else held[tier].discard)(h)
    assert held["host"] == set(host.cached_hashes())
    assert held["device"] <= set(bm.cached_hashes())


def _chain(tokens: list[int]) -> list[int]:
    out, prev = [], None
    for b in range((len(tokens) - 1) // BS):
        prev = hash_block(prev, tuple(tokens[b * BS : (b + 1) * BS]))
        out.append(prev)
    return out


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_demoted_then_promoted_block_is_byte_identical(model, kv_dtype):
    llm, _ = _llm(model, 32, kv_dtype, device_blocks=6)
    eng, rng = llm.engine, random.Random(3)
    cache, bm, host = eng.cache, eng.block_manager, eng.host_cache
    prompt = [rng.randrange(5, 400) for _ in range(50)]
    llm.generate([prompt], GREEDY)
    hashes = _chain(prompt)
    has_scales = cache.scales is not None
    snap = [
        (cache.data[b].clone(), cache.scales[b].clone() if has_scales else None)
        for b in (bm._cached[h] for h in hashes)
    ]
    # Another long prompt takes every device block: the first one's blocks go to host.
    llm.generate([[rng.randrange(5, 400) for _ in range(80)]], GREEDY)
    assert not any(h in bm._cached for h in hashes)
    host.synchronize()
    for h, (data, scales) in zip(hashes, snap, strict=True):
        slot = host._lru[h]
        assert torch.equal(host.data[slot].to(data.device), data)  # the pool is host memory
        if scales is not None:
            assert torch.equal(host.scales[slot].to(scales.device), scales)
    before = host.promotions
    out = llm.generate([prompt], GREEDY)[0]
    assert host.promotions - before == len(hashes)
    assert out.num_cached_tokens == len(hashes) * BS
    for h, (data, scales) in zip(hashes, snap, strict=True):
        bid = bm._cached[h]  # registered after the step that promoted it
        assert torch.equal(cache.data[bid], data)
        if scales is not None:
            assert torch.equal(cache.scales[bid], scales)


class Holder:
    """A prefill connector that keeps one request's blocks under its lease (a NIXL READ may
    land in them at any time) and refuses the rest (the engine frees those at once)."""

    def __init__(self, engine: LLMEngine, lease: str):
        self.lease, self.handoff = lease, None
        engine.set_kv_connector(self)

    def on_prefilled(self, handoff) -> bool:
        if handoff.request_id != self.lease:
            return False
        self.handoff = handoff
        return True


def test_leased_blocks_are_never_demoted_or_overwritten(model):
    kw = dict(dtype="float32", max_num_batched_tokens=64, role="prefill")
    gb = _host_gb(kw, model, 32)
    eng = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=10, kv_host_cache_gb=gb, **kw))
    holder, rng = Holder(eng, "lease"), random.Random(4)
    evicted: list[int] = []
    demote = eng.block_manager.on_evict
    eng.block_manager.on_evict = lambda b, h, t: (evicted.append(b), demote(b, h, t))

    def prefill(rid, prompt):
        eng.add_request(rid, prompt, GREEDY)
        while eng.has_unfinished():
            eng.step()

    prefill("lease", [rng.randrange(5, 400) for _ in range(60)])
    leased = holder.handoff.block_ids
    snap = {b: eng.cache.data[b].clone() for b in leased}
    for i in range(8):  # the 6 free blocks are evicted and reused over and over
        prefill(f"r{i}", [rng.randrange(5, 400) for _ in range(80)])
    assert eng.host_cache.demotions > 0 and evicted
    assert not set(evicted) & set(leased)
    assert all(torch.equal(eng.cache.data[b], snap[b]) for b in leased)
    eng.release("lease")
    assert eng.block_manager.num_free_blocks == 10


def test_decode_side_reuse_counts_host_hits(model):
    """A decode worker's own host tier serves leading prompt blocks of a remote request (read
    from the peer: only the rest); outputs still equal the colocated engine's."""
    kw = dict(model=str(model), dtype="float32", max_num_batched_tokens=64)
    pe = LLMEngine(EngineConfig(**kw, role="prefill", num_kv_blocks=64))
    gb = _host_gb({"dtype": "float32"}, model, 64)
    de = LLMEngine(EngineConfig(**kw, role="decode", num_kv_blocks=10, kv_host_cache_gb=gb))
    conn = CopyConnector(pe, de)
    convs, turns = _conversations(seed=5)
    ref_llm, meter = _llm(model, 0, device_blocks=64)
    prompts, ref = _chat(ref_llm, meter, convs, turns)
    for k, prompt in enumerate(prompts):
        rid = f"t{k}"
        pe.add_request(rid, prompt, GREEDY)
        first = None
        while first is None:
            outs = pe.step()
            first = next((o.token_ids[0] for o in outs if o.request_id == rid), None)
        de.add_remote_request(rid, prompt, first, GREEDY)
        tokens = [first]
        while de.has_unfinished():
            tokens += [t for o in de.step() for t in o.token_ids]
        assert tokens == ref[k].token_ids
    assert de.host_cache.promotions > 0 and sum(conn.reused.values()) > 0
    assert de.block_manager.num_free_blocks == 10


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_bad_host_cache_size_is_refused(bad):
    with pytest.raises(ValueError, match="kv_host_cache_gb"):
        EngineConfig(model="m", kv_host_cache_gb=bad)


def test_promoted_blocks_are_matchable_and_handed_off_only_after_their_step(model):
    """Prefill role: while the step that needs promoted blocks has not run, no other request
    can match them (they are not in the device prefix cache); the hand-off after it carries
    their bytes as they were demoted."""
    kw = dict(dtype="float32", max_num_batched_tokens=64, role="prefill")
    gb = _host_gb(kw, model, 32)
    eng = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=8, kv_host_cache_gb=gb, **kw))
    bm, rng = eng.block_manager, random.Random(6)
    holder = Holder(eng, "b")
    prompt = [rng.randrange(5, 400) for _ in range(50)]
    hashes = _chain(prompt)

    def prefill(rid, p):
        eng.add_request(rid, p, GREEDY)
        while eng.has_unfinished():
            eng.step()

    prefill("a", prompt)
    snap = [eng.cache.data[bm._cached[h]].clone() for h in hashes]
    prefill("evict", [rng.randrange(5, 400) for _ in range(120)])  # all 8 blocks
    assert not any(h in bm._cached for h in hashes)
    seen = []
    execute = eng.runner.execute

    def spy(plan):
        seen.append([h in bm._cached for h in hashes])
        return execute(plan)

    eng.runner.execute = spy
    prefill("b", prompt + [7, 8, 9])
    assert seen[0] == [False] * len(hashes)  # the promoting step: not matchable yet
    assert eng.host_cache.promotions >= len(hashes)
    table = holder.handoff.block_ids
    assert [bm._cached[h] for h in hashes] == table[: len(hashes)]  # committed after the step
    for b, data in zip(table, snap, strict=False):
        assert torch.equal(eng.cache.data[b], data)
    eng.release("b")


def test_evictions_during_a_promotion_never_take_its_host_slots(model):
    """A full pool whose every slot this admission is about to promote: the device blocks its
    own allocation evicts are dropped, not written over the slots it reads."""
    llm, _ = _llm(model, 2, device_blocks=8)
    host, rng = llm.engine.host_cache, random.Random(7)
    prompt = [rng.randrange(5, 400) for _ in range(40)]  # 2 full blocks and a partial one
    first = llm.generate([prompt], GREEDY)[0]
    llm.generate([[rng.randrange(5, 400) for _ in range(120)]], GREEDY)  # every device block
    assert host.num_used == 2 and all(h in host for h in _chain(prompt))
    dropped = host.dropped
    again = llm.generate([prompt], GREEDY)[0]
    assert host.dropped > dropped and again.num_cached_tokens == 32
    assert again.token_ids == first.token_ids


def test_blocks_demoted_together_come_back_in_one_copy_per_run(model):
    """A freed prompt's blocks are demoted tail first into descending slots, so they sit in
    chain order side by side and a promotion copies each run of consecutive blocks at once."""
    from engine.kv_host_cache import _runs

    assert _runs([(4, 0), (5, 1), (6, 2), (9, 3), (10, 4), (2, 7)]) == [
        (4, 0, 3),
        (9, 3, 2),
        (2, 7, 1),
    ]
    llm, _ = _llm(model, 32, device_blocks=6)
    host, runs = llm.engine.host_cache, []
    copy = host._copy
    host._copy = lambda pairs, to_host: (runs.append((_runs(pairs), to_host)), copy(pairs, to_host))
    rng = random.Random(5)
    prompt = [rng.randrange(5, 400) for _ in range(50)]  # 3 whole blocks cached
    want = llm.generate([prompt], GREEDY)[0].token_ids
    llm.generate([[rng.randrange(5, 400) for _ in range(80)]], GREEDY)  # evicts them
    assert llm.generate([prompt], GREEDY)[0].token_ids == want
    promotions = [r for r, to_host in runs if not to_host and r]
    assert promotions == [[(promotions[0][0][0], promotions[0][0][1], 3)]]
