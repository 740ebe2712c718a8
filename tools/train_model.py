"""Train a `tandem make-model` checkpoint briefly on the embedded corpus.

Random weights give near-flat next-token distributions: greedy decoding then flips between
near-ties at the slightest numerical change, so "does quantization keep greedy agreement?"
measures noise, and demo output is gibberish. A few hundred steps on `ENGLISH_TEXT` (about
1.8k tokens with the tiny tokenizer) make the model memorise it: its distributions become
peaked like a trained model's and greedy decoding from a corpus prefix prints readable text.

Recipe: AdamW (lr 3e-3, no weight decay) with a cosine schedule to 0, batches of random
windows of the tokenized corpus, the Hugging Face model's own shifted cross-entropy loss, fp32.
Seeded throughout (`torch.manual_seed` and a separate generator for the windows), so the
same checkpoint and settings give the same batches and, on one machine, the same weights.

Only `model.safetensors` is replaced (atomically) and `training.json` written beside it: the
config.json that make-model patched and the tokenizer files stay exactly as they were.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import tempfile
import time
from typing import Any

TRAINING_JSON = "training.json"


def corpus_token_ids(tokenizer: Any) -> list[int]:
    """`ENGLISH_TEXT` as token ids, no special tokens added.

    `verbose=False` because the corpus is longer than the tiny preset's context: training
    only ever feeds short windows of it, so transformers' length warning would be noise."""
    from tools.tokenizer_corpus import ENGLISH_TEXT

    return list(tokenizer(ENGLISH_TEXT, add_special_tokens=False, verbose=False)["input_ids"])


def sample_windows(tokens: Any, seq_len: int, batch_size: int, generator: Any) -> Any:
    """A (batch_size, seq_len + 1) tensor of random contiguous windows of `tokens`.

    Each window is seq_len + 1 tokens so the model, which shifts labels itself, predicts
    seq_len of them. Starts come from `generator` only, so the batches are reproducible."""
    import torch

    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be positive, got {seq_len}, {batch_size}")
    n = len(tokens)
    if n < seq_len + 1:
        raise ValueError(
            f"the corpus has {n} tokens, fewer than seq_len + 1 = {seq_len + 1}: "
            f"use a smaller seq_len"
        )
    starts = torch.randint(0, n - seq_len, (batch_size,), generator=generator)
    return torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])


def _cosine_lr(step: int, steps: int, lr: float) -> float:
    """The learning rate for 0-based `step`: cosine from `lr` down to 0 at the last step."""
    return 0.5 * lr * (1.0 + math.cos(math.pi * step / max(1, steps)))


def _train_loop(
    model: Any,
    tokens: Any,
    steps: int,
    seed: int,
    lr: float,
    seq_len: int,
    batch_size: int,
    log_every: int,
) -> tuple[float, float]:
    """Run `steps` optimizer steps in place; print progress; return the (first, last) step's
    loss, the first being the untrained model's, so a caller can see training worked."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    start, losses = time.perf_counter(), []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = _cosine_lr(step, steps, lr)
        batch = sample_windows(tokens, seq_len, batch_size, generator)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        done = step + 1
        if log_every > 0 and (done % log_every == 0 or done == steps):
            elapsed = time.perf_counter() - start
            print(f"train: step {done}/{steps} loss {losses[-1]:.3g} ({elapsed:.1f} s)", flush=True)
    model.eval()
    return losses[0], losses[-1]


def _save_weights(model: Any, model_dir: pathlib.Path) -> None:
    """Replace `model_dir/model.safetensors` with `model`'s weights, touching nothing else.

    `save_pretrained` also rewrites config.json (dropping make-model's legacy keys) and
    generation_config.json, so it writes into a scratch directory and only the weights file
    is moved over, with an atomic rename so a reader never sees a half-written file."""
    with tempfile.TemporaryDirectory(dir=model_dir, prefix=".train-") as scratch:
        model.save_pretrained(scratch, safe_serialization=True)
        weights = pathlib.Path(scratch) / "model.safetensors"
        if not weights.is_file():
            raise RuntimeError("save_pretrained wrote no single model.safetensors")
        os.replace(weights, model_dir / "model.safetensors")


def train_on_corpus(
    model_dir: str | pathlib.Path,
    steps: int,
    seed: int = 0,
    lr: float = 3e-3,
    seq_len: int = 128,
    batch_size: int = 8,
    log_every: int = 50,
) -> dict[str, Any]:
    """Train the checkpoint in `model_dir` for `steps` steps on `ENGLISH_TEXT`, save its
    weights back in place, write `training.json` and return what it holds."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if steps < 1:
        raise ValueError(f"steps must be positive, got {steps}")
    path = pathlib.Path(model_dir)
    tokens = torch.tensor(corpus_token_ids(AutoTokenizer.from_pretrained(path)))
    sample_windows(tokens, seq_len, batch_size, torch.Generator())  # fail before loading
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):  # seeded, without disturbing the caller's RNG
        torch.manual_seed(seed)
        first_loss, final_loss = _train_loop(
            model, tokens, steps, seed, lr, seq_len, batch_size, log_every
        )
    seconds = time.perf_counter() - start
    _save_weights(model, path)
    record = {
        "steps": steps,
        "seed": seed,
        "lr": lr,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "corpus_tokens": len(tokens),
        "first_loss": first_loss,
        "final_loss": final_loss,
        "seconds": round(seconds, 3),
    }
    (path / TRAINING_JSON).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record
