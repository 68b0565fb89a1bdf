"""`--limit N` scores a seeded random sample of each task's documents (evaluate/lm_eval_run.py), not the
first N in file order: the expected ids are computed here from the rule as the docs state it, uniform
on gsm8k, size-biased by words on gsm8k_ppl (a word-perplexity task)."""

from __future__ import annotations

import json

import pytest
from conftest import DATA_DIR, expected_order, expected_weighted_order, gsm8k_ppl_words

from qserve.errors import QserveError
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


def test_a_groups_tasks_take_a_prefix_of_the_groups_pooled_order(config: dict) -> None:
    """The tasks of a group gated as one take the first N of one order of the group's items (docs/gates.md:
    `task/doc id` sorted by sha256 of "0<NUL>group<NUL>task/id"): N items of the group, not N per task; a
    larger N and a later block continue it; a task may get none; the baseline cache tells them apart."""
    import hashlib

    from qserve.gate.core import Group

    other = config | {"task": "gsm8k_again"}
    group = Group("g", (TASK, "gsm8k_again"), (("exact_match,strict-match", True),))
    keys = [f"{t}/{i}" for t in (TASK, "gsm8k_again") for i in range(1319)]
    order = sorted(keys, key=lambda k: hashlib.sha256(f"0\0g\0{k}".encode()).digest())

    def split(block: list[str]) -> dict[str, tuple[int, ...]]:
        return {
            t: tuple(sorted(int(k.rpartition("/")[2]) for k in block if k.rpartition("/")[0] == t)) for t in (TASK, "gsm8k_again")
        }

    window = Window.select(100, 0, [config, other], {"g": group})
    assert window.ids == split(order[:100]) and sum(map(len, window.ids.values())) == 100
    assert window.block(40).ids == split(order[40:100]) and window.block(40).offset == 40
    assert Window.select(60, 100, [config, other], {"g": group}).ids == split(order[100:160])
    alone = Window.select(100, 0, [config])
    assert window.key(TASK) != alone.key(TASK) and window.key(TASK).startswith(alone.key(TASK))
    first = Window.select(1, 0, [config, other], {"g": group})
    assert first.scored() == {order[0].rpartition("/")[0]}  # the other task has no item: it is left out of the run
    with pytest.raises(ValueError, match="leave them out of the run"):
        first.lm_eval([TASK, "gsm8k_again"])
    with pytest.raises(QserveError, match="^task gsm8k is in both groups g and h; with --limit each group samples its own"):
        Window.select(100, 0, [config, other], {"g": group, "h": Group("h", (TASK,), group.aggregate)})
