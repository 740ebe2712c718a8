"""ShareGPT conversations as benchmark requests, read as vLLM's benchmarks read them.

The file is a JSON list of `{"conversations": [{"from": "human" | "gpt", "value": str}, ...]}`
(e.g. ShareGPT_V3_unfiltered_cleaned_split.json). From each conversation with at least two
turns, the first human turn is the prompt and the gpt turn right after it is the reply; the
reply's token count is the request's output length (max_tokens), unless a fixed output length
is given. Conversations without such a pair, or with a value that is not a string, are skipped.

Like vLLM (`ShareGPTDataset`): the conversations are shuffled with the seed, then taken in that
order, counting tokens with the model's tokenizer (special tokens included, as
`tokenizer(text).input_ids` counts them) until enough valid ones are found. A pair is valid when
the prompt and (unless fixed) the reply have at least 4 tokens, the prompt at most 1024 and
both together at most 2048. Unlike vLLM, a file with fewer valid pairs than asked for is not
oversampled: the run sends what there is.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048

TokenCounter = Callable[[str], int]


@dataclass(frozen=True, slots=True)
class ShareGPTRequest:
    prompt: str
    prompt_len: int  # tokens, by the tokenizer given
    output_len: int  # the reply's tokens, or the fixed output length


def first_exchange(entry: Any) -> tuple[str, str] | None:
    """(prompt, reply) of one ShareGPT entry: the first human turn and the gpt turn after it;
    None when the entry has fewer than two turns or no such pair."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    for turn, following in zip(turns, turns[1:], strict=False):
        if not (isinstance(turn, dict) and turn.get("from") == "human"):
            continue
        if not (isinstance(following, dict) and following.get("from") == "gpt"):
            return None  # the first question went unanswered: not a request/reply pair
        prompt, reply = turn.get("value"), following.get("value")
        if isinstance(prompt, str) and isinstance(reply, str):
            return prompt, reply
        return None
    return None


def is_valid_lengths(prompt_len: int, output_len: int, *, fixed_output: bool = False) -> bool:
    """vLLM's `is_valid_sequence` with its defaults (see the module docstring)."""
    if prompt_len < MIN_LEN or (not fixed_output and output_len < MIN_LEN):
        return False
    return prompt_len <= MAX_PROMPT_LEN and prompt_len + output_len <= MAX_TOTAL_LEN


def load_sharegpt(
    path: str | Path,
    count_tokens: TokenCounter,
    *,
    num_requests: int,
    seed: int = 0,
    fixed_output_len: int | None = None,
) -> list[ShareGPTRequest]:
    """Up to `num_requests` valid requests from a ShareGPT JSON file (see the module docstring)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if fixed_output_len is not None and fixed_output_len < 1:
        raise ValueError(f"fixed_output_len must be >= 1, got {fixed_output_len}")
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    pairs = [p for p in map(first_exchange, data) if p is not None]
    random.Random(seed).shuffle(pairs)
    out: list[ShareGPTRequest] = []
    for prompt, reply in pairs:
        if len(out) >= num_requests:
            break
        prompt_len = count_tokens(prompt)
        output_len = count_tokens(reply) if fixed_output_len is None else fixed_output_len
        if is_valid_lengths(prompt_len, output_len, fixed_output=fixed_output_len is not None):
            out.append(ShareGPTRequest(prompt, prompt_len, output_len))
    if not out:
        raise ValueError(
            f"{path}: no conversation with a human turn answered by a gpt turn within the "
            f"length limits (prompt {MIN_LEN}..{MAX_PROMPT_LEN} tokens, reply >= {MIN_LEN}, "
            f"both <= {MAX_TOTAL_LEN})"
        )
    return out


def hf_token_counter(name: str) -> TokenCounter:
    """Token counts by a Hugging Face tokenizer (a directory or a hub id), special tokens
    included as vLLM counts them. transformers is imported only when ShareGPT is used."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    return lambda text: len(tokenizer(text).input_ids)
