"""lm-eval's vLLM model: prompt tokens scored by vLLM's rank instead of a top-1 over the vocabulary."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock


@contextmanager
def prompt_ranks_scored() -> Iterator[None]:
    """In the block, lm-eval's VLLM model scores with `prompt_logprobs=0`: vLLM then returns each prompt
    token's log-probability and rank, where lm-eval's `prompt_logprobs=1` asks for a top-1 over the
    vocabulary only to tell whether the continuation is greedy. Rank 1 says that (vLLM counts the tokens
    at least as likely as the given one, so a token tied for the maximum is not greedy here, where
    lm-eval's top-1 picked one of the tied). Private methods of lm-eval: its versions are pinned."""
    from lm_eval.models.vllm_causallms import VLLM
    from vllm import SamplingParams

    scoring = SamplingParams(temperature=0, prompt_logprobs=0, max_tokens=1, detokenize=False)
    own = VLLM._model_generate

    def _model_generate(self: Any, requests: list[list[int]], generate: bool = False, sampling_params: Any = None) -> Any:
        if not generate or sampling_params is None:  # lm-eval's own test for a scoring call
            return own(self, requests, True, scoring)
        return own(self, requests, generate, sampling_params)

    def _parse_logprobs(tokens: list, outputs: Any, ctxlen: int) -> tuple[float, bool]:
        # The first position has no log-probability; ctxlen >= 1, as lm-eval's own parser assumes.
        scored = [pos[token] for token, pos in zip(tokens[ctxlen:], outputs.prompt_logprobs[ctxlen:], strict=True)]
        return sum(s.logprob for s in scored), all(s.rank == 1 for s in scored)

    with mock.patch.object(VLLM, "_model_generate", _model_generate):
        with mock.patch.object(VLLM, "_parse_logprobs", staticmethod(_parse_logprobs)):
            yield
