"""`--limit N` scores a seeded random sample of each task's documents (evaluate/lm_eval_run.py), not the
first N in file order: the expected ids are computed here from the rule as the docs state it."""

from __future__ import annotations

import json

import pytest
from conftest import DATA_DIR, expected_order

from qserve.evaluate.lm_eval_run import Window
from qserve.evaluate.tasks import get_tasks, lm_eval_config
from qserve.gate import looks

TASK = "gsm8k_ppl"


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
