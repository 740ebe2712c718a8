"""The conversations benchmarks/multiturn.py replays, as token prompts, from three sources:

- a Mooncake JSONL trace (`hash_ids`: one id per 512-token block, equal ids = equal blocks):
  requests are grouped into conversations by their first two hash ids (the trace's shared
  system block and the conversation's first block), each group's requests are its turns in
  trace order, and every hash id becomes `tokens_per_hash` seeded token ids (the same id, the
  same tokens, in every prompt), so prompts share exactly the prefixes the trace's do; the
  last block is cut to the trace's input length scaled by tokens_per_hash / 512; requests of
  more than `max_blocks` blocks are left out (a short run keeps short prompts);
- a ShareGPT-style JSON list of `{"conversations": [{"from": "human"|"gpt", "value": ...}]}`
  with several exchanges: turn k's prompt is every message before the k-th reply, tokenized
  with the model's tokenizer (the recorded replies stand in for the model's own);
- the seeded synthetic chats of benchmarks/conversations.py: turn k's prompt is turn k-1's, a
  seeded stand-in answer of --answer-tokens ids and the new user message.

Each turn is `(prompt token ids, max_tokens)`. Every configuration of a run sends the same
prompts (the answers a server gives never feed back into the next prompt), so what changes
between configurations is what is cached where, not what is asked.

`ideal_computed(convs, block_size)`: the prompt tokens no cache held, i.e. what an unbounded
cache shared by every worker would still compute, replaying turns round by round: per prompt,
its tokens past the longest run of leading full blocks some earlier prompt had, never less
than the last token's block (an engine always computes the block of the prompt's last token).
"""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path

from engine.kv_events import prefix_block_hashes

Turn = tuple[list[int], int]  # (prompt token ids, max_tokens)
MOONCAKE_BLOCK = 512


def mooncake_conversations(
    path: Path, *, tokens_per_hash: int, max_blocks: int, conversations: int, turns: int,
    answer_tokens: int, vocab: int, seed: int = 0,
) -> list[list[Turn]]:  # fmt: skip
    """The first `conversations` groups (by first appearance) with two or more requests."""
    from cluster.simulator.traces import open_text

    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    with open_text(Path(path)) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                if len(row["hash_ids"]) <= max_blocks:  # longer turns: left out, not cut
                    groups[tuple(row["hash_ids"][:2])].append(row)
    chosen = [rows for rows in groups.values() if len(rows) >= 2][:conversations]
    block_cache: dict[int, list[int]] = {}

    def block(h: int) -> list[int]:
        if h not in block_cache:
            rng = random.Random(seed * 1_000_003 + h)
            block_cache[h] = [rng.randrange(10, vocab) for _ in range(tokens_per_hash)]
        return block_cache[h]

    out = []
    for rows in chosen:
        conv = []
        for row in rows[:turns]:
            ids = row["hash_ids"]
            full = len(ids) * tokens_per_hash
            scaled = -(-row["input_length"] * tokens_per_hash // MOONCAKE_BLOCK)
            n = min(full, max(full - tokens_per_hash + 1, scaled))
            prompt = [t for h in ids for t in block(h)][:n]
            conv.append((prompt, max(1, min(int(row["output_length"]), answer_tokens))))
        out.append(conv)
    return out


def sharegpt_conversations(
    path: Path, tokenizer, *, conversations: int, turns: int, answer_tokens: int,
    max_message_tokens: int,
) -> list[list[Turn]]:  # fmt: skip
    """Conversations with at least two human->gpt exchanges, in file order."""
    out = []
    for entry in json.loads(Path(path).read_text()):
        msgs = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(msgs, list):
            continue
        history: list[int] = []
        conv: list[Turn] = []
        for prev, msg in zip(msgs, msgs[1:], strict=False):
            if not all(
                isinstance(m, dict) and isinstance(m.get("value"), str) for m in (prev, msg)
            ):
                break
            if prev.get("from") != "human" or msg.get("from") != "gpt":
                continue
            user = tokenizer.encode(prev["value"], add_special_tokens=False)[:max_message_tokens]
            reply = tokenizer.encode(msg["value"], add_special_tokens=False)[:max_message_tokens]
            if not user or not reply:
                break
            history = history + user
            conv.append((list(history), max(1, min(len(reply), answer_tokens))))
            history = history + reply
            if len(conv) == turns:
                break
        if len(conv) >= 2:
            out.append(conv)
        if len(out) == conversations:
            break
    return out


def synthetic_conversations(args, rng: random.Random, vocab: int) -> list[list[Turn]]:
    """benchmarks/conversations.py's chats, a seeded stand-in answer between turns."""
    from benchmarks.conversations import conversation_turns

    out = []
    for parts in conversation_turns(args, rng, vocab):
        prompt, conv = list(parts[0]), []
        for k, new in enumerate(parts):
            if k:
                answer = [rng.randrange(10, vocab) for _ in range(args.answer_tokens)]
                prompt = prompt + answer + new
            conv.append((list(prompt), args.answer_tokens))
        out.append(conv)
    return out


def rounds(convs: list[list[Turn]]):
    """(conversation, turn index, turn) round by round: every first turn, then every second."""
    for k in range(max((len(c) for c in convs), default=0)):
        for i, conv in enumerate(convs):
            if k < len(conv):
                yield i, k, conv[k]


def ideal_computed(convs: list[list[Turn]], block_size: int) -> int:
    """Prompt tokens no cache held (see the module docstring)."""
    seen: set[int] = set()
    total = 0
    for _, _, (prompt, _) in rounds(convs):
        hashes = prefix_block_hashes(prompt, block_size, len(prompt) // block_size)
        hit = 0
        while hit < len(hashes) and hashes[hit] in seen:
            hit += 1
        cached = min(hit * block_size, (len(prompt) - 1) // block_size * block_size)
        total += len(prompt) - cached
        seen.update(hashes)
    return total


def workload_summary(convs: list[list[Turn]], block_size: int) -> dict:
    prompt_tokens = sum(len(p) for _, _, (p, _) in rounds(convs))
    ideal = ideal_computed(convs, block_size)
    return {
        "conversations": len(convs),
        "requests": sum(len(c) for c in convs),
        "prompt_tokens": prompt_tokens,
        "tokens_no_cache_held": ideal,
        "reuse_ratio": round(1 - ideal / max(1, prompt_tokens), 4),
    }
