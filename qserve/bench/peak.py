"""The arithmetic bound on a model's token rate here: its FLOPs per token over this CPU's measured
matmul rate for the dtype (the eval-throughput benchmark compares qserve's eval with it)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

# Square matmuls whose best rate stands for the machine's peak: the rate grows with size until
# packing and threading overheads are small, then falls once the operands leave the caches.
PEAK_SIZES = (512, 1024, 2048, 4096)


def matmul_gflops(dtype: str, sizes: tuple[int, ...] = PEAK_SIZES, seconds: float = 1.5) -> dict[str, float]:
    """GFLOP/s of the fastest square matmul in `dtype` (float32, bfloat16, int8) on all of torch's
    threads, per kernel library: "torch" (a @ b; int8: torch._int_mm, int32 accumulation) and "vllm"
    (vLLM-CPU's oneDNN handlers, the kernels its linear layers run: onednn_mm; int8: onednn_scaled_mm
    with per-token activation and per-channel weight scales, as W8A8 runs). The machine's peak is the
    faster of the two: torch's float32 goes through MKL, far below oneDNN's rate on some CPUs, which
    would put vLLM's eval above its own bound."""
    return {kernel: max(_square_gflops(dtype, size, seconds, kernel) for size in sizes) for kernel in _KERNELS}


def _square_gflops(dtype: str, size: int, seconds: float, kernel: str) -> float:
    import torch

    torch.manual_seed(0)
    run = _KERNELS[kernel](dtype, size)
    run()  # warm-up: packing buffers, thread pool
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def _torch_matmul(dtype: str, size: int) -> Callable[[], object]:
    import torch

    if dtype == "int8":
        a = torch.randint(-128, 127, (size, size), dtype=torch.int8)
        b = torch.randint(-128, 127, (size, size), dtype=torch.int8)
        return lambda: torch._int_mm(a, b)
    a = torch.randn(size, size).to(getattr(torch, dtype))
    b = torch.randn(size, size).to(getattr(torch, dtype))
    return lambda: a @ b


def _vllm_matmul(dtype: str, size: int) -> Callable[[], object]:
    """A square product through the oneDNN handler vLLM-CPU builds for a linear layer (weight
    given as [K, N], the transpose of the checkpoint's [N, K], as vLLM gives it)."""
    import torch
    from vllm import _custom_ops as ops

    if dtype == "int8":
        weight, scale = torch.randint(-128, 127, (size, size), dtype=torch.int8).t(), torch.rand(size, 1)
        handler = ops.create_onednn_scaled_mm(weight, scale, torch.bfloat16, True, False, 32)
        x, x_scale = torch.randint(-128, 127, (size, size), dtype=torch.int8), torch.rand(size, 1)
        out = torch.empty(size, size, dtype=torch.bfloat16)
        # the handler points at `scale` without holding it: the closure keeps it alive
        return lambda scale=scale: ops.onednn_scaled_mm(handler, x, out, x_scale, None, None, None)
    weight = torch.randn(size, size).to(getattr(torch, dtype)).t()
    handler = ops.create_onednn_mm(weight, 32)
    x = torch.randn(size, size).to(getattr(torch, dtype))
    return lambda: ops.onednn_mm(handler, x, None)


# kernel library -> a square product of that dtype and size in it, ready to time
_KERNELS: dict[str, Callable[[str, int], Callable[[], object]]] = {"torch": _torch_matmul, "vllm": _vllm_matmul}


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
