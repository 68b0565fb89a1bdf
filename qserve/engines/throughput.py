"""Offline decode speed on an open engine (for `qserve compare` and the benchmark suite)."""

from __future__ import annotations

import time
from typing import Any


def decode_throughput(lm: Any, prompts: int = 16, max_tokens: int = 128) -> dict[str, float]:
    """Offline batch decode speed on an open engine: output tokens per second over a fixed batch."""
    from vllm import SamplingParams

    batch = [f"Write a long story about the number {i}." for i in range(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    lm.model.generate(batch[:2], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = lm.model.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output_tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 2)}
