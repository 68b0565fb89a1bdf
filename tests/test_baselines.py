"""The baseline cache key: everything that determines a baseline score, and nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qserve.checkpoint.hashing import model_digest
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
    key = baselines.task_key("m1", _config(data), 10, engine, "cpu", scoring=None, lm_eval={})
    assert key == baselines.task_key("m1", _config(data), 10, engine, "cpu", scoring=None, lm_eval={})  # stable across calls
    # The model's path is not part of it (the content hash is); the data file's content is.
    assert key == baselines.task_key("m1", _config(data), 10, engine | {"pretrained": "/b"}, "cpu", scoring=None, lm_eval={})
    changed = [
        baselines.task_key("m2", _config(data), 10, engine, "cpu", scoring=None, lm_eval={}),
        baselines.task_key("m1", _config(data, fewshot=0), 10, engine, "cpu", scoring=None, lm_eval={}),
        baselines.task_key("m1", _config(data), 20, engine, "cpu", scoring=None, lm_eval={}),
        baselines.task_key("m1", _config(data), 10, engine | {"dtype": "bfloat16"}, "cpu", scoring=None, lm_eval={}),
        baselines.task_key("m1", _config(data), 10, engine, "cuda", scoring=None, lm_eval={}),
    ]
    assert all(k != key for k in changed)
    data.write_text('{"q": 2}\n')
    assert baselines.task_key("m1", _config(data), 10, engine, "cpu", scoring=None, lm_eval={}) != key


def test_store_lookup_and_damaged_entries(isolated_cache: Path) -> None:
    data = isolated_cache / "test.jsonl"
    data.write_text("{}\n")
    key = baselines.task_key("m", _config(data), None, {}, "cpu", scoring=None, lm_eval={})
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
    first = model_digest(model)
    assert model_digest(model) == first
    (model / "model.safetensors").write_bytes(b"abd")
    assert model_digest(model) != first


def test_key_covers_torch_transformers_and_the_device_in_detail(isolated_cache: Path, monkeypatch) -> None:
    from qserve.device.detect import Device, fingerprint

    data = isolated_cache / "test.jsonl"
    data.write_text("{}\n")
    real = baselines.library_versions()
    key = baselines.task_key("m", _config(data), 10, {}, "cpu: A; avx2", scoring=None, lm_eval={})
    assert (key["torch"], key["transformers"]) == (real["torch"], real["transformers"])
    for name in ("torch", "transformers", "lm-eval"):
        monkeypatch.setattr(baselines, "library_versions", lambda n=name: real | {n: "0.0.0"})
        assert baselines.task_key("m", _config(data), 10, {}, "cpu: A; avx2", scoring=None, lm_eval={}) != key, name
    monkeypatch.undo()
    assert baselines.task_key("m", _config(data), 10, {}, "cpu: A; avx2 avx512f", scoring=None, lm_eval={}) != key  # another ISA
    assert fingerprint(Device("cuda", "NVIDIA H100 (compute capability 9.0)")) == "cuda: NVIDIA H100 (compute capability 9.0)"
    here = fingerprint(Device("cpu", "vLLM CPU build"))
    assert here.startswith("cpu: ") and "avx2" in here.split("; ")[1].split()


def _keys_around_an_edit(folder: Path, monkeypatch, function: str, before: str, after: str, key_of) -> tuple[dict, dict]:
    """`key_of(fn)` for a same-named function in a module of its own, before and after its body is
    edited and the module reloaded (each key taken while that source is on disk)."""
    import importlib
    import sys

    name = f"qserve_test_{function}"
    code = folder / f"{name}.py"
    code.write_text(f"def {function}(*args):\n    {before}\n")
    monkeypatch.syspath_prepend(str(folder))
    first = key_of(getattr(importlib.import_module(name), function))
    code.write_text(f"def {function}(*args):\n    {after}\n")
    second = key_of(getattr(importlib.reload(sys.modules[name]), function))
    del sys.modules[name]
    return first, second


def test_key_follows_the_code_of_a_function_hook(isolated_cache: Path, monkeypatch) -> None:
    data = isolated_cache / "test.jsonl"
    data.write_text("{}\n")
    key, edited = _keys_around_an_edit(
        isolated_cache,
        monkeypatch,
        "process_docs",
        "return args[0]",
        "return args[0].select(range(1))",  # same name, other behaviour
        lambda hook: baselines.task_key("m", _config(data) | {"process_docs": hook}, None, {}, "cpu", scoring=None, lm_eval={}),
    )
    assert edited != key


def test_key_follows_the_code_of_qserve_scoring(isolated_cache: Path, monkeypatch) -> None:
    """A change to how qserve scores (the function that makes its lm-eval model class) makes every
    cached baseline miss, as an edited hook does (test_demo checks that eval passes qserve's own)."""
    data = isolated_cache / "test.jsonl"
    data.write_text("{}\n")
    key, edited = _keys_around_an_edit(
        isolated_cache,
        monkeypatch,
        "lm_eval_vllm_class",
        "return 'sum of log-probabilities'",
        "return 'mean of log-probabilities'",  # same name, other scores
        lambda scoring: baselines.task_key("m", _config(data), None, {}, "cpu", scoring=scoring, lm_eval={}),
    )
    assert key != baselines.task_key("m", _config(data), None, {}, "cpu", scoring=None, lm_eval={})
    assert edited != key


def test_model_digest_reads_content_not_size_and_mtime(isolated_cache: Path) -> None:
    import os

    model = isolated_cache / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = model / "model.safetensors"
    weights.write_bytes(b"abc")
    first = model_digest(model)
    stat = weights.stat()
    weights.write_bytes(b"xyz")  # same size ...
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ... and the same mtime
    assert model_digest(model) != first


def test_a_baseline_that_is_no_working_language_model_is_refused_in_one_line() -> None:
    """The issue's case: a model evaluated through a broken tokenizer scored a word perplexity of 4e13."""
    from qserve.errors import QserveError
    from qserve.evaluate.baselines import check_sane

    check_sane("m", "gsm8k_ppl", "word_perplexity,none", 35.7)  # SmolLM2-135M's, as the demo measures it
    check_sane("m", "gsm8k", "exact_match,strict-match", 0.0)  # a tiny model solving nothing is no broken model
    for score in (4e13, float("nan"), 1000.5):
        with pytest.raises(QserveError) as e:
            check_sane("m", "gsm8k_ppl", "word_perplexity,none", score)
        assert str(e.value) == (
            f"the baseline m does not look like a working language model on gsm8k_ppl: word_perplexity {score:.4g}, where a "
            "trained model gives at most 1000 (check its tokenizer and weights); nothing was gated against it"
        )
