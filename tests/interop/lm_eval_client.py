"""lm-evaluation-harness 0.4.13's `local-completions` client pointed at a live server, as the
interop and real-model tests run it, and lm-eval's split of a (context, continuation) pair
into token ids, which their transformers references recompute."""

from __future__ import annotations

from pathlib import Path

import pytest

TASKS = Path(__file__).parent / "tasks"


def evaluate(url: str, model_name: str, tokenizer: str, tasks: list[str], datasets_cache: Path):
    """`lm_eval.simple_evaluate` on the local `tasks` (tests/interop/tasks/) against the server
    at `url`, token-id requests, every sample logged. `tokenizer` is a folder transformers'
    AutoTokenizer loads."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(TASKS)  # the task YAMLs name their jsonl files relative to the working dir
        # `datasets` reads these when first imported: its cache out of ~, off the network.
        mp.setenv("HF_DATASETS_CACHE", str(datasets_cache))
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        import lm_eval
        from lm_eval.tasks import TaskManager

        return lm_eval.simple_evaluate(
            model="local-completions",
            model_args={
                "base_url": f"{url}/v1/completions",
                "model": model_name,
                "tokenizer": tokenizer,
                "tokenizer_backend": "huggingface",
                "tokenized_requests": True,
                "num_concurrent": 2,
                "batch_size": 4,
                "max_retries": 1,
                "timeout": 120,
            },
            tasks=tasks,
            task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
            log_samples=True,
            bootstrap_iters=0,
        )


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair for a causal model (no special tokens added):
    trailing spaces move to the continuation, the whole string is encoded and split at the
    context's length."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    return list(ctx), list(whole[len(ctx) :])
