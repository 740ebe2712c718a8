"""vLLM's priority scheduling (`--scheduling-policy priority`): the waiting queue in (priority,
arrival) order, lower first; running sequences take their tokens in that order; the sequence
preempted when the KV cache is short is the last in it. Under fcfs (the default) nothing of
that changes: arrival order, the youngest preempted. Every answer stays the greedy answer it
would be alone (transformers' on the tiny model)."""

from __future__ import annotations

import pytest
import torch
from test_parity_hf import hf_greedy

from engine import LLM, SamplingParams
from engine.kv_cache import BlockManager
from engine.scheduler import Scheduler, Sequence


def _seq(name: str, priority: int, prompt_len: int = 8) -> Sequence:
    sp = SamplingParams(max_tokens=8, temperature=0, priority=priority)
    return Sequence(name, list(range(3, 3 + prompt_len)), sp)


def _scheduler(policy: str, blocks: int = 64) -> Scheduler:
    bm = BlockManager(num_blocks=blocks, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256, enable_chunked_prefill=True)
    sched.set_policy(policy)
    return sched


@pytest.mark.parametrize(
    ("policy", "order"),
    [("fcfs", ["a5", "b0", "c5", "d-1", "e0"]), ("priority", ["d-1", "b0", "e0", "a5", "c5"])],
)
def test_the_waiting_queue_is_in_the_policys_order(policy, order):
    sched = _scheduler(policy)
    for name in ("a5", "b0", "c5", "d-1", "e0"):
        sched.add(_seq(name, int(name[1:])))
    assert [s.request_id for s in sched.waiting] == order
    plan = sched.schedule()  # admitted in that order, too
    assert [s.seq.request_id for s in plan.scheduled] == order


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "young-0"), ("priority", "old-9")])
def test_the_preempted_sequence_is_the_last_in_the_policys_order(policy, victim):
    # 4 blocks of 4 slots: two 8-token prompts fill them; the next token needs a fifth block.
    sched = _scheduler(policy, blocks=4)
    old, young = _seq("old-9", 9), _seq("young-0", 0)
    sched.add(old)
    sched.schedule()
    sched.add(young)
    sched.schedule()
    for seq in (old, young):  # both prompts computed, and one token each sampled
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(5)
    plan = sched.schedule()
    assert [s.request_id for s in plan.preempted] == [victim]
    assert [s.seq.request_id for s in plan.scheduled] == [
        s for s in ("old-9", "young-0") if s != victim
    ]
    assert sched.waiting[0].request_id == victim  # back in the queue, to be recomputed


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="fcfs"):
        _scheduler("lifo")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (30, 22, 41, 17)]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_one_slot_serves_requests_in_the_policys_order(make_tiny_model, policy):
    path = make_tiny_model("llama")
    llm = LLM(path, dtype="float32", max_num_seqs=1, scheduling_policy=policy)
    engine, prompts = llm.engine, _prompts()
    priorities = [5, 5, 0, -2]
    for i, (prompt, p) in enumerate(zip(prompts, priorities, strict=True)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6, temperature=0, priority=p))
    finished: list[str] = []
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finish_reason is not None:
                finished.append(out.request_id)
    want = ["r0", "r1", "r2", "r3"] if policy == "fcfs" else ["r3", "r2", "r0", "r1"]
    assert finished == want
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(path, prompt, 6)
