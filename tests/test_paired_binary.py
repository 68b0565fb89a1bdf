"""The 0/1 gate: the exact unconditional score test on lost and gained items (paired_binary.py).

Each number is computed here from its definition (scipy's multinomial, a numerical likelihood
maximum, the plain score test), not taken from the module under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import minimize_scalar
from scipy.stats import beta, multinomial, norm

from qserve.gate import looks, paired_binary
from qserve.gate.decisions import decide
from qserve.gate.stats import compare
from qserve.spec.gates import GateSpec

FIRST = looks.level(1)


def _exact_size(n: int, delta: float, z_pass: float, p_gained: float) -> float:
    """P(Z < z_pass) when p_lost = p_gained + delta, summed over every (lost, gained) count."""
    probs = [p_gained + delta, p_gained, 1 - 2 * p_gained - delta]
    total = 0.0
    for lost in range(n + 1):
        gained = np.arange(0, n - lost + 1)
        hit = gained[paired_binary.score(lost, gained, n, delta) < z_pass]
        if len(hit):
            counts = np.stack([np.full(len(hit), lost), hit, n - lost - hit], axis=1)
            total += multinomial.pmf(counts, n, probs).sum()
    return total


@pytest.mark.parametrize(("n", "delta"), [(50, 0.05), (100, 0.02), (100, 0.10), (200, 0.05)])
def test_the_level_holds_between_the_grid_points_exactly(n: int, delta: float) -> None:
    """Off the nuisance grid, the exact size stays under the level (and uses most of it)."""
    z_pass, _ = paired_binary.critical_values(n, delta, FIRST)
    sizes = [_exact_size(n, delta, z_pass, p) for p in np.linspace(0.0007, (1 - delta) / 2 - 0.0007, 61)]
    assert max(sizes) <= FIRST and max(sizes) > 0.8 * FIRST


def test_the_plain_score_test_exceeds_its_level_which_is_why_the_critical_value_is_exact() -> None:
    sizes = [_exact_size(100, 0.05, norm.ppf(FIRST), p) for p in np.linspace(0.0, 0.475, 96)]
    assert max(sizes) > FIRST * 1.02


def test_the_score_is_tangos_statistic_with_the_restricted_maximum_likelihood() -> None:
    """Z = (b - c - n delta) / sqrt(n (2 q + delta (1 - delta))), q maximizing the likelihood under theta = delta."""
    for lost, gained, n, delta in ((6, 2, 200, 0.05), (15, 15, 300, 0.04), (0, 0, 80, 0.05), (30, 2, 100, 0.1)):
        tied = n - lost - gained

        def nll(q: float, lost=lost, gained=gained, tied=tied, delta=delta) -> float:
            return -(lost * math.log(q + delta) + (gained * math.log(q) if gained else 0) + tied * math.log(1 - 2 * q - delta))

        q = minimize_scalar(nll, bounds=(1e-12, (1 - delta) / 2 - 1e-12), method="bounded", options={"xatol": 1e-12}).x
        z = (lost - gained - n * delta) / math.sqrt(n * (2 * q + delta * (1 - delta)))
        assert float(paired_binary.score(lost, gained, n, delta)) == pytest.approx(z, abs=1e-5)


def _cases(draws: int, seed: int = 0):
    """The issue's cases: (n, allowance, items flipping each way, true loss)."""
    rng = np.random.default_rng(seed)
    for n, allowance, flip, loss in ((300, 0.04, 0.05, 0.0), (1319, 0.02, 0.05, 0.0), (1319, 0.04, 0.10, 0.02)):
        counts = rng.multinomial(n, [flip + loss, flip, 1 - 2 * flip - loss], size=draws)
        yield n, allowance, counts[:, 0], counts[:, 1]


def test_power_matches_the_score_test_and_is_over_twice_the_bonferroni_pair() -> None:
    for n, allowance, lost, gained in _cases(4000):
        exact = np.mean(paired_binary.passes(lost, gained, n, allowance, FIRST))
        score = np.mean(paired_binary.score(lost, gained, n, allowance) < norm.ppf(FIRST))
        hi_lost = beta.ppf(1 - FIRST / 2, lost + 1, n - lost)
        lo_gained = np.where(gained == 0, 0.0, beta.ppf(FIRST / 2, gained, n - gained + 1))
        bonferroni = np.mean(hi_lost - lo_gained < allowance)  # qserve's earlier pair of Clopper-Pearson bounds
        assert exact >= score - 0.01 and exact > 2 * bonferroni, (n, allowance, exact, score, bonferroni)
        assert exact > 0.35


def test_bounds_agree_with_the_decision_at_the_allowance() -> None:
    for lost, gained, n, delta in ((6, 2, 200, 0.05), (15, 15, 300, 0.04), (40, 1, 200, 0.05), (9, 1, 120, 0.03)):
        lower, upper = paired_binary.bounds(lost, gained, n, delta, FIRST)
        assert lower < (lost - gained) / n < upper
        assert (upper < delta) == bool(paired_binary.passes(lost, gained, n, delta, FIRST))
        assert (lower > delta) == paired_binary.fails(lost, gained, n, delta, FIRST)


def test_a_gate_on_0_1_items_decides_with_the_exact_test_and_says_how_many_items_would_pass() -> None:
    # 300 items, 15 lost and 15 gained: no loss, 4 points allowed (max_drop).
    base = [1] * 15 + [0] * 15 + [1] * 135 + [0] * 135
    quant = [0] * 15 + [1] * 15 + [1] * 135 + [0] * 135
    b, q = ({str(i): float(v) for i, v in enumerate(x)} for x in (base, quant))
    cmp = compare("exact_match,none", True, (0.5, None, b), (0.5, None, q), FIRST)
    gate = decide("gsm8k", GateSpec(max_drop=0.04), cmp)
    assert gate.status == "pass" and gate.flips == {"lost": 15, "gained": 15}
    assert gate.test == "exact unconditional score test on discordant items (15 lost, 15 gained of 300)"
    tight = decide("gsm8k", GateSpec(max_drop=0.02), compare("exact_match,none", True, (0.5, None, b), (0.5, None, q), FIRST))
    # 80 % power at 5 % flips each way, no loss, 2 points: (z_a sqrt(v0) + z_0.8 sqrt(v1))^2 / delta^2.
    q0 = paired_binary.score_null_gained(0.05, 0.05, 0.02)
    v0, v1 = 2 * q0 + 0.02 * 0.98, 0.10
    need = math.ceil(((norm.ppf(1 - FIRST) * math.sqrt(v0) + norm.ppf(0.8) * math.sqrt(v1)) / 0.02) ** 2)
    assert tight.status == "inconclusive" and tight.items_needed == need
    assert f"about {need} items would pass 4 times in 5 if these flip rates hold" in tight.reason


def test_no_discordant_item_passes_from_the_n_the_score_gives() -> None:
    """Zero items differing: Z = -sqrt(n delta / (1 - delta)), a pass from n > z^2 (1 - delta) / delta."""
    first = math.ceil(norm.ppf(FIRST) ** 2 * 0.95 / 0.05)
    assert not paired_binary.passes(0, 0, first - 3, 0.05, FIRST)
    assert paired_binary.passes(0, 0, first + 3, 0.05, FIRST)


def test_an_allowance_of_zero_passes_only_a_model_that_gained_beyond_noise() -> None:
    """max_drop 0: the test of theta >= 0 keeps its level too (p_lost = p_gained on the boundary)."""
    z_pass, _ = paired_binary.critical_values(200, 0.0, FIRST)
    assert max(_exact_size(200, 0.0, z_pass, p) for p in np.linspace(0.0, 0.5, 21)) <= FIRST
    assert not paired_binary.passes(5, 5, 200, 0.0, FIRST) and paired_binary.passes(0, 20, 200, 0.0, FIRST)
