"""The engine's half of disaggregation: the scheduler-side calls of the KV hand-off
(engine/kv_connector.py), as a base class of `LLMEngine` (engine/llm_engine.py's docstring
tells the story: prefill hands a request's blocks on, decode admits remote requests, commits
or recomputes them). Methods use the engine's scheduler, block manager, sequences and
`ahead` (engine.decode_ahead: a step in flight is read back before any of these change the
batch).
"""

from __future__ import annotations

import logging
import time

from engine.kv_connector import ROLE_CALLS, Handoff, KVConnector
from engine.outputs import TokenOutput
from engine.protocol import SamplingParams, trusted
from engine.sampler import skip_draw
from engine.scheduler import SeqStatus, Sequence

log = logging.getLogger(__name__)


class KVHandoff:
    def set_kv_connector(self, connector: KVConnector | None) -> None:
        """The worker that moves KV for this engine: it must have its role's call."""
        call = ROLE_CALLS.get(self.config.role)
        if connector is not None and not callable(getattr(connector, call or "", None)):
            raise TypeError(
                f"a {self.config.role} engine's KV connector needs {call or 'a role that moves KV'}"
                f"; {type(connector).__name__} has none"
            )
        self.kv_connector = connector

    def release(self, request_id: str) -> None:
        """Free a prefilled request's blocks once its hand-off is over (or abandoned)."""
        self.ahead.drain()
        self.groups.pop(request_id, None)
        seq = self.seqs.pop(request_id, None)
        if seq is not None and seq.block_table:
            self.block_manager.free(seq.block_table)

    def add_remote_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int,
        sampling: SamplingParams,
        choices: list[tuple[int, int]] | None = None,
    ) -> None:
        """Queue a request whose prompt KV (and first token) come from a prefill peer. The
        scheduler admits it like a local one; then the connector's `on_remote_admitted`
        gets its blocks to fill. `choices`: the (choice, first token) pairs still to decode
        when n > 1 (default: choice 0 with `first_token`); they fork from one copy of the KV."""
        if self.kv_connector is None:
            raise RuntimeError("add_remote_request needs a KV connector (decode role)")
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.ahead.drain()
        self.validate_prompt(prompt_token_ids)
        choices = choices or [(0, first_token)]
        seq = self._new_group(request_id, prompt_token_ids, sampling, [c for c, _ in choices])
        seq.kv_from_peer = True
        now = time.perf_counter()
        for s, (_, token) in zip((seq, *seq.forks), choices, strict=True):
            # The prompt was scored on the prefill worker: never score it again here.
            s.prompt_logprobs = [None] * len(prompt_token_ids)
            s.token_ids.append(token)
            self._skip_first_draw(s)
            s.first_token_time = now
            if s.grammar is not None and not s.grammar.accept(token):
                raise ValueError(f"first token {token} does not fit the request's grammar")
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def _skip_first_draw(self, seq: Sequence) -> None:
        """A seeded sampled request's generator drew its first token on the prefill worker:
        make the same draw here, so the rest equal a colocated run of the same seed."""
        if seq.generator is not None and not seq.sampling.greedy:
            skip_draw(seq.generator, self.model_config.vocab_size)

    def commit_remote(self, request_id: str) -> list[TokenOutput]:
        """The peer's KV has landed: join the batch (every choice, forked from one copy of the
        KV). Returns the final outputs of choices the first token already finished."""
        self.ahead.drain()
        seq = self._remote_seq(request_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        # Under the request's salt (KVReady carried its SamplingParams): the peer's blocks join
        # this worker's prefix cache for later requests of the same salt only.
        seq.num_committed_blocks = self.block_manager.commit(
            seq.block_table, seq.token_ids, seq.num_computed_tokens, salt=seq.sampling.cache_salt
        )
        self.scheduler.add_running(seq)
        group = [seq, *seq.forks]
        self._fork(seq)
        done = []
        for s in group:
            reason = self._finish_reason(s, s.token_ids[-1])
            if reason is not None:
                self._finish(s, reason)
                n, cached = s.num_output_tokens, s.num_cached_tokens
                done.append(
                    trusted(
                        TokenOutput, request_id, n, [], reason, s.choice, num_cached_tokens=cached
                    )
                )
        return done

    def recompute_remote(self, request_id: str) -> None:
        """The peer's KV will not arrive (the transfer is over): prefill the prompt here and
        continue after the first token the peer already sent. Other choices queue on their own
        (after their own first tokens; the prefix cache shares what the first one computes)."""
        self.ahead.drain()
        seq = self._remote_seq(request_id)
        forks, seq.forks = seq.forks, []
        if forks:
            self.groups[request_id] = [f.request_id for f in forks]
        for child in forks:
            self.seqs[child.request_id] = child
            self.scheduler.add(child)
        self.scheduler.recompute(seq)

    def _remote_seq(self, request_id: str) -> Sequence:
        seq = self.seqs[request_id]
        if seq.status != SeqStatus.REMOTE_KV:
            raise ValueError(f"request {request_id!r} is {seq.status.value}, not remote_kv")
        return seq

    def _start_fetches(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            try:
                reused = seq.num_reused_tokens // self.block_manager.block_size
                self.kv_connector.on_remote_admitted(seq.request_id, list(seq.block_table), reused)
            except Exception:
                # The connector could not even start: the request must not keep its blocks.
                log.exception("%s: starting the KV fetch failed", seq.request_id)
                self.abort(seq.request_id)

    def _hand_off(self, seq: Sequence, choices: list[tuple[int, int]]) -> None:
        """Prefill role: the prompt is done and the request goes on elsewhere; `choices` are
        the (choice, first token) pairs still running (the first is `seq`'s own when n == 1)."""
        self.scheduler.remove(seq)
        seq.status = SeqStatus.PREFILLED
        handoff = Handoff(
            seq.request_id, list(seq.block_table), choices[0][1], seq.num_prompt_tokens, choices
        )
        accepted = False
        if self.kv_connector is not None:
            try:
                accepted = self.kv_connector.on_prefilled(handoff)
            except Exception:
                log.exception("%s: the KV hand-off failed", seq.request_id)
        if not accepted:
            self.release(seq.request_id)
