"""The seeded multi-turn conversations the KV-reuse benchmarks replay (kv_reuse.py,
kv_host_tier.py, multiturn.py): their flags, the model they load and the turns themselves.

A conversation is an opening prompt and, per later turn, a new user message, all random token
ids in [10, vocab) from one seeded generator, so every run of a benchmark (and each of its
configurations) sends the same tokens. Each turn's prompt is the previous prompt, the answer to
it and the new message; who supplies the answer (the engine's real one, or a stand-in of the
same length) is the benchmark's choice.
"""

from __future__ import annotations

import argparse
import random


def add_conversation_flags(ap: argparse.ArgumentParser, **defaults: int) -> None:
    """--model, --conversations, --turns, --first-tokens, --user-tokens, --answer-tokens,
    --seed (a benchmark may change a default by keyword, e.g. conversations=4)."""
    d = {"conversations": 8, "turns": 4, "first_tokens": 300, "user_tokens": 40}
    d |= {"answer_tokens": 24, "seed": 0, **defaults}
    ap.add_argument("--model", default="smollm2", help="a model folder or .gguf; smollm2: fetched")
    ap.add_argument("--conversations", type=int, default=d["conversations"])
    ap.add_argument("--turns", type=int, default=d["turns"])
    ap.add_argument("--first-tokens", type=int, default=d["first_tokens"])
    ap.add_argument("--user-tokens", type=int, default=d["user_tokens"])
    ap.add_argument("--answer-tokens", type=int, default=d["answer_tokens"])
    ap.add_argument("--seed", type=int, default=d["seed"])


def resolve_model(args: argparse.Namespace) -> int:
    """Fetch the model when it is named `smollm2` (args.model becomes its path); returns its
    vocabulary size."""
    if args.model == "smollm2":
        from tools.real_model import fetch_model

        args.model = str(fetch_model("smollm2"))
    from engine.model_info import load_hf_config

    return load_hf_config(args.model).vocab_size


def conversation_turns(args, rng: random.Random, vocab: int) -> list[list[list[int]]]:
    """Per conversation, per turn: the new user tokens (the first turn: the opening prompt)."""

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    return [
        [toks(args.first_tokens)] + [toks(args.user_tokens) for _ in range(args.turns - 1)]
        for _ in range(args.conversations)
    ]


def load_conversations(args) -> list[list[list[int]]]:
    """resolve_model + conversation_turns with the flags' seed."""
    return conversation_turns(args, random.Random(args.seed), resolve_model(args))
