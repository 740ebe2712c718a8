"""benchmarks/interop_aiperf.py's verdict on an aiperf summary (aiperf itself runs from its own
venv, outside `make test`: its pins clash with the project's). A run passes only with every
request counted, none failed, and, where the server's usage is read, every answer of the
length asked for; the Responses run (counted by aiperf's tokenizer) need only count them all."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.interop_aiperf import judge

ARGS = SimpleNamespace(requests=32, output_tokens=16)


def _summary(count=32, errors=None, osl=(16, 16), osl_count=32, cached=None) -> dict:
    out = {
        "request_count": {"avg": count},
        "output_sequence_length": {"min": osl[0], "max": osl[1], "count": osl_count},
        "input_sequence_length": {"min": 64, "max": 64, "count": osl_count},
        "time_to_first_token": {"p50": 12.0},
        "request_throughput": {"avg": 50.0},
    }
    if errors is not None:
        out["error_request_count"] = {"avg": errors}
    if cached is not None:
        out["overall_usage_prompt_cache_read_pct"] = {"avg": cached}
    return out


def test_a_clean_run_passes():
    row = judge("chat", _summary(), ARGS)
    assert row["ok"] and row["errors"] == 0 and row["output_tokens"] == [16, 16]


def test_errors_short_answers_or_missing_counts_fail():
    assert not judge("chat", _summary(errors=1), ARGS)["ok"]
    assert not judge("completions", _summary(osl=(9, 16)), ARGS)["ok"]  # EOS not ignored
    assert not judge("chat", _summary(count=31), ARGS)["ok"]
    assert not judge("responses", _summary(osl=(None, None), osl_count=None), ARGS)["ok"]


def test_responses_lengths_are_the_tokenizers_and_not_held_exact():
    row = judge("responses", _summary(osl=(16, 22)), ARGS)
    assert row["ok"] and not row["exact_output_length"]
    assert not judge("chat", _summary(osl=(16, 22)), ARGS)["ok"]


def test_the_multiturn_run_counts_its_conversations_and_needs_cache_reads():
    turns = dict(count=24, osl_count=24)
    assert judge("chat-multiturn", _summary(**turns, cached=49.0), ARGS)["ok"]
    assert not judge("chat-multiturn", _summary(**turns, cached=0.0), ARGS)["ok"]
    assert not judge("chat-multiturn", _summary(cached=49.0), ARGS)["ok"]  # 32: not 8 x 3
