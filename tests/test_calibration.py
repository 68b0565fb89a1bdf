"""Calibration sources: local files in four formats, chat messages, mixes, HF ids, self-generated text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import DATA_DIR

from qserve.errors import QserveError
from qserve.quantize.calibration import load_texts, split_by_weight
from qserve.spec.recipe import CalibrationSpec

ROWS = [{"text": f"sample number {i}", "q": f"question {i}"} for i in range(6)]


def spec(**kw) -> CalibrationSpec:
    return CalibrationSpec.model_validate({"samples": 3, "seq_len": 64} | kw)


def write(tmp_path: Path, fmt: str) -> Path:
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif fmt == "json":
        path.write_text(json.dumps(ROWS))
    elif fmt == "txt":
        path.write_text("\n\n".join(r["text"] for r in ROWS) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), path)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "txt", "parquet"])
def test_local_formats_give_the_same_samples(tmp_path: Path, fmt: str) -> None:
    path = write(tmp_path, fmt)
    texts, record = load_texts(spec(path=str(path)), tmp_path)
    assert len(texts) == 3 and all(t.startswith("sample number ") for t in texts)
    (source,) = record["sources"]
    assert source["records"] == 6 and source["path"] == str(path) and len(source["file_sha256"]) == 64
    # The same seed draws the same records whatever the container format.
    (tmp_path / "j").mkdir()
    assert texts == load_texts(spec(path=str(write(tmp_path / "j", "jsonl"))), tmp_path)[0]


def test_seed_changes_the_draw_and_is_recorded(tmp_path: Path) -> None:
    path = write(tmp_path, "jsonl")
    a, rec_a = load_texts(spec(path=str(path), seed=0), tmp_path)
    b, rec_b = load_texts(spec(path=str(path), seed=1), tmp_path)
    assert a != b and rec_a["content_sha256"] != rec_b["content_sha256"] and rec_b["seed"] == 1


def test_chat_messages_get_the_models_chat_template(tmp_path: Path, embedded_model_dir: Path) -> None:
    path = tmp_path / "chat.jsonl"
    rows = [{"conv": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts, record = load_texts(spec(path=str(path), messages="conv", samples=2), tmp_path, embedded_model_dir)
    assert all("<|im_start|>user\nhi " in t and "<|im_start|>assistant\nhello " in t for t in texts)
    assert record["sources"][0]["messages_field"] == "conv"


def test_bad_chat_field_is_one_clear_error(tmp_path: Path, embedded_model_dir: Path) -> None:
    path = write(tmp_path, "jsonl")
    with pytest.raises(
        QserveError, match=r"record \d+ of .*data.jsonl: field 'text' must be a list of \{role, content\} messages"
    ):
        load_texts(spec(path=str(path), messages="text"), tmp_path, embedded_model_dir)


def test_weighted_mix_splits_samples_and_records_each_source(tmp_path: Path) -> None:
    a, b = write(tmp_path, "jsonl"), tmp_path / "b.json"
    b.write_text(json.dumps([{"text": f"other {i}"} for i in range(10)]))
    texts, record = load_texts(spec(samples=8, mix=[{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1}]), tmp_path)
    assert [s["samples"] for s in record["sources"]] == [6, 2]
    assert sum(t.startswith("other") for t in texts) == 2 and record["samples"] == 8


def test_split_by_weight_is_exact() -> None:
    assert split_by_weight(10, [1, 1, 1]) == [4, 3, 3]
    assert sum(split_by_weight(7, [0.5, 0.25, 0.25])) == 7


def test_shipped_source_and_template(tmp_path: Path) -> None:
    texts, record = load_texts(spec(source="gsm8k-train", samples=2), DATA_DIR)
    assert all(t.startswith("Question: ") and "\nAnswer: " in t for t in texts)
    assert record["sources"][0]["source"] == "gsm8k-train"


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        ({"path": "nowhere/x.jsonl"}, "calibration data .*nowhere/x.jsonl does not exist"),
        ({"path": "data.csv"}, "unsupported format '.csv'; use one of .jsonl, .json, .txt, .parquet"),
        ({"path": "data.jsonl", "samples": 50}, "has 6 records; the recipe asks for 50"),
        ({"path": "data.jsonl", "text": "{missing}"}, "names field 'missing', which record"),
    ],
)
def test_file_mistakes(tmp_path: Path, kw: dict, error: str) -> None:
    write(tmp_path, "jsonl")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(QserveError, match=error):
        load_texts(spec(**kw), tmp_path)


def test_corrupt_parquet_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "d.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(QserveError, match="not a readable parquet file"):
        load_texts(spec(path="d.parquet"), tmp_path)


def test_hub_dataset_offline_is_one_clear_error(tmp_path: Path, monkeypatch) -> None:
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # fail at once rather than after network retries
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    # The libraries read the variables once, at import; an earlier test may have imported them (then
    # this test waited ~20 s for the retries).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(QserveError, match=r"could not load calibration dataset openai/gsm8k \(main\) split train: "):
        load_texts(spec(dataset="openai/gsm8k", subset="main", text="{question}"), tmp_path)


def test_self_generated_text_is_seeded_and_recorded(embedded_model_dir: Path) -> None:
    gen = {"prompts": ["Tell me about cats.", "Count to five."], "max_new_tokens": 12}
    texts, record = load_texts(spec(generate=gen, samples=2), DATA_DIR, embedded_model_dir)
    again, _ = load_texts(spec(generate=gen, samples=2), DATA_DIR, embedded_model_dir)
    assert texts == again  # seeded sampling: reruns calibrate on the same text
    assert "Tell me about cats." in texts[0] and "Count to five." in texts[1]
    assert all(len(t) > len("<|im_start|>user\nCount to five.<|im_end|>\n<|im_start|>assistant\n") for t in texts)
    source = record["sources"][0]
    assert source["kind"] == "generate" and source["max_new_tokens"] == 12 and len(source["prompts_sha256"]) == 64
