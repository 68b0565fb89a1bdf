"""Engine parity: does vLLM compute what transformers computes on the same checkpoint?

A gate measures quantization error only if the engine runs the checkpoint faithfully. vLLM's
greedy tokens and top log-probabilities are compared with transformers teacher-forced on the
same token ids, so a wrong engine setting (KV-cache dtype, RoPE, a kernel bug) shows up here
instead of being blamed on, or hidden inside, the quantization.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PROMPTS = [
    "The capital of France is",
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
    "def fibonacci(n):",
    "The three primary colours are",
    "Water boils at",
    "Once upon a time, in a small village,",
    "Translate to French: Good morning ->",
    "The largest planet in the solar system is",
]
MAX_TOKENS = 32
TOP_K = 5


@dataclass(frozen=True)
class Tolerance:
    max_mean_abs_logprob_diff: float
    min_top1_agreement: float
    why: str


# transformers reproduces weight-only checkpoints exactly, but its compressed-tensors emulation of
# INT8/FP8 activation quantization differs from vLLM's kernels, so those schemes get a looser bound
# (the support matrix, support/claims.py, holds each scheme's measured KL).
TOLERANCES = {
    "exact": Tolerance(0.05, 0.90, "transformers reproduces the dequantized weights exactly"),
    "activation": Tolerance(0.35, 0.80, "transformers' INT8/FP8 activation emulation is not bit-exact with vLLM's kernels"),
    "kv_cache": Tolerance(0.35, 0.80, "vLLM stores k/v in FP8; transformers keeps them in full precision"),
}


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    top_logprobs: list[dict[int, float]]  # per generated position: vLLM's top-k token -> logprob


def vllm_generations(lm: Any, prompts: list[str] = PROMPTS, max_tokens: int = MAX_TOKENS) -> list[Generation]:
    """Greedy generations with top-k log-probabilities from an engine opened by engine.open_engine."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=TOP_K)
    outputs = lm.model.generate(prompts, params, use_tqdm=False)
    return [
        Generation(
            list(o.prompt_token_ids),
            list(o.outputs[0].token_ids),
            [{tid: lp.logprob for tid, lp in pos.items()} for pos in o.outputs[0].logprobs],
        )
        for o in outputs
    ]


def compare_with_transformers(
    checkpoint: Path,
    generations: list[Generation],
    tolerance: Tolerance,
    trust_remote_code: bool = False,
    baseline: Path | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Teacher-force vLLM's tokens through transformers and measure the divergence: the checkpoint in
    `dtype` (float32, or bfloat16 for the schemes transformers runs only in it: catalog.transformers_dtype),
    the baseline in float32. With `baseline`, also the mean KL divergence of the baseline's next-token
    distributions from the checkpoint's on the same tokens: a screening number beside the gate, never a gate."""
    quantized = _teacher_forced(checkpoint, generations, trust_remote_code, dtype)
    result = _divergence(quantized, generations, tolerance) | {"dtype": dtype}
    if baseline is not None:
        result["kl_to_baseline"] = _mean_kl(_teacher_forced(baseline, generations, trust_remote_code, "float32"), quantized)
    return result


def _teacher_forced(model_path: Path, generations: list[Generation], trust_remote_code: bool, dtype: str) -> list[Any]:
    """Per generation: transformers' log-probabilities at each generated position."""
    from qserve.engines.in_transformers import teacher_forced

    return teacher_forced(model_path, [(g.prompt_ids, g.token_ids) for g in generations], trust_remote_code, dtype)


def _mean_kl(baseline: list[Any], quantized: list[Any]) -> dict[str, Any]:
    """KL(baseline || quantized) per position, averaged: how far quantization moved the model's
    predictions. Near zero it loses meaning (engine noise is of the same size), so it only screens."""
    import torch

    per_position = torch.cat([(b.exp() * (b - q)).sum(-1) for b, q in zip(baseline, quantized)])
    return {
        "mean_nats": round(float(per_position.mean()), 6),
        "positions": int(per_position.numel()),
        "note": "screening number, not a gate: transformers on vLLM's greedy tokens, baseline vs checkpoint",
    }


def _divergence(quantized: list[Any], generations: list[Generation], tolerance: Tolerance) -> dict[str, Any]:
    diffs: list[float] = []
    agree = shortfall = 0.0
    positions = 0
    for logprobs, gen in zip(quantized, generations):
        for j, (token, top) in enumerate(zip(gen.token_ids, gen.top_logprobs)):
            row = logprobs[j]
            agree += int(int(row.argmax()) == token)
            shortfall = max(shortfall, float(row.max() - row[token]))
            diffs += [abs(lp - float(row[tid])) for tid, lp in top.items()]
            positions += 1
    return _judge(
        positions,
        agree / max(positions, 1),
        statistics.fmean(diffs) if diffs else 0.0,
        max(diffs, default=0.0),
        shortfall,
        tolerance,
    )


def _judge(
    positions: int, agreement: float, mean_diff: float, max_diff: float, shortfall: float, tol: Tolerance
) -> dict[str, Any]:
    problems = []
    if mean_diff > tol.max_mean_abs_logprob_diff:
        problems.append(f"mean |Δ logprob| {mean_diff:.3f} > {tol.max_mean_abs_logprob_diff}")
    if agreement < tol.min_top1_agreement:
        problems.append(f"greedy-token agreement {agreement:.1%} < {tol.min_top1_agreement:.0%}")
    status = "fail" if problems else "pass"
    summary = "; ".join(problems) or f"mean |Δ logprob| {mean_diff:.3f}, greedy-token agreement {agreement:.1%}"
    return {
        "status": status,
        "reason": summary,
        "positions": positions,
        "top1_agreement": round(agreement, 4),
        "mean_abs_logprob_diff": round(mean_diff, 5),
        "max_abs_logprob_diff": round(max_diff, 5),
        "max_greedy_shortfall": round(shortfall, 5),
        "tolerance": asdict(tol),
    }


def tolerance_for(activations: str, kv_cache_dtype: str = "auto") -> Tolerance:
    if activations != "fp16":
        return TOLERANCES["activation"]
    return TOLERANCES["exact" if kv_cache_dtype == "auto" else "kv_cache"]
