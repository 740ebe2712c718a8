"""Prefix pull (kv_transfer/prefix_pull.py) between real worker loops, real ZMQ and real NIXL
agents in one process: a prefill worker told that the decode worker's cache holds a prompt's
leading blocks READs them from there and computes only the rest; the answer equals the
colocated engine's, the prefill worker's compute counters show the saved tokens, and every
block (the lent ones on the holder, the pinned and adopted ones on the reader) comes back.
Every way a pull can fail — the holder no longer has the blocks, nobody answers, the request
is aborted mid-pull — still answers exactly (it computes the prompt) and leaks nothing."""

from __future__ import annotations

import time

import pytest
import zmq
from test_handoff import SP, Pair, _prompts

from engine import LLM, SamplingParams
from engine.protocol import AbortRequest, GenerateRequest, PrefillRequest, PrefixSource, encode

BS = 16


@pytest.fixture(scope="module")
def model(make_tiny_model):
    return make_tiny_model("qwen3")


@pytest.fixture(scope="module")
def turns():
    """Turn 1 (prefilled on the decode worker) and turn 2 (its 80 tokens and 21 more)."""
    first = _prompts()[3][:80]
    return first, first + _prompts()[1][:21]


@pytest.fixture(scope="module")
def expected(model, turns):
    return LLM(model, dtype="float32").generate([turns[1]], SP)[0].token_ids


def _salted(salt: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, cache_salt=salt)


def _prefill_from(pair, rid, prompt, src_endpoint, tokens, sp=SP):
    src = PrefixSource(pair.d.worker_id, src_endpoint, tokens)
    msg = PrefillRequest(
        rid, prompt, sp, pair.reply_to, pair.d.worker_id, pair.d.endpoint, prefix_from=src
    )
    pair.push[pair.p.endpoint].send(encode(msg))


def _only_on_the_prefill_worker(pair, prompt, salt: str | None = None) -> None:
    """Prefill `prompt` on the prefill worker, finished by its first token: never handed off,
    so only the prefill worker's cache holds it."""
    one = SamplingParams(max_tokens=1, temperature=0, cache_salt=salt)
    msg = PrefillRequest("turn1", prompt, one, pair.reply_to, pair.d.worker_id, pair.d.endpoint)
    pair.push[pair.p.endpoint].send(encode(msg))
    pair.collect(["turn1"])


def _computed(server) -> int:
    bm = server.engine.block_manager
    return bm.num_prefix_query_tokens - bm.num_prefix_hit_tokens


def test_prefill_worker_reads_the_decode_workers_prefix_and_computes_the_rest(
    model, turns, expected
):
    first, second = turns
    pair = Pair(model)
    try:
        pair.generate_on_decode("turn1", first, SP)
        pair.collect(["turn1"])
        before = _computed(pair.p)
        _prefill_from(pair, "turn2", second, pair.d.endpoint, len(first))
        got = pair.collect(["turn2"])
        assert got["turn2"] == expected
        pair.wait_free()
        puller = pair.p.connector.puller
        assert (puller.num_pulls, puller.num_pulled_blocks, puller.num_failed) == (1, 5, 0)
        assert pair.d.connector.lender.num_lent_blocks == 5
        # The prefill worker computed only what follows the 5 pulled blocks.
        assert _computed(pair.p) - before == len(second) - 5 * BS
        # ... and the decode worker, holding those blocks too, read only the rest.
        assert pair.d.connector.num_reused_blocks == 5
    finally:
        pair.close()


def test_a_holder_that_lost_the_blocks_offers_none_and_the_prompt_is_computed(
    model, turns, expected
):
    first, second = turns
    pair = Pair(model)
    try:
        # The router's index said the decode worker holds 80 tokens; it holds none.
        _prefill_from(pair, "turn2", second, pair.d.endpoint, len(first))
        assert pair.collect(["turn2"])["turn2"] == expected
        pair.wait_free()
        puller = pair.p.connector.puller
        assert (puller.num_pulls, puller.num_pulled_blocks, puller.num_failed) == (1, 0, 1)
        assert pair.d.connector.lender.num_refused == 1
    finally:
        pair.close()


def test_no_answer_in_time_computes_the_prompt(model, turns, expected):
    first, second = turns
    pair = Pair(model)
    try:
        pair.p.connector.puller.offer_timeout_s = 0.3
        # A socket nobody reads: the PrefixPull is never answered.
        sink = pair.ctx.socket(zmq.PULL)
        sink.bind("tcp://127.0.0.1:*")
        nowhere = sink.getsockopt(zmq.LAST_ENDPOINT).decode()
        _prefill_from(pair, "turn2", second, nowhere, len(first))
        assert pair.collect(["turn2"])["turn2"] == expected
        pair.wait_free()
        assert pair.p.connector.puller.num_failed == 1
        sink.close(0)
    finally:
        pair.close()


def test_abort_while_pulling_releases_the_late_offer_and_frees_every_block(model, turns):
    first, second = turns
    pair = Pair(model, lease_seconds=30.0)
    try:
        pair.generate_on_decode("turn1", first, SP)
        pair.collect(["turn1"])
        # The holder is busy (0.2 s per step): its offer comes after the abort.
        pair.d.step_delay_s = 0.2
        pair.generate_on_decode("busy", [7, 8, 9], SamplingParams(max_tokens=40, ignore_eos=True))
        _prefill_from(pair, "gone", second, pair.d.endpoint, len(first))
        deadline = time.time() + 10
        while not pair.p.connector.puller.pulls:
            assert time.time() < deadline
            time.sleep(0.01)
        pair.push[pair.p.endpoint].send(encode(AbortRequest("gone")))
        while pair.d.connector.lender.num_lent_blocks == 0:  # the late offer was made
            assert time.time() < deadline
            time.sleep(0.01)
        pair.d.step_delay_s = 0.0
        pair.collect(["busy"])
        pair.wait_free(timeout=10.0)  # far sooner than the 30 s lease: released at once
        assert not pair.p.connector.puller.pulls and not pair.d.connector.lender.lent
        assert pair.p.connector.puller.num_pulled_blocks == 0
    finally:
        pair.close()


def test_a_local_prefill_on_the_decode_worker_reads_what_the_prefill_worker_holds(
    model, turns, expected
):
    first, second = turns
    pair = Pair(model)
    try:
        _only_on_the_prefill_worker(pair, first)
        before = _computed(pair.d)
        src = PrefixSource(pair.p.worker_id, pair.p.endpoint, len(first))
        msg = GenerateRequest("turn2", second, SP, pair.reply_to, prefix_from=src)
        pair.push[pair.d.endpoint].send(encode(msg))
        assert pair.collect(["turn2"])["turn2"] == expected
        pair.wait_free()
        puller = pair.d.connector.puller
        assert (puller.num_pulls, puller.num_pulled_blocks, puller.num_failed) == (1, 5, 0)
        assert pair.p.connector.lender.num_lent_blocks == 5 and not pair.d.connector.pins
        assert _computed(pair.d) - before == len(second) - 5 * BS
    finally:
        pair.close()


@pytest.mark.parametrize("salt", [None, "a"])
def test_the_holder_lends_blocks_its_host_tier_holds(model, turns, expected, salt):
    """The decode worker's device cache evicted the tail of turn 1 into its host tier: it
    copies those blocks back and lends them with the device ones (the host pool as a source).
    A salted request's chain is followed under its salt on both tiers."""
    first, second = turns
    pair = Pair(model, decode_blocks=16, decode_kw={"kv_host_cache_gb": 0.01})
    try:
        pair.generate_on_decode("turn1", first, _salted(salt))
        pair.collect(["turn1"])
        pair.generate_on_decode("filler", list(range(500, 700)), SP)  # 13 blocks: evicts some
        pair.collect(["filler"])
        host = pair.d.engine.host_cache
        on_device = pair.d.engine.block_manager.num_cached_blocks(first, salt)  # loop is idle
        assert 0 < on_device < 5 and host.demotions >= 5 - on_device
        promoted = host.promotions
        _prefill_from(pair, "turn2", second, pair.d.endpoint, len(first), _salted(salt))
        assert pair.collect(["turn2"])["turn2"] == expected
        pair.wait_free()
        assert pair.p.connector.puller.num_pulled_blocks == 5
        assert host.promotions - promoted == 5 - on_device  # the evicted ones, from host
    finally:
        pair.close()


def test_a_failed_pull_read_computes_the_prompt_and_frees_the_holders_blocks(
    model, turns, expected
):
    first, second = turns
    pair = Pair(model, decode_faults={"fail_reads": 1})  # the decode worker's first READ fails
    try:
        _only_on_the_prefill_worker(pair, first)
        src = PrefixSource(pair.p.worker_id, pair.p.endpoint, len(first))
        msg = GenerateRequest("turn2", second, SP, pair.reply_to, prefix_from=src)
        pair.push[pair.d.endpoint].send(encode(msg))
        assert pair.collect(["turn2"])["turn2"] == expected
        pair.wait_free()  # the holder's lent blocks came back (the reader told it at once)
        puller = pair.d.connector.puller
        assert (puller.num_pulls, puller.num_pulled_blocks, puller.num_failed) == (1, 0, 1)
        assert not pair.p.connector.lender.lent and not pair.d.connector.pins
    finally:
        pair.close()


@pytest.mark.parametrize(("owner", "asker"), [("a", "a"), ("a", "b"), (None, "a"), ("a", None)])
def test_a_pull_reads_only_blocks_cached_under_the_requests_salt(
    model, turns, expected, owner, asker
):
    """The holder pins only blocks cached under the reader's salt (`PrefixPull.cache_salt`):
    another tenant's prefix (or an unsalted one) is never read. What is read joins the reader's
    cache under that salt (its prefill computes only the rest), and the decode worker reuses
    its own blocks for the hand-off under that salt only."""
    first, second = turns
    pair = Pair(model)
    try:
        pair.generate_on_decode("turn1", first, _salted(owner))
        pair.collect(["turn1"])
        before = _computed(pair.p)
        _prefill_from(pair, "turn2", second, pair.d.endpoint, len(first), _salted(asker))
        assert pair.collect(["turn2"])["turn2"] == expected
        pair.wait_free()
        pulled = 5 if owner == asker else 0
        puller = pair.p.connector.puller
        assert (puller.num_pulled_blocks, puller.num_failed) == (pulled, int(not pulled))
        assert pair.d.connector.lender.num_refused == int(not pulled)
        assert _computed(pair.p) - before == len(second) - pulled * BS
        assert pair.d.connector.num_reused_blocks == pulled
    finally:
        pair.close()


def test_a_salted_pull_asks_only_past_the_readers_own_blocks_of_that_salt(model, turns, expected):
    """The reader holds turn 1's first 2 blocks under the request's salt (and the first 3
    unsalted, which it must not count as its own): it pulls the other 3 of the holder's 5."""
    first, second = turns
    pair = Pair(model)
    try:
        _only_on_the_prefill_worker(pair, first[:33], "a")
        _only_on_the_prefill_worker(pair, first[:49])
        pair.generate_on_decode("turn1", first, _salted("a"))
        pair.collect(["turn1"])
        _prefill_from(pair, "turn2", second, pair.d.endpoint, len(first), _salted("a"))
        assert pair.collect(["turn2"])["turn2"] == expected
        pair.wait_free()
        puller = pair.p.connector.puller
        assert (puller.num_pulls, puller.num_pulled_blocks, puller.num_failed) == (1, 3, 0)
        assert pair.d.connector.lender.num_lent_blocks == 3
    finally:
        pair.close()
