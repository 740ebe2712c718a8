"""ShareGPT conversations as a trace: lengths from the conversations, arrivals drawn.

ShareGPT (`ShareGPT_V3_unfiltered_cleaned_split.json`, what `vllm bench serve --dataset-name
sharegpt` and SGLang's `bench_serving` sample) is a JSON array of conversations, `{"id": ...,
"conversations": [{"from": "human" | "gpt", "value": text}, ...]}`; JSON Lines of the same
objects are read too. It has no timestamps, so as those benchmarks do:
- each conversation gives one request: its first human turn (after any message before it,
  a system prompt, which a client sends too) is the prompt, the reply after it the output
  (conversations with no human turn followed by a reply are skipped);
- the conversations are shuffled with the seed (a different sample per seed, as vLLM's
  `random.sample`), and arrivals are drawn from it too: gamma inter-arrival times of mean
  1 / `rate` and shape `burstiness` (vLLM's `--burstiness`: 1 is Poisson, below 1 burstier).

With `turns="all"` a conversation is a session instead, one request per exchange: turn k's
prompt is every message before its human turn plus that turn (what a chat client resends),
so turn k+1's prompt starts with turn k's prompt and reply. Its blocks carry `hash_ids` the
way Mooncake's traces do (equal ids at the same place are equal blocks; a block is shared
once it is complete), so the simulator's prefix caches see the reuse. Sessions start at
`rate` / (mean exchanges per conversation), so requests still come at about `rate`; a turn
follows the one before after an exponential think time of mean `think_time_s` (ShareGPT
records none: an assumption of the replay, like the rate).

Lengths are token counts by `tokenizer` (anything with `__call__(texts)["input_ids"]`, e.g. the
model directory's tokenizer), else an estimate of one token per `BYTES_PER_TOKEN` bytes of
UTF-8 (English text under Llama-class tokenizers; a tokenizer is exact). vLLM's benchmark also
drops prompts over 1024 tokens and pairs over 2048, a limit of the 2k-context models it was
written for; here only `max_model_len` applies (a pair longer than the context is dropped,
and a session ends there; `tandem simulate` keeps every pair).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

BYTES_PER_TOKEN = 4.0
TOKENIZE_BATCH = 1024
REPLIERS = ("gpt", "chatgpt", "bard")  # the `from` of an assistant turn in ShareGPT dumps
TURNS = ("first", "all")


def is_sharegpt(first: str) -> bool:
    """Whether a file's first non-blank text (up to its first line) is ShareGPT's: a JSON
    array, or a JSON object with a `conversations` list."""
    text = first.lstrip()
    if text.startswith("["):
        return True
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("conversations"), list)


def exchanges(conversation: Any) -> list[tuple[list[str], str, str]]:
    """Every (messages before it, human turn, reply) of a conversation, in order: the
    human/assistant messages only, each human turn followed by its reply."""
    turns = conversation.get("conversations") if isinstance(conversation, dict) else None
    if not isinstance(turns, list):
        return []
    texts = [
        (t.get("from"), t.get("value"))
        for t in turns
        if isinstance(t, dict) and isinstance(t.get("value"), str) and t.get("value")
    ]
    out, before = [], []
    for (who, text), (reply_by, reply) in zip(texts, texts[1:], strict=False):
        if who == "human" and reply_by in REPLIERS:
            out.append((list(before), text, reply))
        before.append(text)
    return out


def read_conversations(text: Iterable[str], where: str) -> Iterator[Any]:
    """The conversation objects of a ShareGPT file given as its lines: one JSON array, or one
    object a line. A line that is not JSON is a ValueError naming `where` and the line."""
    lines = iter(text)
    head = ""
    for head in lines:
        if head.strip():
            break
    if head.lstrip().startswith("["):
        try:
            data = json.loads(head + "".join(lines))
        except ValueError as e:
            raise ValueError(f"{where}: not a JSON array of conversations: {e}") from e
        yield from data
        return
    for lineno, line in enumerate([head, *lines], start=1):
        if line.strip():
            try:
                yield json.loads(line)
            except ValueError as e:
                raise ValueError(f"{where}:{lineno}: {e}") from e


def token_counts(texts: list[str], tokenizer: Callable | None) -> list[int]:
    """Tokens of each text (at least 1): by `tokenizer` in batches, else estimated."""
    if tokenizer is None:
        return [max(1, round(len(t.encode("utf-8")) / BYTES_PER_TOKEN)) for t in texts]
    counts: list[int] = []
    for i in range(0, len(texts), TOKENIZE_BATCH):
        ids = tokenizer(texts[i : i + TOKENIZE_BATCH], add_special_tokens=False)["input_ids"]
        counts.extend(max(1, len(x)) for x in ids)
    return counts


def arrivals(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """`n` arrival times from 0: gamma inter-arrivals of mean 1 / rate and shape burstiness."""
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"a ShareGPT trace needs a request rate > 0 req/s, got {rate}")
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


Request = tuple[float, int, int, tuple[int, ...]]  # arrival s, prompt, output, block ids


def sharegpt_requests(
    lines: Iterable[str],
    where: str,
    rate: float,
    *,
    seed: int = 0,
    burstiness: float = 1.0,
    tokenizer: Callable | None = None,
    max_model_len: int | None = None,
    turns: str = "first",
    think_time_s: float = 30.0,
    block_tokens: int = 512,
) -> list[Request]:
    """The requests of a ShareGPT file, in arrival order (see the module doc)."""
    if turns not in TURNS:
        raise ValueError(f"turns must be one of {TURNS}, got {turns!r}")
    conversations = [c for c in map(exchanges, read_conversations(lines, where)) if c]
    if not conversations:
        raise ValueError(f"{where}: no conversation with a human turn and a reply")
    rng = random.Random(seed)
    rng.shuffle(conversations)
    if turns == "first":
        conversations = [c[:1] for c in conversations]
    sessions = _count_sessions(conversations, tokenizer, max_model_len)
    if not sessions:
        raise ValueError(f"{where}: no conversation fits max_model_len {max_model_len}")
    per_session = sum(map(len, sessions)) / len(sessions)
    starts = arrivals(len(sessions), rate / per_session, burstiness, rng)
    if turns == "first":
        return [(t, p, o, ()) for t, ((p, o),) in zip(starts, sessions, strict=True)]
    if not (math.isfinite(think_time_s) and think_time_s >= 0):
        raise ValueError(f"think_time_s must be >= 0, got {think_time_s}")
    blocks = _BlockIds(block_tokens)
    out: list[Request] = []
    for number, (start, session) in enumerate(zip(starts, sessions, strict=True)):
        t = start
        for turn, (prompt, output) in enumerate(session):
            if turn:
                t += rng.expovariate(1 / think_time_s) if think_time_s > 0 else 0.0
            out.append((t, prompt, output, blocks.of(number, prompt)))
    return sorted(out, key=lambda r: r[0])


def _count_sessions(
    conversations: list[list[tuple[list[str], str, str]]],
    tokenizer: Callable | None,
    max_model_len: int | None,
) -> list[list[tuple[int, int]]]:
    """(prompt tokens, output tokens) per exchange of each conversation: the messages before
    a human turn, the turn and its reply counted once each (a turn's prompt is a sum of
    message counts); a session ends at its first exchange over `max_model_len`, and one
    with none left is dropped."""
    texts: dict[str, int] = {}
    for conversation in conversations:
        for before, human, reply in conversation:
            for text in (*before, human, reply):
                texts.setdefault(text, 0)
    order = list(texts)
    texts.update(zip(order, token_counts(order, tokenizer), strict=True))
    sessions = []
    for conversation in conversations:
        session = []
        for before, human, reply in conversation:
            prompt = sum(texts[m] for m in before) + texts[human]
            if max_model_len is not None and prompt + texts[reply] > max_model_len:
                break
            session.append((prompt, texts[reply]))
        if session:
            sessions.append(session)
    return sessions


class _BlockIds:
    """Block ids for a session's prompts: block j of session s has one id once complete (a
    later turn's prompt starts with this one's, so its complete blocks are the same); a
    prompt's partial last block gets an id of its own."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.ids: dict[tuple[int, int], int] = {}
        self.next_id = 0

    def _fresh(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def of(self, session: int, prompt: int) -> tuple[int, ...]:
        ids = []
        for j in range(prompt // self.block_tokens):
            if (session, j) not in self.ids:
                self.ids[session, j] = self._fresh()
            ids.append(self.ids[session, j])
        if prompt % self.block_tokens:
            ids.append(self._fresh())
        return tuple(ids)


def load_tokenizer_for(model: str | Path | None) -> Callable | None:
    """The tokenizer of a model directory (or GGUF file), or None for the byte estimate."""
    if model is None:
        return None
    from engine.model_info import load_tokenizer

    return load_tokenizer(model, required=True)
