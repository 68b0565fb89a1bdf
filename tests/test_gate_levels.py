"""Every bound the gate passes on keeps its level: seeded simulation through qserve's own bounds.

At exactly the allowance a one-sided 95 % bound may pass at most 5 % of samples; the test allows
three Monte-Carlo standard errors on top. The shapes span near-constant to strongly skewed and
heavy-tailed per-item losses (qserve/evaluate/levels.py). A bound that is too optimistic at any
n, for any shape, fails here: the BCa bootstrap qserve used before passed lognormal-1.5 samples
at n = 100 about 19 % of the time.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from qserve.evaluate import levels, stats

DRAWS = 2000


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return levels.simulate(DRAWS)


def test_the_simulation_covers_every_bound_shape_and_n(rows) -> None:
    cells = {(r["bound"], r["shape"], r["n"]) for r in rows}
    assert len(cells) == len(rows) == (2 * len(levels.SHAPES) + len(levels.BINARY_SHAPES)) * len(levels.SIZES)
    assert {2, 3, 5, 10, 20, 50, 100, 200} <= set(levels.SIZES) and len(levels.SHAPES) >= 6


def test_no_bound_passes_a_model_at_its_allowance_more_than_5_percent(rows) -> None:
    worst = max(rows, key=lambda r: r["false_pass"])
    too_often = [r for r in rows if r["false_pass"] > levels.limit(DRAWS)]
    assert too_often == [], f"false-pass above {levels.limit(DRAWS):.2%}: {too_often}"
    assert levels.limit(DRAWS) == pytest.approx(0.05 + 3 * math.sqrt(0.05 * 0.95 / DRAWS))
    assert worst["false_pass"] > 0.03  # the level is used, not wasted: some cell sits near 5 %


def test_t_bounds_never_pass_below_the_minimum_n(rows) -> None:
    small = [r for r in rows if r["bound"] != "binary" and r["n"] < stats.MIN_ITEMS]
    assert small and all(r["false_pass"] == 0 and r["power"] == 0 for r in small)
    assert stats.MIN_ITEMS == 59 and 0.95**59 < 0.05 < 0.95**58


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
    plain = np.mean(stats.linearized_t(estimate, terms)["upper"] < levels.ALLOWANCE)
    assert plain > 0.25


def test_the_exact_binomial_bound_matches_scipy() -> None:
    from scipy.stats import binomtest

    lo, hi = stats.clopper_pearson(np.array([0, 3, 10]), 10)
    for k, a, b in zip((0, 3, 10), lo, hi):
        ci = binomtest(k, 10).proportion_ci(0.95, "exact")
        assert (a, b) == (pytest.approx(ci.low, abs=1e-12), pytest.approx(ci.high, abs=1e-12))
