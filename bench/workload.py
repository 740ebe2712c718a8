"""The requests of one `tandem bench serve` run, built up front from the config and its seed.

Random: lengths U[L(1-r), L(1+r)] and arrival offsets from a Poisson / gamma process at the
request rate. Trace: the scaled CSV rows (`bench/traces.py`) give both. Prompts are token ids
for /v1/completions, so the prompt length is exact, and random words for
/v1/chat/completions, so lengths are approximate (the usage chunk reports the exact count).
ShareGPT: the conversations' text is the prompt on either endpoint, lengths counted by the
tokenizer (`bench/sharegpt.py`), arrivals from the request rate as for random.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bench.config import COMPLETIONS, DEFAULT_RANDOM_PROMPTS, BenchConfig
from bench.sharegpt import hf_token_counter, load_sharegpt
from bench.traces import TraceSummary, load_trace, scale_trace, summarize_trace

# Short common words: most tokenizers give about one token each, so a chat prompt of N words is
# roughly N tokens (the usage chunk reports the exact count).
_WORD_TEXT = (
    "the of and to in is that it for was on are as with his they at be this from have or by "
    "one had not but what all were when we there can an your which their said if do will each "
    "about how up out them then she many some so these would other into has more her two like "
    "him see time could no make than first been its who now people my made over did down only "
    "way find use may water long little very after words called just where most know"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    index: int
    arrival_s: float
    prompt_len: int  # requested; exact for token-id prompts
    output_len: int
    prompt: list[int] | str


@dataclass(slots=True)
class Workload:
    requests: list[WorkloadRequest]
    trace: TraceSummary | None = None  # set for trace replays (after scaling)


def sample_lengths(
    rng: np.random.Generator, n: int, mean_len: int, range_ratio: float
) -> np.ndarray:
    """n integers uniform on [floor(L(1-r)), floor(L(1+r))], inclusive, never below 1."""
    if n < 0 or mean_len < 1 or not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"bad length spec n={n} L={mean_len} r={range_ratio}")
    lo = max(1, math.floor(mean_len * (1.0 - range_ratio)))
    hi = max(lo, math.floor(mean_len * (1.0 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n)


def arrival_offsets(
    rng: np.random.Generator, n: int, request_rate: float, burstiness: float = 1.0
) -> np.ndarray:
    """Arrival offsets in seconds, the first at 0. Intervals are gamma(shape=B, scale=1/(R*B)):
    mean 1/R whatever B; B=1 is a Poisson process, B<1 burstier, B>1 more regular (the
    coefficient of variation of the intervals is 1/sqrt(B)). R=inf sends everything at 0."""
    if n < 0 or not request_rate > 0 or not burstiness > 0:
        raise ValueError(f"bad arrival spec n={n} rate={request_rate} burstiness={burstiness}")
    if n == 0:
        return np.zeros(0)
    if math.isinf(request_rate):
        return np.zeros(n)
    intervals = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(intervals)])


def random_token_ids(rng: np.random.Generator, n: int, low: int, high: int) -> list[int]:
    return rng.integers(low, high, size=n).tolist()


def random_words(rng: np.random.Generator, n: int) -> str:
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=n))


def sharegpt_workload(
    config: BenchConfig,
    count_tokens: Callable[[str], int] | None = None,
    tokenizer: str | None = None,
) -> Workload:
    """The ShareGPT requests of `config.sharegpt_path`, arriving at the configured rate.
    Tokens are counted by `count_tokens`, else by the Hugging Face tokenizer named by
    --tokenizer, --model or `tokenizer` (the model the server lists), in that order."""
    assert config.sharegpt_path is not None
    if count_tokens is None:
        name = config.tokenizer or config.model or tokenizer
        if name is None:
            raise ValueError(
                "dataset sharegpt counts tokens with the model's tokenizer: give --tokenizer "
                "(or --model, or a server whose /v1/models lists it)"
            )
        count_tokens = hf_token_counter(name)
    rows = load_sharegpt(
        config.sharegpt_path,
        count_tokens,
        num_requests=config.num_prompts or DEFAULT_RANDOM_PROMPTS,
        seed=config.seed,
        fixed_output_len=config.sharegpt_output_len,
    )
    rng = np.random.default_rng(config.seed)
    arrivals = arrival_offsets(rng, len(rows), config.request_rate, config.burstiness)
    requests = [
        WorkloadRequest(i, float(a), r.prompt_len, r.output_len, r.prompt)
        for i, (a, r) in enumerate(zip(arrivals, rows, strict=True))
    ]
    return Workload(requests)


def build_workload(
    config: BenchConfig,
    *,
    count_tokens: Callable[[str], int] | None = None,
    tokenizer: str | None = None,
) -> Workload:
    """Every request's arrival, lengths and prompt, from the config and its seed alone (for
    ShareGPT also the tokenizer: `sharegpt_workload`)."""
    if config.sharegpt_path is not None:
        return sharegpt_workload(config, count_tokens, tokenizer)
    rng = np.random.default_rng(config.seed)
    trace_summary = None
    if config.trace_path is not None:
        rows = scale_trace(
            load_trace(config.trace_path, limit=config.num_prompts),
            length_scale=config.trace_length_scale,
            time_scale=config.trace_time_scale,
            max_input=config.trace_max_input,
            max_output=config.trace_max_output,
        )
        arrivals = [r.arrival_s for r in rows]
        prompt_lens = [r.prompt_len for r in rows]
        output_lens = [r.output_len for r in rows]
        trace_summary = summarize_trace(rows)
    else:
        n = config.num_prompts or DEFAULT_RANDOM_PROMPTS
        prompt_lens = sample_lengths(rng, n, config.input_len, config.input_range).tolist()
        output_lens = sample_lengths(rng, n, config.output_len, config.output_range).tolist()
        arrivals = arrival_offsets(rng, n, config.request_rate, config.burstiness).tolist()
    requests = []
    for i, (arrival, p_len, o_len) in enumerate(
        zip(arrivals, prompt_lens, output_lens, strict=False)
    ):
        if config.endpoint == COMPLETIONS:
            prompt: list[int] | str = random_token_ids(
                rng, p_len, config.vocab_low, config.vocab_high
            )
        else:
            prompt = random_words(rng, p_len)
        requests.append(WorkloadRequest(i, float(arrival), int(p_len), int(o_len), prompt))
    return Workload(requests, trace_summary)
