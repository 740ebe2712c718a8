"""vLLM's `cache_salt` (engine/kv_events.py): a salted request's prefix-cache blocks hash apart
from every other salt's and from the unsalted ones, on every path that hashes a request's tokens:
the block manager's lookups, allocations, pins and adoptions; the scheduler's in-batch sharing;
the engine's commits; the decode side of a hand-off; the host tier. A request never hits
blocks another salt (or no salt) cached, and two requests of one salt share as before; outputs
never change, only what is computed."""

from __future__ import annotations

import random

import pytest
from kv_copy import CopyConnector
from test_kv_host_cache import _host_gb

from engine import LLM, SamplingParams
from engine.kv_cache import BlockManager
from engine.llm_engine import EngineConfig, LLMEngine
from engine.scheduler import Scheduler, Sequence

SALTS = (None, "a", "b")
BS = 16
SHARED = list(range(100, 148))  # 3 blocks of 16


def _sp(salt: str | None, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, cache_salt=salt)


@pytest.fixture(scope="module")
def model(make_tiny_model):
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens of a prompt on a fresh colocated engine (no cache, no salt)."""
    llm = LLM(model, dtype="float32")
    return lambda prompts: [o.token_ids for o in llm.generate(prompts, _sp(None))]


# -- the block manager -------------------------------------------------------------------------
@pytest.mark.parametrize("owner", SALTS)
def test_block_manager_matches_only_blocks_of_the_same_salt(owner):
    bm = BlockManager(num_blocks=16, block_size=4)
    a = list(range(13))  # 3 full blocks + 1 token
    table, cached = bm.allocate(a, salt=owner)
    assert cached == 0
    bm.commit(table, a, 13, salt=owner)
    bm.free(table)
    for salt in SALTS:
        hit = 3 if salt == owner else 0
        assert bm.cached_prefix_tokens(a, salt) == 4 * hit
        assert bm.num_cached_blocks(a[:12], salt) == hit
        pinned = bm.pin_prefix(a, salt=salt)
        assert len(pinned) == hit
        bm.free(pinned)
        table, cached = bm.allocate(a, salt=salt)
        assert cached == 4 * hit
        bm.free(table)
    assert bm.num_free_blocks == 16


@pytest.mark.parametrize("owner", SALTS)
def test_can_allocate_counts_in_use_hits_of_the_same_salt_only(owner):
    bm = BlockManager(num_blocks=5, block_size=4)
    a = list(range(13))  # 4 blocks, 3 of them full
    table, _ = bm.allocate(a, salt=owner)
    bm.commit(table, a, 13, salt=owner)
    # One block free: enough only when the 3 full blocks in use are hits.
    for salt in SALTS:
        assert bm.can_allocate(13, a, salt) == (salt == owner)
        if salt != owner:
            with pytest.raises(MemoryError):
                bm.allocate(a, salt=salt)
    again, cached = bm.allocate(a, salt=owner)
    assert cached == 12 and again[:3] == table[:3]
    bm.free(table)
    bm.free(again)


@pytest.mark.parametrize("owner", SALTS)
def test_adopted_blocks_are_hits_for_their_salt_only(owner):
    """What a READ filled (a hand-off's or a prefix pull's blocks) joins the cache under the
    request's salt; a pull continuing the reader's own cached block 0 chains from it."""
    bm = BlockManager(num_blocks=16, block_size=4)
    a = list(range(100, 113))
    own, _ = bm.allocate(a[:5], salt=owner)  # block 0 computed here
    bm.commit(own, a, 4, salt=owner)
    filled = bm.allocate_blocks(2)
    assert bm.adopt(filled, a, first=1, salt=owner) == 2
    for salt in SALTS:
        assert bm.cached_prefix_tokens(a, salt) == (12 if salt == owner else 0)
    fresh = bm.allocate_blocks(3)
    assert bm.adopt(fresh, list(range(12)), first=0, salt=owner) == 3
    for salt in SALTS:
        assert bm.num_cached_blocks(list(range(12)), salt) == (3 if salt == owner else 0)
    bm.free(own + filled + fresh)


def test_unchunked_admission_counts_cached_tokens_of_the_same_salt_only():
    """Without chunked prefill a prompt is admitted only when what it must compute fits the
    step's budget: its salt's cached prefix counts, another salt's does not."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = SHARED + [7, 8, 9]
    table, _ = bm.allocate(prompt, salt="a")
    bm.commit(table, prompt, len(prompt), salt="a")
    bm.free(table)
    for salt, admitted in (("a", True), ("b", False), (None, False)):
        sched = Scheduler(
            bm, max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=False
        )
        sched.add(Sequence("r", list(prompt), _sp(salt)))
        plan = sched.schedule()
        assert bool(plan.scheduled) == admitted
        if admitted:
            assert plan.scheduled[0].seq.num_cached_tokens == 48
            bm.free(plan.scheduled[0].seq.block_table)


@pytest.mark.parametrize("owner", [None, "a"])
@pytest.mark.parametrize("remote", [False, True])
def test_admission_room_counts_in_use_blocks_of_the_same_salt_only(owner, remote):
    """A prompt whose leading blocks a running request holds needs room only for the rest (a
    local prefill, or a decode worker's reuse of its own blocks for a peer's KV): when they
    are its salt's. A cache with a single free block admits it only then."""
    bm = BlockManager(num_blocks=5, block_size=BS)
    running = SHARED + [7]
    table, _ = bm.allocate(running, salt=owner)
    bm.commit(table, running, len(running), salt=owner)  # 4 blocks held, 1 free
    for salt in SALTS:
        sched = Scheduler(
            bm, max_num_seqs=4, max_num_batched_tokens=256, enable_chunked_prefill=True
        )
        seq = Sequence("r", SHARED + [8], _sp(salt), kv_from_peer=remote)
        sched.add(seq)
        plan = sched.schedule()
        assert bool(plan.fetch if remote else plan.scheduled) == (salt == owner)
        if salt == owner:
            assert seq.block_table[:3] == table[:3]
            bm.free(seq.block_table)
    bm.free(table)


# -- the engine ---------------------------------------------------------------------------------
def _generate(engine: LLMEngine, rid: str, prompt: list[int], salt: str | None):
    """(tokens, num_cached_tokens) of one request run to its end."""
    engine.add_request(rid, prompt, _sp(salt))
    tokens, cached = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
            cached = out.num_cached_tokens if out.index == 0 else cached
    return tokens, cached


def test_a_prompt_hits_the_cache_only_under_its_own_salt(model, reference):
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64))
    prompt = SHARED + [7, 8, 9]
    expected = reference([prompt])[0]
    salts = [None, "a", "b", "a", None, "b"]
    runs = [_generate(engine, f"r{i}", prompt, s) for i, s in enumerate(salts)]
    assert [tokens for tokens, _ in runs] == [expected] * len(salts)
    assert [cached for _, cached in runs] == [0, 0, 0, 48, 48, 48]


def test_in_batch_sharing_waits_only_for_a_prefix_of_the_same_salt(model, reference):
    """r2 shares r0's salt and waits a step for the blocks r0 computes; r1 (another salt) and
    r3 (no salt) could never hit them, so they are admitted at once and compute their own."""
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64))
    prompts = [SHARED + [1], SHARED + [2], SHARED + [3], SHARED + [4]]
    salts = ["a", "b", "a", None]
    for i, (p, s) in enumerate(zip(prompts, salts, strict=True)):
        engine.add_request(f"r{i}", p, _sp(s))
    out: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    first_step = None
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
            if o.index == 0:
                cached[o.request_id] = o.num_cached_tokens
        first_step = len(engine.scheduler.running) if first_step is None else first_step
    keys = [f"r{i}" for i in range(4)]
    assert [out[k] for k in keys] == reference(prompts)
    assert first_step == 3 and engine.scheduler.num_prefix_waits == 1
    assert [cached[k] for k in keys] == [0, 0, 48, 0]


# -- the hand-off ---------------------------------------------------------------------------
def _engines(model, **decode_kw):
    kw = dict(model=str(model), dtype="float32", max_num_batched_tokens=128)
    pe = LLMEngine(EngineConfig(**kw, role="prefill", num_kv_blocks=64))
    de = LLMEngine(EngineConfig(**kw, role="decode", num_kv_blocks=64, **decode_kw))
    return pe, de, CopyConnector(pe, de)


def _handed_off(pe: LLMEngine, de: LLMEngine, rid: str, prompt: list[int], salt) -> list[int]:
    """Prefill on `pe`, decode on `de`: the request's tokens."""
    pe.add_request(rid, prompt, _sp(salt))
    first = None
    while pe.has_unfinished():
        first = next((o.token_ids[0] for o in pe.step() if o.index == 0), first)
    de.add_remote_request(rid, prompt, first, _sp(salt))
    tokens = [first]
    while de.has_unfinished():
        tokens += [t for o in de.step() for t in o.token_ids]
    return tokens


@pytest.mark.parametrize("owner", SALTS)
def test_handed_off_blocks_join_the_decode_cache_under_the_requests_salt(model, reference, owner):
    pe, de, conn = _engines(model)
    prompt = SHARED + [7, 8, 9]
    expected = reference([prompt])[0]
    assert _handed_off(pe, de, "r0", prompt, owner) == expected
    for bm in (pe.block_manager, de.block_manager):
        for salt in SALTS:
            assert bm.cached_prefix_tokens(prompt, salt) == (48 if salt == owner else 0)
    # A later hand-off of the same prompt reuses the decode side's blocks for its salt only
    # (each salt asks once, before its own hand-off caches the prompt under it too).
    for i, salt in enumerate(SALTS, start=1):
        assert _handed_off(pe, de, f"r{i}", prompt, salt) == expected
        assert conn.reused[f"r{i}"] == (3 if salt == owner else 0)


# -- the host tier ------------------------------------------------------------------------------
def _host_engine(model, device_blocks=8, host_blocks=32, **kw):
    kw = dict(dtype="float32", max_num_batched_tokens=64, **kw)
    gb = _host_gb(kw, model, host_blocks)
    cfg = EngineConfig(model=str(model), num_kv_blocks=device_blocks, kv_host_cache_gb=gb, **kw)
    return LLMEngine(cfg)


def _demoted(engine: LLMEngine, prompt: list[int], owner, filler_tokens: int = 120) -> None:
    """`prompt` computed under `owner`, then evicted from the device into the host pool: all
    of it by a filler that takes every device block (120 tokens), its last full block only
    by one that takes 6 of the 8 (90: the chain's tail is evicted first)."""
    _generate(engine, "owner", prompt, owner)
    filler = [random.Random(9).randrange(5, 400) for _ in range(filler_tokens)]
    _generate(engine, "filler", filler, "filler-salt")
    on_device = 0 if filler_tokens == 120 else 2
    assert engine.block_manager.num_cached_blocks(prompt[:48], owner) == on_device


@pytest.mark.parametrize("owner", [None, "a"])
@pytest.mark.parametrize("filler_tokens", [120, 90])
def test_host_tier_promotes_only_for_the_same_salt(model, reference, owner, filler_tokens):
    """The whole prefix in the host pool, or its last block there after 2 on the device: the
    host match continues the device match under the request's salt."""
    prompt = SHARED + [7, 8, 9]
    expected = reference([prompt])[0]
    demoted = 3 if filler_tokens == 120 else 1
    for salt in SALTS:
        engine = _host_engine(model)
        _demoted(engine, prompt, owner, filler_tokens)
        promoted = engine.host_cache.promotions
        tokens, cached = _generate(engine, "asker", prompt, salt)
        assert tokens == expected
        hit = salt == owner
        assert cached == (48 if hit else 0)
        assert engine.host_cache.promotions - promoted == (demoted if hit else 0)


@pytest.mark.parametrize("owner", [None, "a"])
def test_host_tier_lends_to_a_peer_only_under_the_same_salt(model, owner):
    """`promote_for_peer` (a prefix pull's holder): only the reader's salt finds the demoted
    blocks, and the promoted blocks join the device cache under that salt."""
    prompt = SHARED + [7, 8, 9]
    engine = _host_engine(model, role="prefill")
    _demoted(engine, prompt, owner)
    host, bm = engine.host_cache, engine.block_manager
    for salt in SALTS:
        if salt == owner:
            continue
        assert host.promote_for_peer(prompt, 0, salt) == []
    blocks = host.promote_for_peer(prompt, 0, owner)
    assert len(blocks) == 3
    for salt in SALTS:
        assert bm.num_cached_blocks(prompt[:48], salt) == (3 if salt == owner else 0)
    bm.free(blocks)
