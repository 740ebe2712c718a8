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
from engine.protocol import AbortRequest, GenerateRequest, PrefillRequest, PrefixSource
from engine.wire import encode

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


def _prefill_from(pair, rid, prompt, src_endpoint, tokens):
    src = PrefixSource(pair.d.worker_id, src_endpoint, tokens)
    msg = PrefillRequest(
        rid, prompt, SP, pair.reply_to, pair.d.worker_id, pair.d.endpoint, prefix_from=src
    )
    pair.push[pair.p.endpoint].send(encode(msg))


def _only_on_the_prefill_worker(pair, prompt) -> None:
    """Prefill `prompt` on the prefill worker, finished by its first token: never handed off,
    so only the prefill worker's cache holds it."""
    one = SamplingParams(max_tokens=1, temperature=0)
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


def test_the_holder_lends_blocks_its_host_tier_holds(model, turns, expected):
    """The decode worker's device cache evicted the tail of turn 1 into its host tier: it
    copies those blocks back and lends them with the device ones (the host pool as a source)."""
    first, second = turns
    pair = Pair(model, decode_blocks=16, decode_kw={"kv_host_cache_gb": 0.01})
    try:
        pair.generate_on_decode("turn1", first, SP)
        pair.collect(["turn1"])
        pair.generate_on_decode("filler", list(range(500, 700)), SP)  # 13 blocks: evicts some
        pair.collect(["filler"])
        host = pair.d.engine.host_cache
        on_device = pair.d.engine.block_manager.num_cached_blocks(first)  # the loop is idle
        assert 0 < on_device < 5 and host.demotions >= 5 - on_device
        promoted = host.promotions
        _prefill_from(pair, "turn2", second, pair.d.endpoint, len(first))
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
