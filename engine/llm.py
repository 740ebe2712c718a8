"""Offline entry point: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any

from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_info import load_tokenizer
from engine.outputs import RequestOutput
from engine.protocol import SamplingParams


def engine_config(model: str | os.PathLike, settings: dict[str, Any]) -> EngineConfig:
    """`EngineConfig(model, **settings)`, with a TypeError naming every unknown setting."""
    known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TypeError(
            f"LLM() got unknown settings {', '.join(map(repr, unknown))}; "
            f"EngineConfig's are: {', '.join(sorted(known))}"
        )
    return EngineConfig(model=str(model), **settings)


class LLM:
    """`settings` are `EngineConfig`'s fields (engine/llm_engine.py: what `tandem serve`'s
    engine flags set), each with EngineConfig's default when not given."""

    def __init__(self, model: str | os.PathLike, **settings: Any):
        self.engine = LLMEngine(engine_config(model, settings))
        self.tokenizer = load_tokenizer(self.engine.config.tokenizer or str(model))
        self._ids = itertools.count()

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer: the model has none (tokenizer=)")
            if not prompt:
                raise ValueError("prompt must not be empty")
            return self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, list | tuple) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return list(prompt)
        raise ValueError("each prompt must be a string or a list of token ids")

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        sampling_params = sampling_params or SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling params for {len(prompts)} prompts"
            )
        engine = self.engine
        encoded = [self._encode(p) for p in prompts]
        for ids in encoded:  # validate all before admitting any: all or nothing
            engine.validate_prompt(ids)
        rids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, ids, sp in zip(rids, encoded, sampling_params, strict=True):
            engine.add_request(rid, ids, sp)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(rids), desc="generating", unit="req")
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finish_reason is not None and bar is not None:
                        bar.update()
        except BaseException:
            for rid in rids:
                engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [self._result(rid) for rid in rids]

    def _result(self, rid: str) -> RequestOutput:
        seq = self.engine.pop_finished(rid)
        assert seq is not None, f"{rid} did not finish"
        out = self._output(rid, seq)
        out.choices = [self._output(rid, c) for c in seq.choices]
        return out

    def _output(self, rid: str, seq) -> RequestOutput:
        out = seq.output_token_ids
        ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time else None
        tpot = None
        if seq.finish_time and seq.first_token_time and len(out) > 1:
            tpot = (seq.finish_time - seq.first_token_time) / (len(out) - 1)
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(out, skip_special_tokens=True)
        asked = seq.sampling.prompt_logprobs is not None
        return RequestOutput(
            request_id=rid,
            prompt_token_ids=list(seq.prompt_token_ids),
            token_ids=out,
            text=text,
            finish_reason=seq.finish_reason,
            ttft=ttft,
            tpot=tpot,
            num_cached_tokens=seq.num_cached_tokens,
            metrics={"preemptions": seq.num_preemptions},
            logprobs=list(seq.output_logprobs) if seq.sampling.logprobs is not None else None,
            prompt_logprobs=list(seq.prompt_logprobs or []) if asked else None,
            cumulative_logprob=seq.cumulative_logprob,
        )
