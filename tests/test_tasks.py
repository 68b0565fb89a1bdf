"""The evals/ registry builds real lm-eval tasks from local files (no engine, no hub)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import DATA_DIR, gsm8k_ppl_words

from qserve.errors import QserveError
from qserve.evaluate.tasks import get_tasks, lm_eval_config, task_counts

ARC = [
    ("Which gas do plants take in from the air?", ["oxygen", "carbon dioxide", "helium", "neon"], "B"),
    ("What is frozen water called?", ["steam", "ice", "sand", "salt"], "B"),
]


def _task(name: str, data_dir: Path):
    from lm_eval.api.task import ConfigurableTask

    return ConfigurableTask(config=lm_eval_config(get_tasks([name])[0], data_dir))


def test_lm_eval_multiple_choice_task_from_local_files(tmp_path: Path) -> None:
    # lm-eval's own arc_easy config, reading a local file with the hub dataset's fields.
    (tmp_path / "arc_easy").mkdir()
    with (tmp_path / "arc_easy" / "test.jsonl").open("w") as f:
        for i, (q, choices, key) in enumerate(ARC):
            f.write(
                json.dumps({"id": str(i), "question": q, "choices": {"text": choices, "label": list("ABCD")}, "answerKey": key})
                + "\n"
            )
    task = _task("arc_easy", tmp_path)
    docs = list(task.test_docs())
    assert task.OUTPUT_TYPE == "multiple_choice" and len(docs) == 2
    assert task.doc_to_text(docs[0]) == "Question: Which gas do plants take in from the air?\nAnswer:"
    assert task.doc_to_choice(docs[1]) == ["steam", "ice", "sand", "salt"] and task.doc_to_target(docs[1]) == 1


def test_gsm8k_multiple_choice_distractors() -> None:
    task = _task("gsm8k_mc", DATA_DIR)
    doc = next(iter(task.test_docs()))
    answer = int(doc["answer"].split("#### ")[-1].replace(",", ""))
    assert task.doc_to_choice(doc) == [str(answer), str(answer + 1), str(answer - 1), str(answer + 10)]
    assert task.doc_to_target(doc) == 0


def test_a_perplexity_task_weighs_its_documents_by_the_words_and_bytes_lm_eval_counts() -> None:
    """gsm8k_ppl scores "Question: ...\nAnswer: ..." per test document; its words (counted here from the
    jsonl as lm-eval's count_words does: whitespace runs) and UTF-8 bytes weight its three perplexities'
    bets. gsm8k reports no perplexity."""
    words = gsm8k_ppl_words()
    rows = [json.loads(line) for line in (DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()]
    size = {i: float(len(f"Question: {r['question']}\nAnswer: {r['answer']}".encode())) for i, r in enumerate(rows)}
    counts = task_counts(lm_eval_config(get_tasks(["gsm8k_ppl"])[0], DATA_DIR))
    assert counts == {"word_perplexity": dict(enumerate(words)), "byte_perplexity": size, "bits_per_byte": size}
    assert len(words) == 1319 and max(size.values()) > 2 * max(words)  # bytes, not words
    assert task_counts(lm_eval_config(get_tasks(["gsm8k"])[0], DATA_DIR)) == {}


def test_a_data_file_rewritten_with_its_old_mtime_is_read_again(tmp_path: Path) -> None:
    """datasets keys a data file's cache by its path and mtime: a file whose content changed but whose mtime
    did not (cp -p, rsync -t, an archive) used to be read from the old cache, while the baseline's key
    hashed the new content. qserve gives each content its own datasets cache."""
    import os

    from lm_eval.api.task import ConfigurableTask

    data = tmp_path / "gsm8k" / "test.jsonl"
    data.parent.mkdir()
    rows = [json.loads(line) for line in (DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()[:3]]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (task,) = get_tasks(["gsm8k_ppl"])
    first = ConfigurableTask(config=lm_eval_config(task, tmp_path)).eval_docs[0]
    assert first == rows[0]
    mtime = data.stat().st_mtime_ns
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[::-1]))
    os.utime(data, ns=(mtime, mtime))
    assert ConfigurableTask(config=lm_eval_config(task, tmp_path)).eval_docs[0] == rows[2]


def test_missing_task_data_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(QserveError, match=r"task arc_easy needs .*arc_easy/test.jsonl, which does not exist"):
        lm_eval_config(get_tasks(["arc_easy"])[0], tmp_path)


def test_each_base_task_is_read_from_the_yaml_lm_evals_own_index_names() -> None:
    """qserve's cached copy of lm-eval's task index is TaskManager's own: every name, and for the tasks
    evals/ builds on, the same YAML file."""
    from lm_eval.tasks import TaskManager

    from qserve.evaluate.tasks import TaskIndex, registry

    index = TaskManager().task_index
    cached = TaskIndex().entries
    bases = sorted({t.lm_eval_task for t in registry().values() if t.lm_eval_task})
    assert bases == ["arc_easy", "gsm8k"]
    assert {name: Path(cached[name]["yaml_path"]) for name in bases} == {name: Path(index[name].yaml_path) for name in bases}
    assert set(cached) == set(index) and "no_such_task" not in cached
