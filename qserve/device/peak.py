"""The arithmetic bound on a model's token rate here: its FLOPs per token over this CPU's measured
matmul rate for the dtype (the eval-throughput benchmark compares qserve's eval with it)."""

from __future__ import annotations

import json
import time
from pathlib import Path

# The matmul whose rate stands for the machine's peak: square, large enough that packing and
# threading overheads are small, small enough to stay near the caches of a small machine.
PEAK_SIZE = 2048


def matmul_gflops(dtype: str, size: int = PEAK_SIZE, seconds: float = 3.0) -> float:
    """GFLOP/s of a square matmul in `dtype` (float32, bfloat16; int8: torch._int_mm, int32
    accumulation) on all of torch's threads, the best of repeated runs over `seconds`."""
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


def flops_per_token(model_dir: Path, context: float = 0.0) -> float:
    """Forward FLOPs per token of a decoder from its config.json: 2 x the weights of every matmul
    (attention and MLP projections, the LM head), plus attention over `context` earlier tokens."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    hidden, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o; k and v
    mlp = 3 * hidden * cfg["intermediate_size"]  # gate, up, down
    weights = layers * (attention + mlp) + vocab * hidden
    scores = layers * 4 * heads * head_dim * context  # QK^T and the weighted sum of V
    return 2.0 * weights + scores
