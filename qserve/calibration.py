"""Calibration samples from a local jsonl file, with a record of exactly what was used."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from qserve.errors import QserveError
from qserve.recipe import CalibrationSpec


def resolve_path(spec: CalibrationSpec, data_dir: Path) -> Path:
    path = Path(spec.path).expanduser()
    path = path if path.is_absolute() else data_dir / path
    if not path.is_file():
        raise QserveError(
            f"calibration data {path} does not exist (relative paths resolve against --data-dir / QSERVE_DATA_DIR, now {data_dir})"
        )
    return path


def load_texts(spec: CalibrationSpec, data_dir: Path) -> tuple[list[str], dict[str, Any]]:
    """Sample `spec.samples` records, render them with `spec.text`; return texts and their record."""
    path = resolve_path(spec, data_dir)
    records = _read_jsonl(path)
    if len(records) < spec.samples:
        raise QserveError(f"calibration data {path} has {len(records)} records; the recipe asks for {spec.samples}")
    chosen = sorted(random.Random(spec.seed).sample(range(len(records)), spec.samples))
    texts = [_render(spec.text, records[i], path, i) for i in chosen]
    content = hashlib.sha256("\x1e".join(texts).encode()).hexdigest()
    record = {
        "path": str(path),
        "file_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "records_in_file": len(records),
        "samples": spec.samples,
        "seq_len": spec.seq_len,
        "seed": spec.seed,
        "template": spec.text,
        "content_sha256": content,
    }
    return texts, record


def tokenized_dataset(texts: list[str], tokenizer: Any, seq_len: int) -> Any:
    """A datasets.Dataset of input_ids/attention_mask, truncated to seq_len, as oneshot expects."""
    from datasets import Dataset

    enc = tokenizer(texts, truncation=True, max_length=seq_len, add_special_tokens=False)
    return Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise QserveError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise QserveError(f"{path}:{n}: each line must be a JSON object")
            records.append(obj)
    if not records:
        raise QserveError(f"calibration data {path} is empty")
    return records


def _render(template: str, record: dict, path: Path, index: int) -> str:
    try:
        return template.format(**record)
    except KeyError as exc:
        raise QserveError(
            f"calibration template {template!r} names field {exc.args[0]!r}, which record {index + 1} of {path} lacks (fields: {', '.join(record)})"
        ) from None
