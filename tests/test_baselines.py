"""The baseline cache key: everything that determines a baseline score, and nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qserve.evaluate import baselines


@pytest.fixture
def isolated_cache(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("QSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def _config(data: Path, fewshot: int = 5) -> dict:
    return {"task": "t", "num_fewshot": fewshot, "dataset_kwargs": {"data_files": {"test": str(data)}}, "filter": print}


def test_key_tracks_what_determines_the_score(isolated_cache: Path) -> None:
    data = isolated_cache / "test.jsonl"
    data.write_text('{"q": 1}\n')
    engine = {"pretrained": "/a", "dtype": "float32"}
    key = baselines.task_key("m1", _config(data), 10, engine, "cpu")
    assert key == baselines.task_key("m1", _config(data), 10, engine, "cpu")  # stable across calls
    # The model's path is not part of it (the content hash is); the data file's content is.
    assert key == baselines.task_key("m1", _config(data), 10, engine | {"pretrained": "/b"}, "cpu")
    changed = [
        baselines.task_key("m2", _config(data), 10, engine, "cpu"),
        baselines.task_key("m1", _config(data, fewshot=0), 10, engine, "cpu"),
        baselines.task_key("m1", _config(data), 20, engine, "cpu"),
        baselines.task_key("m1", _config(data), 10, engine | {"dtype": "bfloat16"}, "cpu"),
        baselines.task_key("m1", _config(data), 10, engine, "cuda"),
    ]
    assert all(k != key for k in changed)
    data.write_text('{"q": 2}\n')
    assert baselines.task_key("m1", _config(data), 10, engine, "cpu") != key


def test_store_lookup_and_damaged_entries(isolated_cache: Path) -> None:
    data = isolated_cache / "test.jsonl"
    data.write_text("{}\n")
    key = baselines.task_key("m", _config(data), None, {}, "cpu")
    assert baselines.lookup(key) is None
    path = baselines.store(key, {"results": {"acc,none": 0.5}}, {"acc,none": {"0": 1.0}})
    assert baselines.lookup(key)["items"] == {"acc,none": {"0": 1.0}}
    path.write_text("{not json")  # a damaged entry is a miss, never a crash or a wrong score
    assert baselines.lookup(key) is None
    path.write_text(json.dumps({"key": {**key, "limit": 3}, "result": {}, "items": {}}))
    assert baselines.lookup(key) is None  # an entry must carry exactly the requested key


def test_model_digest_follows_content(isolated_cache: Path) -> None:
    model = isolated_cache / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"abc")
    first = baselines.model_digest(model)
    assert baselines.model_digest(model) == first
    (model / "model.safetensors").write_bytes(b"abd")
    assert baselines.model_digest(model) != first
