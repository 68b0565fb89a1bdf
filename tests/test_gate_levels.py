"""Every bound the gate passes on keeps its level: seeded simulation through qserve's own bounds.

At exactly the allowance a one-sided 95 % bound may pass at most 5 % of samples; the test allows
three Monte-Carlo standard errors on top. The shapes span near-constant to strongly skewed and
heavy-tailed per-item losses (qserve/gate/levels.py). A bound that is too optimistic at any
n, for any shape, fails here: the BCa bootstrap qserve used before passed lognormal-1.5 samples
at n = 100 about 19 % of the time.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest

from qserve.gate import levels, looks, paired_binary, stats
from qserve.gate.spending import min_items

DRAWS = 2000


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return levels.simulate(DRAWS)


BINARY_DRAWS = 1000  # each 0/1 cell bets on up to 5,000 items per draw: half the draws keep the file under a minute


@pytest.fixture(scope="module")
def binary_rows() -> list[dict]:
    return levels.simulate_binary(BINARY_DRAWS)


def test_the_simulation_covers_every_bound_shape_and_n(rows, binary_rows) -> None:
    cells = {(r["bound"], r["shape"], r["n"]) for r in rows}
    assert len(cells) == len(rows) == 2 * len(levels.SHAPES) * len(levels.SIZES)
    assert {2, 3, 5, 10, 20, 50, 100, 200} <= set(levels.SIZES) and len(levels.SHAPES) >= 8
    grid = {(r["n"], r["allowance"], r["gained"]) for r in binary_rows}
    assert len(grid) == len(binary_rows) == 7 * 4 * 6
    assert {r["n"] for r in binary_rows} >= {50, 5000} and {r["allowance"] for r in binary_rows} >= {0.01, 0.10}
    assert {r["gained"] for r in binary_rows} >= {0.0, 0.40}


def test_a_first_look_keeps_its_own_level_and_uses_it(rows) -> None:
    """A first look spends 6/pi^2 of the 5 % (3.04 %): every bound's false-pass stays within that
    (3 Monte-Carlo SE), and some bound comes near it (it decides, rather than keeping the level by never passing)."""
    level = looks.level(1)
    assert level == pytest.approx(0.05 * 6 / math.pi**2) and {r["level"] for r in rows} == {level}
    too_often = [r for r in rows if r["false_pass"] > levels.limit(DRAWS, level)]
    assert too_often == [], f"false-pass above {levels.limit(DRAWS, level):.2%}: {too_often}"
    assert levels.limit(DRAWS) == pytest.approx(0.05 + 3 * math.sqrt(0.05 * 0.95 / DRAWS))
    assert max(r["false_pass"] for r in rows) > level / 2


def test_the_0_1_gate_keeps_5_percent_over_every_look(binary_rows) -> None:
    """0/1 gates bet at 5 % over every look: a model at the allowance passes within n items at most 5 %
    of the time (3 Monte-Carlo SE) over n 50-5,000, flips 0-40 % each way and allowances 1-10 points.
    Each cell is a run stopped at its first decision, so n is any stopping rule's reach."""
    assert {r["level"] for r in binary_rows} == {0.05}
    too_often = [r for r in binary_rows if r["false_pass"] > levels.limit(BINARY_DRAWS, 0.05)]
    assert too_often == [], f"false-pass above {levels.limit(BINARY_DRAWS, 0.05):.2%}: {too_often}"


def test_the_0_1_gate_passes_good_models_at_the_n_users_run(binary_rows) -> None:
    """No true loss, 5 % of items flipping each way, on a task much larger than n: 5,000 items decide
    2 points most of the time and 1,000 items decide 5 points; power grows with n in every row."""
    cell = {(r["n"], r["allowance"], r["gained"]): r["power"] for r in binary_rows}
    assert cell[(5000, 0.02, 0.05)] > 0.8 and cell[(1000, 0.05, 0.05)] > 0.9 and cell[(200, 0.10, 0.05)] > 0.8
    for allowance in levels.BINARY_ALLOWANCES:
        for gained in levels.BINARY_GAINED:
            row = [cell[(n, allowance, gained)] for n in levels.BINARY_SIZES]
            assert row == sorted(row), (allowance, gained, row)


WORD_DRAWS = 1000  # each cell bets on up to 5,000 documents per draw, as the 0/1 cells do


@pytest.fixture(scope="module")
def word_rows() -> list[dict]:
    return levels.simulate_word_perplexity(WORD_DRAWS)


def test_word_perplexity_keeps_5_percent_over_every_look_for_every_shape_within_the_cap(word_rows) -> None:
    """Word perplexity as qserve eval bets on it (size-biased documents, the log 2 cap): a model at the
    allowance passes within n documents at most 5 % of the time (3 Monte-Carlo SE), n 50-5,000, on every
    shape of stats.py's class and on the two outside it (1 % of documents carrying the loss, a tail
    without a variance), which betting's class (any distribution within the cap) takes in."""
    shapes = [s.name for s in levels.SHAPES + levels.OUTSIDE]
    assert {(r["shape"], r["n"]) for r in word_rows} == {(s, n) for s in shapes for n in levels.BINARY_SIZES}
    too_often = [r for r in word_rows if r["false_pass"] > levels.limit(WORD_DRAWS, 0.05)]
    assert too_often == [], f"false-pass above {levels.limit(WORD_DRAWS, 0.05):.2%}: {too_often}"


def test_word_perplexity_passes_a_model_at_half_the_allowance_by_500_documents(word_rows) -> None:
    """Power: at half the allowance every shape passed all 1,000 runs by 500 documents (measured;
    asserted at 95 %), and power grows with n."""
    for shape in dict.fromkeys(r["shape"] for r in word_rows):
        row = [r["power"] for r in word_rows if r["shape"] == shape]
        assert row == sorted(row), (shape, row)
        assert dict(zip(levels.BINARY_SIZES, row))[500] >= 0.95, (shape, row)


@pytest.fixture(scope="module")
def item_rows() -> list[dict]:
    return levels.simulate_item_perplexity(WORD_DRAWS)


def test_lambadas_perplexity_keeps_5_percent_over_every_look_for_every_shape_within_its_cap(item_rows) -> None:
    """lambada's perplexity as qserve eval bets on it (per item, the log 100 cap): a model at the
    allowance passes within n items at most 5 % of the time (3 Monte-Carlo SE), n 50-5,000, on every
    shape the word-perplexity table shows."""
    shapes = [s.name for s in levels.SHAPES + levels.OUTSIDE]
    assert {(r["shape"], r["n"]) for r in item_rows} == {(s, n) for s in shapes for n in levels.BINARY_SIZES}
    too_often = [r for r in item_rows if r["false_pass"] > levels.limit(WORD_DRAWS, 0.05)]
    assert too_often == [], f"false-pass above {levels.limit(WORD_DRAWS, 0.05):.2%}: {too_often}"


def test_lambadas_perplexity_passes_a_model_at_half_the_allowance_by_2000_items(item_rows) -> None:
    """Power per item at the wide cap: at half the allowance every shape passed at least 94 % of 1,000
    runs by 2,000 items (measured; asserted at 90 %), and power grows with n."""
    for shape in dict.fromkeys(r["shape"] for r in item_rows):
        row = [r["power"] for r in item_rows if r["shape"] == shape]
        assert row == sorted(row), (shape, row)
        assert dict(zip(levels.BINARY_SIZES, row))[2000] >= 0.9, (shape, row)


def test_an_allowance_relative_to_the_measured_baseline_keeps_the_level() -> None:
    """min_recovery's allowance is a share of the baseline's measured accuracy, which is noisy and
    correlated with the items lost (a lost item is one the baseline got right). Simulated as the gate
    computes it: the level holds."""
    rng = np.random.default_rng(7)
    draws, level = 4000, looks.level(1)
    for n, accuracy, flip in ((100, 0.5, 0.05), (300, 0.3, 0.05), (300, 0.8, 0.15)):
        delta = 0.05 * accuracy  # min_recovery 0.95 at the true accuracy
        right_right = accuracy - flip - delta
        counts = rng.multinomial(n, [right_right, flip + delta, flip, 1 - right_right - 2 * flip - delta], size=draws)
        measured = 0.05 * (counts[:, 0] + counts[:, 1]) / n
        passed = [
            bool(paired_binary.passes(lost, gained, n, allowance, level))
            for lost, gained, allowance in zip(counts[:, 1], counts[:, 2], measured)
        ]
        assert np.mean(passed) <= levels.limit(draws, level), (n, accuracy, flip)


def test_several_tasks_pass_only_together_which_keeps_the_level_without_a_correction() -> None:
    """The verdict passes only when every task passes (intersection-union): a model at the allowance on
    one task passes the verdict no more often than that task's own gate, however good the others are."""
    rng = np.random.default_rng(3)
    draws, level, n, delta = 4000, looks.level(1), 500, 0.05
    bad = rng.multinomial(n, [0.10 + delta, 0.10, 0.80 - delta], size=draws)
    good = rng.multinomial(n, [0.02, 0.02, 0.96], size=draws)
    at_allowance = paired_binary.passes(bad[:, 0], bad[:, 1], n, delta, level)
    verdict = at_allowance & paired_binary.passes(good[:, 0], good[:, 1], n, delta, level)
    assert np.mean(verdict) <= np.mean(at_allowance) <= levels.limit(draws, level)
    assert np.mean(paired_binary.passes(good[:, 0], good[:, 1], n, delta, level)) > 0.95


def test_the_class_reaches_pareto_tails_of_index_2_5_with_and_without_per_word_noise(rows) -> None:
    """The issue's case: Pareto-tailed per-document losses (index 2.5-3) under per-word noise passed a
    model at the allowance 5.1-5.4 % of the time on a first look. They are in the class now, and the
    first-look test above holds them to 3.04 % at every n to 5,000."""
    names = {s.name for s in levels.SHAPES}
    assert {"pareto-2.5", "pareto-2.5-noisy", "pareto-2.5-quiet", "pareto-3-noisy", "pareto-3", "lognormal-1.5"} <= names
    assert {r["n"] for r in rows} >= {70, 1000, 5000}


def test_without_the_tail_allowance_pareto_tails_pass_too_often(monkeypatch) -> None:
    """The same simulation with Student t's critical value alone (TAIL = 0): the Pareto 2.5 shape under
    per-word noise passes more often than a first look allows, so the allowance is what keeps the level."""
    monkeypatch.setattr(stats, "TAIL", 0.0)
    shape = next(s for s in levels.SHAPES if s.name == "pareto-2.5-noisy")
    plain = levels.simulate(DRAWS, sizes=(100,), shapes=(shape,))
    assert all(r["false_pass"] > levels.limit(DRAWS, looks.level(1)) for r in plain), plain


def test_outside_the_class_a_loss_in_1_percent_of_documents_passes_too_often() -> None:
    """The page's boundary is real: a loss no sample of a few hundred documents is likely to draw exceeds
    the level, whatever the bound (so README names the class rather than every distribution)."""
    tails = levels.tail_rows(DRAWS)
    over = {(r["shape"], r["n"]) for r in tails if r["false_pass"] > levels.limit(DRAWS, looks.level(1))}
    assert ("rare-1%", 100) in over and {s.name for s in levels.OUTSIDE}.isdisjoint(s.name for s in levels.SHAPES)


@pytest.mark.matrix  # 13 shapes x 3 n x 2 bounds on 8,000 draws: a few minutes, so CI's second phase
def test_later_looks_keep_their_share_for_every_shape_of_the_class() -> None:
    """Looks 2 and 5 (0.76 % and 0.12 %), on four times the draws: no shape of the class above its
    share at n 100-1,000. A fixed fraction of each level is not enough (the skewness error grows as t^2)."""
    later = levels.later_rows(DRAWS)
    assert {r["level"] for r in later} == {looks.level(2), looks.level(5)} and {r["draws"] for r in later} == {4 * DRAWS}
    assert len(later) == 2 * 2 * len(levels.SHAPES) * len(levels.LATER_SIZES)
    over = [r for r in later if r["false_pass"] > levels.limit(4 * DRAWS, r["level"])]
    assert over == [], over


def test_every_look_together_stays_within_5_percent_and_a_good_model_passes() -> None:
    """One user at --limit 100, then 300, then 1000 (the issue measured 7.8 % for Pareto tails): any look
    passing a model at the allowance stays within 5 % for every shape; a good model on normal losses passes."""
    seq = levels.sequence_rows(DRAWS)
    assert len(seq) == 2 * len(levels.SHAPES)
    assert [r for r in seq if r["false_pass"] > levels.limit(DRAWS, 0.05)] == []
    cell = {(r["bound"], r["shape"]): r for r in seq}
    assert cell[("corpus", "normal")]["power"] > 0.95 and cell[("corpus", "pareto-2.5-noisy")]["power"] > 0.8


def test_skewed_losses_decide_at_a_few_hundred_items(rows) -> None:
    """Power counts as much as level: at half the allowance, 500 documents pass lognormal, Pareto-4 and
    length-correlated losses about half the time (the doubled skewness rule before passed them 12-17 %)."""
    cell = {(r["bound"], r["shape"], r["n"]): r["power"] for r in rows}
    assert min(cell[("corpus", s, 500)] for s in ("lognormal-1", "pareto-4", "length-correlated")) > 0.4
    assert cell[("corpus", "normal", 70)] > 0.6 and cell[("corpus", "student-t3", 500)] > 0.85


def test_the_looks_spend_at_most_5_percent_in_all() -> None:
    assert sum(looks.level(k) for k in range(1, 100_000)) < 0.05
    assert looks.level(2) == pytest.approx(looks.level(1) / 4)


def test_a_second_look_at_the_allowance_passes_less_often() -> None:
    second = levels.simulate(DRAWS, sizes=(100,), alphas=(looks.level(2),))
    first = levels.simulate(DRAWS, sizes=(100,))
    cell = lambda rows: next(r for r in rows if (r["bound"], r["shape"]) == ("corpus", "normal"))  # noqa: E731
    assert cell(second)["false_pass"] <= looks.level(2) + 3 * math.sqrt(looks.level(2) / DRAWS)
    assert cell(second)["false_pass"] < cell(first)["false_pass"]


def test_t_bounds_never_pass_below_the_minimum_n(rows) -> None:
    small = [r for r in rows if r["bound"] != "binary" and r["n"] < min_items(looks.level(1))]
    assert small and all(r["false_pass"] == 0 and r["power"] == 0 for r in small)
    assert min_items(0.05) == 59 and 0.95**59 < 0.05 < 0.95**58
    assert min_items(looks.level(1)) == 69 and 0.95**69 < looks.level(1) < 0.95**68


def test_a_good_model_passes_at_n_100(rows) -> None:
    """Half the allowance, per-document noise sd = the allowance, 100 documents: passes >= 80 %."""
    cell = next(r for r in rows if (r["bound"], r["shape"], r["n"]) == ("corpus", "normal", 100))
    assert cell["power"] >= 0.80
    mean = next(r for r in rows if (r["bound"], r["shape"], r["n"]) == ("mean", "normal", 100))
    assert mean["power"] >= 0.80


def test_a_plain_t_bound_without_the_size_rules_would_fail_this_test() -> None:
    """The same simulation, the same t bound, without MIN_ITEMS and the skewness rule: the rare-loss
    shape at n = 20 passes far more than 5 % (its loss is in no document of most samples)."""
    rng = np.random.default_rng(0)
    shape = next(s for s in levels.SHAPES if s.name == "rare-5%")
    words = rng.integers(20, 201, size=(20, DRAWS)).astype(float)
    loss = words * shape.draw(rng, levels.ALLOWANCE, (20, DRAWS))
    estimate, terms = stats.ratio_terms(-2 * words, words, -2 * words - loss, words)
    plain = np.mean(stats.linearized_t(estimate, terms, looks.level(1))["upper"] < levels.ALLOWANCE)
    assert plain > 0.25


def test_a_look_is_new_items_not_a_new_run() -> None:
    """The same tasks, limit and offset again are that look again (same level, nothing spent); more
    items are one new look; the demo's gate run three times stays look 1."""
    demo = {"tasks": ["gsm8k_ppl"], "limit": 100, "offset": 0}
    assert looks.number([], demo) == (1, True)
    assert looks.number([demo, demo], demo) == (1, False)
    larger = demo | {"limit": 300}
    assert looks.number([demo], larger) == (2, True)
    assert looks.number([demo, larger], demo) == (1, False)
    assert looks.number([demo, larger], larger | {"tasks": ["gsm8k_ppl", "gsm8k"]}) == (3, True)
    assert looks.number([demo], {"tasks": ["gsm8k_ppl"], "limit": 100, "offset": None}) == (1, False)


def test_the_look_history_is_a_chain_that_shows_a_deleted_or_reordered_entry() -> None:
    from qserve.errors import QserveError

    a = {"tasks": ["gsm8k_ppl"], "limit": 100, "offset": 0, "decided_at": "2026-12-01T10:00:00+00:00", "verdict": "pass"}
    b = a | {"limit": 300, "decided_at": "2026-12-01T11:00:00+00:00"}
    c = a | {"limit": 1000, "decided_at": "2026-12-01T12:00:00+00:00"}
    history = looks.chained([a, b], c)
    assert looks.checked(history) == history and history[0]["previous"] is None
    assert history[2]["previous"] == hashlib.sha256(json.dumps(history[1], sort_keys=True).encode()).hexdigest()[:16]
    for edited in (history[:1] + history[2:], [history[1], history[0], history[2]]):
        with pytest.raises(QserveError, match=r"^the look history in the eval record was edited: look \d"):
            looks.checked(edited)
    # The record's history and the cache's ledger merge: the same look once, oldest first.
    merged = looks.merge([a, c], history)
    assert [{k: v for k, v in x.items() if k != "previous"} for x in merged] == [a, b, c]
