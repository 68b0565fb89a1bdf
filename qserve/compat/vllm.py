"""vLLM (CPU build, in this process): model inspection in the process, token ranks counted in blocks,
the start method the environment chose, and full-vocabulary log-probabilities kept as arrays."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

RANK_ROWS = 32
START_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"


@contextmanager
def model_info_in_process() -> Iterator[None]:
    """vLLM inspects a model class it has no record of in a child Python that imports vLLM again (so a
    GPU parent never initialises CUDA before it forks) and records the result under VLLM_CACHE_ROOT. A
    CPU engine loads the model in this very process anyway, so the inspection runs here; vLLM still
    writes its record, which `vllm serve` reads later."""
    from vllm.model_executor.models import registry

    with mock.patch.object(registry, "_run_in_subprocess", lambda inspect: inspect()):
        yield


def count_at_least(x: Any, values: Any) -> Any:
    """Per row of `x`, how many entries are at least the row's value in `values`: vLLM's
    `batched_count_greater_than`, `(x >= values).sum(-1)`, the same int64 counts, 32 rows at a time
    so each comparison's boolean block stays in cache."""
    import torch

    counts = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    for start in range(0, x.shape[0], RANK_ROWS):
        rows = slice(start, start + RANK_ROWS)
        counts[rows] = (x[rows] >= values[rows]).sum(-1, dtype=torch.int32)  # a vocabulary is far below 2**31
    return counts


@contextmanager
def ranks_counted_in_blocks() -> Iterator[None]:
    """vLLM's sampler ranks tokens with `count_at_least` instead of `batched_count_greater_than`, a
    torch.compile function even in eager mode, which inductor builds with g++ at each process's first
    ranking, again in every new virtualenv (its cache key holds the path). CPU only."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        yield
        return
    from vllm.v1.sample import sampler

    with mock.patch.object(sampler, "batched_count_greater_than", count_at_least):
        yield


@contextmanager
def start_method_kept() -> Iterator[None]:
    """vLLM-CPU's platform sets spawn while it configures the engine (vllm/platforms/cpu.py), whatever
    the environment chose; in the block the chosen start method holds."""
    chosen = os.environ.get(START_METHOD)
    if chosen is None:
        yield
        return
    from vllm.platforms.cpu import CpuPlatform

    configure = CpuPlatform.check_and_update_config.__func__

    def configure_keeping_it(cls: type, vllm_config: object) -> None:
        configure(cls, vllm_config)
        os.environ[START_METHOD] = chosen

    with mock.patch.object(CpuPlatform, "check_and_update_config", classmethod(configure_keeping_it)):
        yield


@contextmanager
def logprob_rows_as_arrays() -> Iterator[None]:
    """For a request asking for every log-probability (logprobs=-1), vLLM's output processor keeps each
    position's row as the numpy arrays the engine sent, on the request's container as `rows` (token ids,
    float32 log-probabilities), instead of one Python list entry per vocabulary entry. The values are
    vLLM's own (a Python float of a float32 is exact), and so is the cumulative log-probability."""
    from vllm.logprobs import FlatLogprobs
    from vllm.v1.engine.logprobs import LogprobsProcessor

    own = LogprobsProcessor._update_sample_logprobs

    def update(self: Any, logprobs_lists: Any) -> None:
        if self.num_logprobs != -1 or not isinstance(self.logprobs, FlatLogprobs):
            return own(self, logprobs_lists)
        token_ids, logprobs = logprobs_lists[0], logprobs_lists[1]
        rows = self.logprobs.__dict__.setdefault("rows", [])
        for ids, values in zip(token_ids, logprobs, strict=True):
            self.cumulative_logprob += float(values[0])  # the sampler puts the sampled token's first
            rows.append((ids, values))
        return None

    with mock.patch.object(LogprobsProcessor, "_update_sample_logprobs", update):
        yield
