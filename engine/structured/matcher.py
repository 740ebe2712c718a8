"""`CompiledGrammar` (a grammar compiled for one tokenizer, the template every matcher copies;
built by engine/structured/compiler.py), `GrammarMatcher` (one sequence's position in it) and
the logits masking.

A step of constrained decoding is: `fill_bitmask` (llguidance writes one bit per token, 1 =
allowed, into an int32 row: ~vocab/32 words), then `apply_token_bitmask` (the bits, moved to
the logits' device, become 0 / -inf biases through a byte lookup table and are added to the
logits: a gather and an add, never a Python loop over the vocabulary), sample,
`accept(token)`. For a batch, `apply_masks` computes every constrained row's bitmask in
parallel on llguidance's thread pool (the GIL released) and masks only those rows.

torch is imported inside the functions that need it: the router imports this package.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.structured.specs import StructuredError

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher


@dataclass(frozen=True, slots=True, eq=False)
class CompiledGrammar:
    """A grammar compiled for one tokenizer: the template every matcher copies."""

    kind: str
    spec: str
    template: LLMatcher = field(repr=False)
    vocab_size: int  # the logits width masks cover
    mask_words: int  # int32 words in one bitmask row (llguidance's vocabulary, rounded up)
    eos_token_ids: frozenset[int]

    def matcher(self, tokens: Iterable[int] = ()) -> GrammarMatcher:
        """A fresh matcher that has already accepted `tokens` (a replay; see GrammarMatcher)."""
        return GrammarMatcher(self, tokens)


class GrammarMatcher:
    """Per-sequence grammar state, made from a `CompiledGrammar`.

    `tokens` are replayed through `accept` first: the decode worker of a split pool receives
    the first token that the prefill worker sampled under the same grammar, and continues
    from the state after it. A token the grammar rejects raises StructuredError there, since
    the two workers would otherwise disagree about the output.
    """

    __slots__ = ("compiled", "_m", "_bitmask", "_terminated", "num_tokens")

    def __init__(self, compiled: CompiledGrammar, tokens: Iterable[int] = ()) -> None:
        self.compiled = compiled
        self._m = compiled.template.deep_copy()
        self._bitmask: torch.Tensor | None = None  # this matcher's row, made on first use
        self._terminated = False
        self.num_tokens = 0  # tokens accepted, EOS included
        for i, token in enumerate(tokens):
            if not self.accept(token):
                raise StructuredError(
                    f"replayed token {token} at position {i} is not allowed by the "
                    f"{compiled.kind} grammar"
                )

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token. False if the grammar does not allow it: the matcher is
        then in its error state for good (a masked sampler never gets here; the caller ends the
        request). An EOS accepted in a complete state terminates the matcher; nothing is
        accepted after that."""
        if self._terminated:
            return False
        if not self._m.consume_token(int(token_id)):
            return False
        self.num_tokens += 1
        if token_id in self.compiled.eos_token_ids:
            self._terminated = True
        return True

    def accept_tokens(self, token_ids: Iterable[int]) -> bool:
        return all(self.accept(t) for t in token_ids)

    def is_terminated(self) -> bool:
        """EOS has been accepted: the sequence is over."""
        return self._terminated

    def is_accepting(self) -> bool:
        """The tokens so far are a complete match: EOS is allowed now."""
        return self._m.is_accepting()

    def is_error(self) -> bool:
        """A rejected token put the matcher in its error state (its masks then allow only EOS,
        so a sequence that somehow got here stops)."""
        return self._m.is_error()

    @property
    def error(self) -> str:
        message = self._m.get_error()
        return message.splitlines()[0] if message else ""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding's rejected drafts)."""
        if num_tokens > self.num_tokens or not self._m.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_tokens} tokens")
        self.num_tokens -= num_tokens
        if num_tokens:
            self._terminated = False

    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (forking for n > 1 or beam-like search)."""
        twin = GrammarMatcher.__new__(GrammarMatcher)
        twin.compiled = self.compiled
        twin._m = self._m.deep_copy()
        twin._bitmask = None
        twin._terminated = self._terminated
        twin.num_tokens = self.num_tokens
        return twin

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the next-token mask into `row`: a contiguous CPU int32 tensor of
        `compiled.mask_words` words, bit t of word t // 32 set when token t is allowed."""
        _check_bitmask(row)
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def apply_mask(self, logits: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf in place; `logits` is [V] (a row of the
        batch's logits, a view, is fine) or [1, V]."""
        import torch

        if self._bitmask is None:
            self._bitmask = torch.empty((1, self.compiled.mask_words), dtype=torch.int32)
        # Our own buffer, made right: no checks needed on the per-token path.
        self._m.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self.compiled.mask_words * 4)
        apply_token_bitmask(logits.unsqueeze(0) if logits.dim() == 1 else logits, self._bitmask)

    def allowed_token_ids(self) -> list[int]:
        """The ids the next token may take (tests and debugging; the hot path is apply_mask)."""
        import torch

        row = torch.empty(self.compiled.mask_words, dtype=torch.int32)
        self.fill_bitmask(row)
        allowed = unpack_bitmask(row.view(1, -1), self.compiled.vocab_size)[0]
        return allowed.nonzero().flatten().tolist()


def _check_bitmask(t: Any, shape: tuple[int, ...] | None = None) -> None:
    """llguidance writes through a raw pointer, so the memory must be CPU and contiguous (it
    checks the byte size itself). Cheap attribute reads: this runs once per token."""
    if t.is_cuda or t.element_size() != 4 or t.is_floating_point() or not t.is_contiguous():
        raise ValueError("a bitmask must be a contiguous CPU int32 tensor")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"a bitmask here must be a {list(shape)} int32 tensor")


_SHIFTS: dict[Any, Any] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, W] int32 bitmask -> [B, vocab_size] bool (True: allowed), on the bitmask's device.
    Tokens past the bitmask's 32 * W bits count as disallowed."""
    import torch

    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    # Little-endian words: token t is bit t % 8 of byte t // 8 in the row's byte view.
    as_bytes = bitmask.contiguous().view(torch.uint8)
    bits = ((as_bytes.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1).bool()
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros((bits.shape[0], vocab_size - bits.shape[1]), dtype=torch.bool)
    return torch.cat([bits, pad.to(bits.device)], dim=1)


_BIAS: dict[Any, Any] = {}


def _bias_table(device: Any, dtype: Any) -> torch.Tensor:
    """[256, 8]: for each byte value, the 8 additive logit biases its bits stand for (0.0 for
    a set bit, -inf for a clear one), on `device` in `dtype`."""
    import torch

    table = _BIAS.get((device, dtype))
    if table is None:
        bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
        table = torch.zeros(bits.shape).masked_fill_(bits == 0, float("-inf"))
        table = _BIAS[(device, dtype)] = table.to(device=device, dtype=dtype)
    return table


def bitmask_bias(bitmask: torch.Tensor, vocab_size: int, like: torch.Tensor) -> torch.Tensor:
    """[B, W] int32 bitmask -> [B, vocab_size] additive logit bias (0.0 allowed, -inf not) on
    `like`'s device in its dtype. The bits move to the device (32x smaller than the logits)
    and become biases through a byte -> 8 biases table: one gather, vectorised. Tokens past
    the bitmask's bits get -inf."""
    import torch

    rows = bitmask.shape[0]
    as_bytes = bitmask.to(like.device, non_blocking=True).contiguous().view(torch.uint8)
    table = _bias_table(like.device, like.dtype)
    bias = table.index_select(0, as_bytes.view(-1).to(torch.int64)).view(rows, -1)
    if bias.shape[1] >= vocab_size:
        return bias[:, :vocab_size]
    pad = torch.full((rows, vocab_size - bias.shape[1]), float("-inf"), dtype=like.dtype)
    return torch.cat([bias, pad.to(like.device)], dim=1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set `logits` [B, V] to -inf in place wherever `bitmask` [B, W] (CPU int32) has a 0 bit,
    by adding `bitmask_bias`: x + 0.0 is exactly x and x + -inf is -inf. (A bool mask through
    masked_fill_ or torch.where measured ~10x slower on CPU: ~500 us against ~50 us for
    131072 tokens on a 2-core box.)"""
    if logits.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)}")
    logits.add_(bitmask_bias(bitmask, logits.shape[1], logits))


_executor: Any = None
_executor_lock = threading.Lock()


def _llg_executor() -> Any:
    """llguidance's thread pool, one per process, made on first use."""
    global _executor
    with _executor_lock:
        if _executor is None:
            from llguidance import LLExecutor

            _executor = LLExecutor()
        return _executor


def fill_bitmasks(matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
    """Row i of `bitmask` [len(matchers), W] (contiguous CPU int32) gets matcher i's mask,
    the rows computed in parallel with the GIL released."""
    if not matchers:
        return
    words = matchers[0].compiled.mask_words
    if any(m.compiled.mask_words != words for m in matchers):
        raise ValueError("matchers in one batch must share a vocabulary")
    _check_bitmask(bitmask, (len(matchers), words))
    if len(matchers) == 1:
        matchers[0].fill_bitmask(bitmask[0])
        return
    pairs = [(m._m, i) for i, m in enumerate(matchers)]
    _llg_executor().unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(matchers))


def apply_masks(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> None:
    """Mask a batch in place: row i of `logits` [B, V] by `matchers[i]`, rows with None left
    alone (unconstrained requests pay nothing)."""
    import torch

    if len(matchers) != logits.shape[0]:
        raise ValueError(f"{len(matchers)} matchers for {logits.shape[0]} logits rows")
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    active = [matchers[i] for i in rows]
    bitmask = torch.empty((len(rows), active[0].compiled.mask_words), dtype=torch.int32)
    fill_bitmasks(active, bitmask)
    if len(rows) == logits.shape[0]:
        apply_token_bitmask(logits, bitmask)
        return
    index = torch.tensor(rows, device=logits.device)
    logits.index_add_(0, index, bitmask_bias(bitmask, logits.shape[1], logits))
