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
    # Two conversations have a human turn followed by a reply (one after a system turn).
    lengths = sorted((r.prompt_len, r.output_len) for r in requests)
    assert lengths == [(10, 100), (20, 2)]  # 40/80 and 400/8 bytes at 4 bytes a token
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
    assert [p for _, p, _ in one] != [p for _, p, _ in other]
    assert sorted(p for _, p, _ in one) == sorted(p for _, p, _ in other) == list(range(1, 51))


def test_max_model_len_drops_the_pairs_that_do_not_fit():
    convs = [_conversation(0, "p" * 40, "r" * 40), _conversation(1, "p" * 400, "r" * 40)]
    kept = sharegpt_requests([json.dumps(convs)], "x", 1.0, max_model_len=50)
    assert [(p, o) for _, p, o in kept] == [(10, 10)]
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
