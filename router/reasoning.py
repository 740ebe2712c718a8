"""A reasoning model's thinking, split from its answer (vLLM's `--reasoning-parser`): the text
between `<think>` and `</think>` goes to the message's `reasoning` (and `reasoning_content`,
the name DeepSeek's API and many clients read), the rest to `content`, in whole answers and
streamed deltas alike.

Where the thinking starts is read from the prompt the chat template wrote and the parser:
- the prompt ends with `</think>` (a template that turned thinking off, as Qwen3's does for
  `enable_thinking: false`): all content;
- the prompt ends with `<think>` (DeepSeek-R1's template, Qwen3.5's and the thinking 2507
  models'), or the parser is `deepseek_r1`: thinking from the first token;
- `qwen3` otherwise: the model opens `<think>` itself (Qwen3's first templates) or answers
  without thinking; `enable_thinking: false` means content.
A `<think>` the model writes at the start is dropped; the first `</think>` ends the thinking
(an answer cut before it is all thinking, as in vLLM), and the blank lines the model writes
after it are not part of the answer (so a tool call right after thinking opens the content).
`ReasoningSplit` is fed the answer piece by piece and holds back a piece's end that could
begin a marker, so no delta ever carries half of one. With `tool_choice: auto`, the tools'
grammar lets the model think first (router/tools.py `auto_tools_grammar`); other constraints
hold from the first token, so those answers are not split.
"""

from __future__ import annotations

from typing import Any

REASONING_PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"
THINKING, CONTENT, UNDECIDED = "thinking", "content", "undecided"


def think_token_ids(tokenizer: Any, parser: str) -> tuple[int | None, int]:
    """The ids of the `<think>` token (None when the tokenizer has none) and the `</think>`
    token; ValueError without the latter (a model never taught the markers would have its
    answers read as thinking)."""
    ids = [tokenizer.encode(m, add_special_tokens=False) for m in (OPEN, CLOSE)]
    if len(ids[1]) != 1:
        raise ValueError(
            f"reasoning parser {parser!r}: the tokenizer has no {CLOSE} token (it splits it "
            f"into {len(ids[1])}), so this model does not think in {OPEN}...{CLOSE} blocks"
        )
    if ids[1][0] in set(getattr(tokenizer, "all_special_ids", ())):
        # Answers are decoded without special tokens: the marker would vanish from the text.
        raise ValueError(
            f"reasoning parser {parser!r}: this tokenizer marks {CLOSE} special, so answers "
            "(decoded without special tokens) would lose it"
        )
    return (ids[0][0] if len(ids[0]) == 1 else None), ids[1][0]


def initial_mode(parser: str, prompt_text: str, thinking_enabled: bool) -> str:
    """Where an answer to `prompt_text` starts: THINKING, CONTENT or UNDECIDED (the model's
    first characters tell: `<think>` opens thinking, anything else is content)."""
    tail = prompt_text.rstrip()
    if tail.endswith(CLOSE):
        return CONTENT
    if tail.endswith(OPEN) or parser == "deepseek_r1":
        return THINKING
    return UNDECIDED if thinking_enabled else CONTENT


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`: what a
    stream holds back until the next piece shows whether the marker is there."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplit:
    """One answer's text, fed in order, as (reasoning, content) pieces."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.at_start = True  # a <think> the model writes first is dropped
        self.after_close = False  # white space right after </think> is dropped
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        buf, self.held = self.held + text, ""
        reasoning, content = [], []
        while buf:
            if self.mode == CONTENT:
                if self.after_close:
                    buf = buf.lstrip()
                    self.after_close = not buf
                content.append(buf)
                break
            if self.at_start:
                stripped = buf.lstrip()
                if stripped.startswith(OPEN):
                    buf, self.at_start, self.mode = stripped[len(OPEN) :], False, THINKING
                    continue
                if OPEN.startswith(stripped):  # blank, or a start of <think>: wait and see
                    self.held = buf
                    break
                self.at_start = False
                if self.mode == UNDECIDED:
                    self.mode = CONTENT
                    continue
            end = buf.find(CLOSE)
            if end >= 0:
                reasoning.append(buf[:end])
                buf, self.mode, self.after_close = buf[end + len(CLOSE) :], CONTENT, True
                continue
            keep = partial_marker(buf, CLOSE)
            reasoning.append(buf[: len(buf) - keep])
            self.held = buf[len(buf) - keep :]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, where it belongs now that the answer has ended."""
        held, self.held = self.held, ""
        if self.mode == THINKING:
            return held, ""
        return "", held


def thinking_tokens(
    mode: str | None, token_ids: list[int], think_ids: tuple[int | None, int | None]
) -> int:
    """How many of an answer's tokens are thinking: those before its `</think>` token (vLLM's
    count), or all of them when the answer was cut while thinking."""
    open_id, close_id = think_ids
    if mode in (None, CONTENT) or not token_ids:
        return 0
    if close_id in token_ids:
        return token_ids.index(close_id)
    return len(token_ids) if mode == THINKING or token_ids[0] == open_id else 0


def split_whole(mode: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer; None where a part is empty."""
    split = ReasoningSplit(mode)
    reasoning, content = split.feed(text)
    more_reasoning, more_content = split.finish()
    reasoning, content = reasoning + more_reasoning, content + more_content
    return reasoning or None, content or None
