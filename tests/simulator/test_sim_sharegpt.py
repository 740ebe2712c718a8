"""ShareGPT conversations as a simulator trace (cluster/simulator/sharegpt.py): the first
human turn and its reply per conversation, lengths counted, arrivals drawn at a rate."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.simulator.sharegpt import BYTES_PER_TOKEN, arrivals, sharegpt_requests
from cluster.simulator.traces import DrawnArrivals, detect_format, load_requests


def _conversation(i: int, prompt: str, reply: str, lead: list[dict] | None = None) -> dict:
    turns = [*(lead or []), {"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]
    return {"id": f"c{i}", "conversations": turns}


CONVERSATIONS = [
    _conversation(0, "a" * 40, "b" * 400),
    {"id": "only-a-reply", "conversations": [{"from": "gpt", "value": "hello there"}]},
    {"id": "no-reply", "conversations": [{"from": "human", "value": "anyone?"}]},
    _conversation(3, "c" * 80, "d" * 8, lead=[{"from": "system", "value": "be brief"}]),
    {"id": "not-a-list", "conversations": "human: hi"},
]


@pytest.fixture
def sharegpt_json(tmp_path) -> Path:
    path = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    path.write_text(json.dumps(CONVERSATIONS, indent=1))
    return path


def test_each_usable_conversation_is_one_request_of_its_first_exchange(sharegpt_json):
    requests = load_requests(sharegpt_json, drawn=DrawnArrivals(rate=4.0))
    # Two conversations have a human turn followed by a reply, one after a system turn,
    # which its prompt carries as a client would send it: 40 and 8 + 80 bytes, answers of
    # 400 and 8 bytes, at 4 bytes a token.
    lengths = sorted((r.prompt_len, r.output_len) for r in requests)
    assert lengths == [(10, 100), (22, 2)]
    assert requests[0].arrival_s == 0.0 and requests[1].arrival_s > 0
    assert BYTES_PER_TOKEN == 4.0


def test_a_rate_is_required_and_named(sharegpt_json):
    with pytest.raises(ValueError, match="no timestamps: give a request rate"):
        load_requests(sharegpt_json)
    with pytest.raises(ValueError, match="request rate > 0"):
        load_requests(sharegpt_json, drawn=DrawnArrivals(rate=0.0))


def test_json_lines_of_conversations_read_the_same(tmp_path, sharegpt_json):
    lines = tmp_path / "sharegpt.jsonl"
    lines.write_text("\n".join(json.dumps(c) for c in CONVERSATIONS) + "\n")
    assert detect_format(lines) == detect_format(sharegpt_json) == "sharegpt"
    drawn = DrawnArrivals(rate=4.0)
    assert load_requests(lines, drawn=drawn) == load_requests(sharegpt_json, drawn=drawn)
    # A Mooncake JSONL file is still Mooncake.
    mooncake = tmp_path / "trace.jsonl"
    mooncake.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": []}\n')
    assert detect_format(mooncake) == "mooncake"


def test_arrivals_are_poisson_at_the_rate_and_burstier_below_shape_one():
    import random

    poisson = arrivals(20000, 50.0, 1.0, random.Random(1))
    gaps = [b - a for a, b in zip(poisson, poisson[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(1 / 50.0, rel=0.03)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.05)
    bursty = arrivals(20000, 50.0, 0.25, random.Random(1))
    b_gaps = [b - a for a, b in zip(bursty, bursty[1:], strict=False)]
    assert statistics.mean(b_gaps) == pytest.approx(1 / 50.0, rel=0.05)
    assert statistics.stdev(b_gaps) / statistics.mean(b_gaps) == pytest.approx(2.0, abs=0.15)


def test_the_seed_picks_the_sample_order_and_the_arrivals():
    convs = [_conversation(i, "p" * (4 * (i + 1)), "r" * 4) for i in range(50)]
    text = [json.dumps(convs)]
    one = sharegpt_requests(text, "x", 10.0, seed=1)
    assert one == sharegpt_requests(text, "x", 10.0, seed=1)
    other = sharegpt_requests(text, "x", 10.0, seed=2)
    assert [r[1] for r in one] != [r[1] for r in other]
    assert sorted(r[1] for r in one) == sorted(r[1] for r in other) == list(range(1, 51))


def test_max_model_len_drops_the_pairs_that_do_not_fit():
    convs = [_conversation(0, "p" * 40, "r" * 40), _conversation(1, "p" * 400, "r" * 40)]
    kept = sharegpt_requests([json.dumps(convs)], "x", 1.0, max_model_len=50)
    assert [(p, o, ids) for _, p, o, ids in kept] == [(10, 10, ())]
    with pytest.raises(ValueError, match="fits max_model_len 5"):
        sharegpt_requests([json.dumps(convs)], "x", 1.0, max_model_len=5)


def test_a_tokenizer_counts_the_tokens(make_tiny_model, tmp_path):
    from engine.model_info import load_tokenizer

    model = make_tiny_model()
    tok = load_tokenizer(model, required=True)
    prompt, reply = "the quick brown fox jumps over the lazy dog " * 3, "a reply"
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([_conversation(0, prompt, reply)]))
    (r,) = load_requests(path, drawn=DrawnArrivals(rate=1.0, tokenizer=str(model)))
    assert r.prompt_len == len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert r.output_len == len(tok(reply, add_special_tokens=False)["input_ids"])


def test_bad_json_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[{"id": "a", "conversations": [')
    with pytest.raises(ValueError, match="broken.json: not a JSON array"):
        load_requests(path, drawn=DrawnArrivals(rate=1.0))
    empty = tmp_path / "none.json"
    empty.write_text(json.dumps([CONVERSATIONS[1], CONVERSATIONS[2]]))
    with pytest.raises(ValueError, match="no conversation with a human turn and a reply"):
        load_requests(empty, drawn=DrawnArrivals(rate=1.0))


def test_tandem_simulate_draws_a_sharegpt_trace_at_the_rate_given(tmp_path, capsys):
    from sim_fakes import make_profile

    convs = [
        _conversation(i, "w" * (40 + 8 * (i % 30)), "v" * (20 + 4 * (i % 25))) for i in range(300)
    ]
    trace = tmp_path / "sg.json"
    trace.write_text(json.dumps(convs))
    profile = str(make_profile(max_num_seqs=32, startup_s=5.0).save(tmp_path / "profile.json"))
    out = tmp_path / "out"
    argv = ["simulate", "--trace", str(trace), "--profile", profile, "--out", str(out)]
    argv += ["--quiet", "--policy", "static:1:2", "--request-rate", "5"]
    assert main(argv) == 0
    summary = json.loads((out / "simulation.json").read_text())["summary"]
    assert summary["requests"] == 300 and summary["finished"] == 300
    assert 300 / 5 * 0.8 < summary["end_s"] < 300 / 5 * 1.3  # the drawn arrivals span ~60 s
    assert main(argv[:-2]) == 2  # no --request-rate: a clear error, not a crash
    assert "--request-rate" in capsys.readouterr().err


def _chat(i: int, *messages: str) -> dict:
    roles = ("human", "gpt")
    turns = [{"from": roles[k % 2], "value": m} for k, m in enumerate(messages)]
    return {"id": f"s{i}", "conversations": turns}


def test_all_turns_make_a_session_whose_prompts_resend_the_conversation_so_far():
    # Two sessions of three exchanges; 4 bytes a token, 512-token blocks.
    a = _chat(0, "h" * 2400, "g" * 1600, "h" * 800, "g" * 2000, "h" * 400, "g" * 40)
    b = _chat(1, "x" * 4000, "y" * 400, "x" * 40, "y" * 40, "x" * 40, "y" * 40)
    reqs = sharegpt_requests([json.dumps([a, b])], "x", 2.0, turns="all", block_tokens=512)
    first = [r for r in reqs if r[1] in (600, 1200, 1800)]
    second = [r for r in reqs if r[1] in (1000, 1110, 1130)]
    # Turn k's prompt: every message before its human turn, plus the turn.
    assert [(p, o) for _, p, o, _ in first] == [(600, 400), (1200, 500), (1800, 10)]
    assert [(p, o) for _, p, o, _ in second] == [(1000, 100), (1110, 10), (1130, 10)]
    assert first[0][0] < first[1][0] < first[2][0]  # turns follow each other in time
    ids = [r[3] for r in first]
    # 600 tokens: one complete block and a partial one; the next prompt (1200) starts with
    # it, so its first block is shared and its second (now complete) is new.
    assert [len(x) for x in ids] == [2, 3, 4]
    assert ids[1][0] == ids[0][0] and ids[1][1] != ids[0][1]
    assert ids[2][:2] == ids[1][:2] and ids[2][2] != ids[1][2]
    # No block id is shared across sessions.
    assert not {i for r in second for i in r[3]} & {i for x in ids for i in x}


def test_sessions_keep_the_request_rate_and_a_turn_over_max_model_len_ends_one():
    convs = [_chat(i, *(["m" * 400] * 8)) for i in range(400)]  # 4 exchanges each
    reqs = sharegpt_requests([json.dumps(convs)], "x", 8.0, turns="all", think_time_s=1.0)
    span = max(r[0] for r in reqs)
    assert len(reqs) == 1600 and 1600 / span == pytest.approx(8.0, rel=0.15)
    # Prompts of 100, 300, 500, 700 tokens with 100-token answers: a 650-token context
    # keeps the first three turns of each session.
    capped = sharegpt_requests([json.dumps(convs)], "x", 8.0, turns="all", max_model_len=650)
    assert sorted({r[1] for r in capped}) == [100, 300, 500] and len(capped) == 1200
    with pytest.raises(ValueError, match="turns must be one of"):
        sharegpt_requests([json.dumps(convs)], "x", 8.0, turns="some")


def test_the_simulators_prefix_caches_hit_a_sessions_resent_turns(tmp_path):
    from sim_fakes import FixedPolicy, make_profile

    from cluster.simulator.run import SimConfig, simulate

    class RecordingPolicy(FixedPolicy):
        def __init__(self, **sizes: int) -> None:
            super().__init__(**sizes)
            self.windows = []

        def decide(self, now, window, pools):
            self.windows.append(window)
            return super().decide(now, window, pools)

    convs = [_chat(i, *(["w" * 2400] * 12)) for i in range(60)]  # 6 exchanges each
    trace = tmp_path / "sg.json"
    trace.write_text(json.dumps(convs))
    profile = make_profile(max_num_seqs=32, startup_s=5.0)
    uncached, promised = {}, 0.0
    for turns in ("first", "all"):
        reqs = load_requests(trace, drawn=DrawnArrivals(2.0, turns=turns, think_time_s=5.0))
        policy = RecordingPolicy(prefill=1, decode=1)
        simulate(reqs, profile, policy, SimConfig(slo_ttft_s=5.0, slo_tpot_s=1.0))
        seen = [w for w in policy.windows if w.prompt_lengths.total]
        uncached[turns] = sum(w.uncached_prompt_tokens for w in seen) / sum(
            w.prompt_lengths.total for w in seen
        )
        if turns == "all":  # what the block ids promise one worker's cache: every block
            known: set[int] = set()  # seen before, up to all but the prompt's last token
            for r in reqs:
                promised += min(512 * sum(i in known for i in r.hash_ids), r.prompt_len - 1)
                known.update(r.hash_ids)
            promised /= sum(r.prompt_len for r in reqs)
    # One turn per conversation: nothing to reuse. Six turns, each resending the last: the
    # one prefill worker's cache hits every block an earlier turn completed.
    assert uncached["first"] == 1.0
    assert promised > 0.5 and uncached["all"] == pytest.approx(1 - promised, abs=0.01)


def test_the_drawn_arrival_settings_are_refused_for_a_trace_that_has_its_own(tmp_path):
    csv = tmp_path / "azure.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,10,2\n2.0,20,3\n")
    assert len(load_requests(csv, drawn=DrawnArrivals())) == 2  # the defaults: nothing asked
    with pytest.raises(ValueError, match="are for ShareGPT"):
        load_requests(csv, drawn=DrawnArrivals(rate=5.0))
    with pytest.raises(ValueError, match="are for ShareGPT"):
        load_requests(csv, drawn=DrawnArrivals(turns="all"))
