"""ShareGPT conversations as a trace: lengths from the conversations, arrivals drawn.

ShareGPT (`ShareGPT_V3_unfiltered_cleaned_split.json`, what `vllm bench serve --dataset-name
sharegpt` and SGLang's `bench_serving` sample) is a JSON array of conversations, `{"id": ...,
"conversations": [{"from": "human" | "gpt", "value": text}, ...]}`; JSON Lines of the same
objects are read too. It has no timestamps, so as those benchmarks do:
- each conversation gives one request: its first human turn is the prompt, the reply after it
  the output (conversations with no human turn followed by a reply are skipped);
- the conversations are shuffled with the seed (a different sample per seed, as vLLM's
  `random.sample`), and arrivals are drawn from it too: gamma inter-arrival times of mean
  1 / `rate` and shape `burstiness` (vLLM's `--burstiness`: 1 is Poisson, below 1 burstier).

Lengths are token counts by `tokenizer` (anything with `__call__(texts)["input_ids"]`, e.g. the
model directory's tokenizer), else an estimate of one token per `BYTES_PER_TOKEN` bytes of
UTF-8 (English text under Llama-class tokenizers; a tokenizer is exact). vLLM's benchmark also
drops prompts over 1024 tokens and pairs over 2048, a limit of the 2k-context models it was
written for; here only `max_model_len` (a pair longer than the context is dropped, none by
default) applies.
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


def first_exchange(conversation: Any) -> tuple[str, str] | None:
    """(the first human turn, the reply after it), or None when the conversation has none."""
    turns = conversation.get("conversations") if isinstance(conversation, dict) else None
    if not isinstance(turns, list):
        return None
    for turn, reply in zip(turns, turns[1:], strict=False):
        if not (isinstance(turn, dict) and isinstance(reply, dict)):
            continue
        if turn.get("from") == "human" and reply.get("from") in ("gpt", "chatgpt", "bard"):
            prompt, answer = turn.get("value"), reply.get("value")
            if isinstance(prompt, str) and isinstance(answer, str) and prompt and answer:
                return prompt, answer
    return None


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


def sharegpt_requests(
    lines: Iterable[str],
    where: str,
    rate: float,
    *,
    seed: int = 0,
    burstiness: float = 1.0,
    tokenizer: Callable | None = None,
    max_model_len: int | None = None,
) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens, output tokens) per usable conversation, in arrival order."""
    pairs = [p for p in map(first_exchange, read_conversations(lines, where)) if p is not None]
    if not pairs:
        raise ValueError(f"{where}: no conversation with a human turn and a reply")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    prompts = token_counts([p for p, _ in pairs], tokenizer)
    outputs = token_counts([a for _, a in pairs], tokenizer)
    kept = [
        (p, o) for p, o in zip(prompts, outputs, strict=True)
        if max_model_len is None or p + o <= max_model_len
    ]  # fmt: skip
    if not kept:
        raise ValueError(f"{where}: no conversation fits max_model_len {max_model_len}")
    times = arrivals(len(kept), rate, burstiness, rng)
    return [(t, p, o) for t, (p, o) in zip(times, kept, strict=True)]


def load_tokenizer_for(model: str | Path | None) -> Callable | None:
    """The tokenizer of a model directory (or GGUF file), or None for the byte estimate."""
    if model is None:
        return None
    from engine.model_info import load_tokenizer

    return load_tokenizer(model, required=True)
