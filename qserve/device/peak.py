"""The arithmetic bound on a model's token rate here: its FLOPs per token over this CPU's measured
matmul rate for the dtype (the eval-throughput benchmark compares qserve's eval with it)."""

from __future__ import annotations

import json
import time
from pathlib import Path

# Square matmuls whose best rate stands for the machine's peak: the rate grows with size until
# packing and threading overheads are small, then falls once the operands leave the caches.
PEAK_SIZES = (512, 1024, 2048, 4096)


def matmul_gflops(dtype: str, sizes: tuple[int, ...] = PEAK_SIZES, seconds: float = 1.5) -> float:
    """GFLOP/s of the fastest square matmul in `dtype` (float32, bfloat16; int8: torch._int_mm,
    int32 accumulation) on all of torch's threads, each size the best of its runs over `seconds`."""
    return max(_square_gflops(dtype, size, seconds) for size in sizes)


def _square_gflops(dtype: str, size: int, seconds: float) -> float:
    import torch

    torch.manual_seed(0)
    if dtype == "int8":
        a = torch.randint(-128, 127, (size, size), dtype=torch.int8)
        b = torch.randint(-128, 127, (size, size), dtype=torch.int8)

        def run() -> object:
            return torch._int_mm(a, b)
    else:
        a = torch.randn(size, size).to(getattr(torch, dtype))
        b = torch.randn(size, size).to(getattr(torch, dtype))

        def run() -> object:
            return a @ b

    run()  # warm-up: packing buffers, thread pool
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def flops_per_token(model_dir: Path, context: float = 0.0) -> dict[str, float]:
    """Forward FLOPs per token of a decoder from its config.json, by part: `layers` (2 x the
    attention and MLP projections' weights), `head` (the LM head: every prompt token's logits are
    computed for its log-likelihood) and `attention` (scores and weighted sums over `context`
    earlier tokens). A W8A8 checkpoint runs `layers` in int8 and the rest in 16 bits."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    hidden, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o; k and v
    mlp = 3 * hidden * cfg["intermediate_size"]  # gate, up, down
    return {
        "layers": 2.0 * layers * (attention + mlp),
        "head": 2.0 * vocab * hidden,
        "attention": layers * 4.0 * heads * head_dim * context,  # QK^T and the weighted sum of V
    }


def bound_tokens_per_second(flops: dict[str, float], gflops: dict[str, float]) -> float:
    """Tokens/s if every part ran at its dtype's measured matmul rate: `gflops` maps each part of
    flops_per_token to the rate of the dtype it runs in."""
    return 1.0 / sum(flops[part] / (gflops[part] * 1e9) for part in flops)
