"""What the served model must answer, computed by transformers on the same weights in fp32.

`Reference` wraps `AutoModelForCausalLM` + the model dir's tokenizer: log-softmax over the
vocabulary at every position, continuation log-likelihoods (what lm-eval sums), and a greedy
decoder that applies vLLM's logits processors itself (allowed_token_ids, bad words over the
output, min_tokens, logit_bias, repetition penalty over prompt and output, frequency/presence
penalties over the output; in that order, on the fp32 logits), so a served greedy answer can be compared token for token. Log-probs it
reports are always the raw model's (before any processing), as tandem and vLLM report them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

TOL = 1e-4  # fp32 log-prob agreement the interop tests ask for


@dataclass
class Step:
    """One greedy step: the chosen id and the raw log-softmax row it was chosen from."""

    token: int
    logprobs: torch.Tensor  # [vocab], raw (before any processing)

    def top(self, k: int) -> list[tuple[int, float]]:
        values, ids = self.logprobs.topk(k)
        return list(zip(ids.tolist(), values.tolist(), strict=True))

    @property
    def logprob(self) -> float:
        return float(self.logprobs[self.token])


@dataclass
class Processing:
    """vLLM's per-request logits processors (defaults: none)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    eos: tuple[int, ...] = ()
    allowed: tuple[int, ...] = ()  # allowed_token_ids
    bad_words: tuple[tuple[int, ...], ...] = ()  # as token ids

    def apply(self, logits: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
        x = logits.clone()
        if self.allowed:
            keep = torch.full_like(x, float("-inf"))
            keep[list(self.allowed)] = x[list(self.allowed)]
            x = keep
        for word in self.bad_words:  # the last token, once the output ends with the rest
            *head, last = word
            if not head or output[len(output) - len(head) :] == head:
                x[last] = float("-inf")
        if len(output) < self.min_tokens:
            x[list(self.eos)] = float("-inf")
        for token, b in self.bias.items():
            x[token] += b
        if self.repetition != 1.0:
            seen = sorted(set(prompt) | set(output))
            v = x[seen]
            x[seen] = torch.where(v > 0, v / self.repetition, v * self.repetition)
        if output and (self.presence or self.frequency):
            counts = torch.bincount(torch.tensor(output), minlength=x.shape[0]).float()
            x -= self.frequency * counts + self.presence * (counts > 0).float()
        return x


class Reference:
    """A transformers model (fp32, eval) and its tokenizer; `from_dir` loads a model folder."""

    def __init__(self, model, tokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer
        eos = self.model.generation_config.eos_token_id
        self.eos = tuple(eos) if isinstance(eos, list) else (eos,)

    @classmethod
    def from_dir(cls, model_dir: Path) -> Reference:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        return cls(model.eval(), AutoTokenizer.from_pretrained(str(model_dir)))

    # ------------------------------------------------------------------ tokens and text

    def encode(self, text: str) -> list[int]:
        """A completions text prompt as tandem tokenizes it (the tokenizer's specials)."""
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def chat_ids(self, messages: list[dict], tools: list | None = None) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def token_str(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def text(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ log-probabilities

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab]: row i is the log-softmax of the next token after ids[: i + 1]."""
        logits = self.model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    def prompt_logprobs(self, ids: list[int]) -> list[float | None]:
        """Each prompt token's log-prob given the tokens before it (the first has none)."""
        lp = self.logprobs(ids)
        return [None] + [float(lp[i - 1, t]) for i, t in enumerate(ids) if i > 0]

    def continuation(self, context: list[int], cont: list[int]) -> tuple[float, bool]:
        """lm-eval's (sum of the continuation's log-probs, every token the argmax)."""
        ids = context + cont
        lp = self.logprobs(ids)
        rows = lp[len(context) - 1 : len(ids) - 1]
        target = torch.tensor(cont)
        total = float(rows.gather(1, target[:, None]).sum())
        return total, bool((rows.argmax(dim=-1) == target).all())

    # ------------------------------------------------------------------ greedy decoding

    @torch.no_grad()
    def greedy(
        self,
        prompt: list[int],
        max_tokens: int,
        processing: Processing | None = None,
        ignore_eos: bool = True,
    ) -> list[Step]:
        """Greedy decoding (argmax of the processed logits); stops after EOS unless
        `ignore_eos`. Each step keeps the raw log-softmax row."""
        proc = processing or Processing()
        proc.eos = self.eos
        steps: list[Step] = []
        output: list[int] = []
        for _ in range(max_tokens):
            logits = self.model(torch.tensor([prompt + output])).logits[0, -1].float()
            token = int(proc.apply(logits, prompt, output).argmax())
            steps.append(Step(token, torch.log_softmax(logits, dim=-1)))
            output.append(token)
            if token in self.eos and not ignore_eos:
                break
        return steps

    def greedy_text(self, prompt: list[int], max_tokens: int, **kwargs) -> str:
        return self.text([s.token for s in self.greedy(prompt, max_tokens, **kwargs)])
