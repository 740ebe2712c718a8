"""The ShareGPT dataset: which conversations become requests, their lengths (vLLM's filters),
the seeded order, the workload built from them, and a run through the CLI against the stub
server with a real (tiny, local) Hugging Face tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bench_serve_e2e import Plan, StubServer

from bench.config import CHAT, BenchConfig
from bench.sharegpt import first_exchange, hf_token_counter, load_sharegpt
from bench.workload import build_workload
from cluster import cli


def words(n: int, word: str = "the") -> str:
    return " ".join([word] * n)


def count_words(text: str) -> int:
    return len(text.split())


def human(text: str) -> dict:
    return {"from": "human", "value": text}


def gpt(text: str) -> dict:
    return {"from": "gpt", "value": text}


# name -> conversation; the names say what the reader must do with each.
CONVERSATIONS = {
    "valid": [human(words(5, "a")), gpt(words(6)), human(words(9)), gpt(words(9))],
    "one-turn": [human(words(8, "b"))],
    "gpt-first": [gpt(words(7)), human(words(7, "c")), gpt(words(8))],
    "unanswered": [human(words(8, "d")), human(words(8)), gpt(words(8))],
    "prompt-too-short": [human(words(3, "e")), gpt(words(8))],
    "prompt-too-long": [human(words(1025, "f")), gpt(words(8))],
    "too-long-together": [human(words(1000, "g")), gpt(words(1049))],
    "reply-too-short": [human(words(8, "h")), gpt(words(3))],
    "not-text": [human(words(8, "i")), {"from": "gpt", "value": None}],
    "edge": [human(words(4, "j")), gpt(words(4))],  # 4 tokens each: the inclusive minimum
}


@pytest.fixture
def sharegpt_file(tmp_path: Path) -> Path:
    path = tmp_path / "sharegpt.json"
    entries = [{"id": name, "conversations": turns} for name, turns in CONVERSATIONS.items()]
    entries.append({"id": "no-conversations"})
    path.write_text(json.dumps(entries))
    return path


def first_words(requests) -> set[str]:
    return {r.prompt.split()[0] for r in requests}


def test_first_exchange():
    assert first_exchange({"conversations": CONVERSATIONS["valid"]}) == (words(5, "a"), words(6))
    assert first_exchange({"conversations": CONVERSATIONS["gpt-first"]}) == (
        words(7, "c"),
        words(8),
    )
    for name in ("one-turn", "unanswered", "not-text"):
        assert first_exchange({"conversations": CONVERSATIONS[name]}) is None, name
    assert first_exchange({"id": 1}) is None and first_exchange([1, 2]) is None


def test_filters_lengths_as_vllm(sharegpt_file: Path):
    requests = load_sharegpt(sharegpt_file, count_words, num_requests=100)
    assert first_words(requests) == {"a", "c", "j"}
    by_word = {r.prompt.split()[0]: r for r in requests}
    assert (by_word["a"].prompt_len, by_word["a"].output_len) == (5, 6)
    assert (by_word["c"].prompt_len, by_word["c"].output_len) == (7, 8)
    assert (by_word["j"].prompt_len, by_word["j"].output_len) == (4, 4)
    assert by_word["a"].prompt == words(5, "a")  # the text itself is the prompt


def test_fixed_output_len_skips_the_reply_checks(sharegpt_file: Path):
    requests = load_sharegpt(sharegpt_file, count_words, num_requests=100, fixed_output_len=3)
    # The short reply no longer matters, and 1000 + 3 tokens fit in 2048.
    assert first_words(requests) == {"a", "c", "j", "h", "g"}
    assert {r.output_len for r in requests} == {3}


def test_seeded_order_and_count(sharegpt_file: Path):
    def order(seed: int, n: int = 100) -> list[str]:
        got = load_sharegpt(sharegpt_file, count_words, num_requests=n, seed=seed)
        return [r.prompt.split()[0] for r in got]

    assert order(0) == order(0)
    assert {tuple(order(s)) for s in range(10)} != {tuple(order(0))}  # the seed shuffles
    assert len(order(3, n=2)) == 2 and order(3, n=2) == order(3)[:2]


def test_bad_files(tmp_path: Path):
    bad = tmp_path / "bad.json"
    for text, message in (
        ("{", "not JSON"),
        ('{"conversations": []}', "JSON list"),
        (json.dumps([{"conversations": CONVERSATIONS["one-turn"]}]), "no conversation"),
    ):
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_sharegpt(bad, count_words, num_requests=1)
    with pytest.raises(FileNotFoundError):
        load_sharegpt(tmp_path / "missing.json", count_words, num_requests=1)


def test_workload_from_sharegpt(sharegpt_file: Path):
    cfg = BenchConfig(dataset=f"sharegpt:{sharegpt_file}", request_rate=5.0, seed=2)
    w = build_workload(cfg, count_tokens=count_words)
    assert len(w.requests) == 3 and w.trace is None
    assert [r.index for r in w.requests] == [0, 1, 2]
    assert w.requests[0].arrival_s == 0.0 and w.requests[1].arrival_s > 0
    for r in w.requests:
        assert isinstance(r.prompt, str) and r.prompt_len == count_words(r.prompt)
    # The same text on the chat endpoint; the seed reproduces the run.
    chat = build_workload(
        BenchConfig(dataset=cfg.dataset, request_rate=5.0, seed=2, endpoint=CHAT),
        count_tokens=count_words,
    )
    assert chat.requests == w.requests
    one = build_workload(
        BenchConfig(dataset=cfg.dataset, num_prompts=1, sharegpt_output_len=7),
        count_tokens=count_words,
    )
    assert len(one.requests) == 1 and one.requests[0].output_len == 7


def test_sharegpt_needs_a_tokenizer_name(sharegpt_file: Path):
    cfg = BenchConfig(dataset=f"sharegpt:{sharegpt_file}")
    with pytest.raises(ValueError, match="--tokenizer"):
        build_workload(cfg)
    for bad in ("sharegpt:", "sharegpt"):
        with pytest.raises(ValueError):
            BenchConfig(dataset=bad)
    with pytest.raises(ValueError):
        BenchConfig(dataset=cfg.dataset, sharegpt_output_len=0)


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    """A word-level Hugging Face tokenizer saved to a directory, as AutoTokenizer reads one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "the": 1, "a": 2, "c": 3, "j": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(out)
    return out


def test_cli_runs_sharegpt_with_a_local_tokenizer(
    sharegpt_file: Path, tokenizer_dir: Path, tmp_path: Path, capsys
):
    assert hf_token_counter(str(tokenizer_dir))("the a zebra") == 3
    out = tmp_path / "out.json"
    plan = Plan(ttft_s=0.01, chunk_gap_s=0.002, send_usage=False)
    with StubServer(plan) as server:
        rc = cli.main(
            ["bench", "serve", "--base-url", server.url, "--dataset", f"sharegpt:{sharegpt_file}"]
            + ["--tokenizer", str(tokenizer_dir), "--no-progress", "--result-json", str(out)]
        )
    assert rc == 0
    sent = {b["prompt"].split()[0]: b["max_tokens"] for b in plan.payloads}
    assert sent == {"a": 6, "c": 8, "j": 4}  # each reply's token count
    data = json.loads(out.read_text())
    assert data["completed"] == 3 and data["dataset"] == f"sharegpt:{sharegpt_file}"
    assert data["sharegpt"]["tokenizer"] == str(tokenizer_dir)
    assert data["total_input_tokens"] == 5 + 7 + 4 and data["total_output_tokens"] == 18
    assert "Dataset:" in (report := capsys.readouterr().out) and "sharegpt" in report
