"""`--limit N` scores a seeded random sample of each task's documents (evaluate/lm_eval_run.py), not the
first N in file order: the expected ids are computed here from the rule as the docs state it, uniform
on gsm8k, size-biased by words on gsm8k_ppl (a word-perplexity task)."""

from __future__ import annotations

import json

import pytest
from conftest import DATA_DIR, expected_order, expected_weighted_order, gsm8k_ppl_words

from qserve.evaluate.lm_eval_run import Window
from qserve.evaluate.tasks import get_tasks, lm_eval_config
from qserve.gate import looks

TASK = "gsm8k"
PPL = "gsm8k_ppl"


@pytest.fixture(scope="module")
def config() -> dict:
    return lm_eval_config(get_tasks([TASK])[0], DATA_DIR)


def test_a_limit_takes_the_first_n_of_the_seeded_order_and_a_larger_one_continues_it(config: dict) -> None:
    size = len((DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines())
    order = expected_order(TASK, size)
    small, large = Window.select(50, 0, [config]), Window.select(100, 0, [config])
    assert small.ids == {TASK: tuple(sorted(order[:50]))}
    assert large.ids == {TASK: tuple(sorted(order[:100]))}
    assert set(small.ids[TASK]) < set(large.ids[TASK])
    assert large.lm_eval([TASK]) == {"samples": {TASK: sorted(order[:100])}}  # simple_evaluate's keyword
    # tune's held-out window: the next 100 of the same order, none of the first
    held_out = Window.select(100, 100, [config])
    assert held_out.ids == {TASK: tuple(sorted(order[100:200]))}
    assert not set(held_out.ids[TASK]) & set(large.ids[TASK])
    # a sample, not a prefix: the ids reach across the file (a prefix of 100 would end at id 99)
    assert max(large.ids[TASK]) > size / 2 and min(large.ids[TASK]) < size / 2
    assert Window.select(None, 0, [config]).lm_eval([TASK]) == {}  # every document, as lm-eval's default


def test_a_word_perplexity_task_takes_its_documents_size_biased_by_words() -> None:
    """gsm8k_ppl's --limit takes the first N of the exponential race on the documents' words (betting.py
    says why): a larger limit and an offset continue it, and its first 100 documents are longer than the
    task's average, as a size-biased sample is."""
    words = gsm8k_ppl_words()
    order = expected_weighted_order(PPL, words)
    config = lm_eval_config(get_tasks([PPL])[0], DATA_DIR)
    small, large, held_out = (Window.select(n, k, [config]) for n, k in ((50, 0), (100, 0), (100, 100)))
    assert small.ids == {PPL: tuple(sorted(order[:50]))} and large.ids == {PPL: tuple(sorted(order[:100]))}
    assert held_out.ids == {PPL: tuple(sorted(order[100:200]))}
    assert large.counts[PPL]["word_perplexity"] == dict(enumerate(words)) and large.sizes == {PPL: 1319}
    assert sum(words[i] for i in order[:100]) / 100 > 1.1 * sum(words) / len(words)
    assert Window.select(None, 0, [config]).counts[PPL]["word_perplexity"] == dict(
        enumerate(words)
    )  # the gate's weights, unlimited


def test_a_window_that_skipped_selection_is_refused() -> None:
    with pytest.raises(ValueError, match="build it with Window.select"):
        Window(100).lm_eval([TASK])


def test_a_look_in_file_order_is_not_the_same_items_as_a_seeded_one() -> None:
    """Looks recorded before the seeded order (no `order`) scored the first items in file order: another look."""
    old = {"tasks": [TASK], "limit": 100, "offset": 0, "decided_at": "2026-12-01T00:00:00+00:00"}
    seeded = {"tasks": [TASK], "limit": 100, "offset": 0, "order": "sha256(0, task, doc id)"}
    assert looks.number([old], seeded) == (2, True)
    assert looks.number([old, seeded | {"decided_at": "2026-12-02T00:00:00+00:00"}], seeded) == (2, False)
    assert json.loads(looks.evidence(old))[-1] is None
