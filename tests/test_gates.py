"""Gate arithmetic and statistics: criteria, zero baselines, noise, verdicts, CLI and recipe forms."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from scipy.stats import norm, ttest_rel
from scipy.stats import t as t_dist

from qserve.errors import QserveError
from qserve.evaluate.tasks import get_tasks
from qserve.gate.decisions import Bounds, Comparison, decide, recovery, verdict
from qserve.gate.stats import aggregate, compare, item_values
from qserve.spec.gates import GateSpec, parse_cli_gates
from qserve.spec.recipe import parse_recipe


def _cmp(b: float, q: float, hib: bool = True, bounds: tuple[float, float] | None = None, **kw) -> Comparison:
    """A comparison whose one-sided 95 % degradation bounds are given (stats.py computes them)."""
    lo_hi = Bounds(*bounds, "given", 100) if bounds else None
    return Comparison("m,none", hib, b, q, bounds=lo_hi, items=100 if bounds else None, **kw)


def _binary(base: list[int], quant: list[int]) -> Comparison:
    b = {str(i): float(v) for i, v in enumerate(base)}
    q = {str(i): float(v) for i, v in enumerate(quant)}
    return compare("exact_match,none", True, (sum(base) / len(base), None, b), (sum(quant) / len(quant), None, q))


def test_recovery_directions() -> None:
    assert recovery(0.5, 0.45, higher_is_better=True) == pytest.approx(0.9)
    assert recovery(10.0, 12.5, higher_is_better=False) == pytest.approx(0.8)


def test_zero_baseline_is_inconclusive_not_a_pass() -> None:
    gate = decide("gsm8k", GateSpec(min_recovery=0.95), _cmp(0.0, 0.0, bounds=(0.0, 0.0)))
    assert gate.status == "inconclusive" and gate.recovery is None and gate.signal is False
    assert verdict([gate]) == "inconclusive"


def test_all_items_identical_is_inconclusive() -> None:
    # 0/20 on both with max_drop: no division by zero, but nothing was measured either.
    gate = decide("gsm8k", GateSpec(max_drop=0.05), _binary([0] * 20, [0] * 20))
    assert gate.status == "inconclusive" and "no variance" in gate.reason and gate.signal is False


@pytest.mark.parametrize(
    ("quantized", "bounds", "status"),
    [
        (0.49, (0.0, 0.02), "pass"),  # degradation 0.01, upper bound clear of the 0.025 allowance
        (0.49, (-0.01, 0.03), "inconclusive"),  # the same drop, but the bound reaches the limit
        (0.47, (0.01, 0.05), "inconclusive"),  # exceeded, within noise: the sample is too small
        (0.40, (0.06, 0.14), "fail"),  # exceeded beyond noise
        (0.40, None, "fail"),  # no per-item values: lm-eval's unpaired standard errors can only fail it
        (0.49, None, "inconclusive"),  # ... never pass it
    ],
)
def test_noise_aware_decisions(quantized: float, bounds: tuple | None, status: str) -> None:
    unpaired = {"baseline_stderr": 0.01, "quantized_stderr": 0.01} if bounds is None else {}
    gate = decide("t", GateSpec(min_recovery=0.95), _cmp(0.5, quantized, bounds=bounds, **unpaired))
    assert gate.allowed_degradation == pytest.approx(0.025)
    assert gate.status == status, gate.reason


def test_limit_one_is_inconclusive_and_says_how_many_items_decide() -> None:
    """--limit 1 used to pass with "no standard error available"."""
    gate = decide("gsm8k", GateSpec(min_recovery=0.95), _binary([1], [1]))
    assert gate.status == "inconclusive" and gate.signal is True
    # Zero discordant items in n: the score is -sqrt(n delta / (1 - delta)), so a pass needs about
    # z^2 (1 - delta) / delta items (delta 0.05, one-sided 95 %).
    needed = math.ceil(norm.ppf(0.95) ** 2 * 0.95 / 0.05)
    assert gate.items_needed == needed == 52
    assert "about 52 items would pass 4 times in 5 if these flip rates hold (--limit)" in gate.reason


def test_identical_item_by_item_at_n3_is_inconclusive() -> None:
    """Both models right and wrong on the same items (paired standard error 0) used to pass at n=3."""
    gate = decide("gsm8k", GateSpec(min_recovery=0.95), _binary([1, 0, 1], [1, 0, 1]))
    assert gate.status == "inconclusive" and gate.degradation == 0 and gate.degradation_stderr == 0
    assert "the models agreed on all 3 items" in gate.reason
    assert verdict([gate]) == "inconclusive"


def test_0_1_items_are_decided_by_the_exact_score_test_at_the_allowance() -> None:
    # 200 items: 6 lost, 2 gained, the rest tied.
    base = [1] * 6 + [0] * 2 + [1] * 100 + [0] * 92
    quant = [0] * 6 + [1] * 2 + [1] * 100 + [0] * 92
    cmp = _binary(base, quant)
    assert cmp.bounds is None and cmp.flips == {"lost": 6, "gained": 2} and cmp.degradation == pytest.approx(4 / 200)
    # A drop of 0.02 against max_drop 0.1 passes, against 0.005 it is undecided (tests/test_paired_binary.py
    # proves the test itself).
    assert decide("g", GateSpec(max_drop=0.1), cmp).status == "pass"
    assert decide("g", GateSpec(max_drop=0.005), cmp).status == "inconclusive"


def test_paired_t_bound_for_continuous_items() -> None:
    base = [0.50, 0.61, 0.42, 0.55, 0.70, 0.38, 0.66, 0.52, 0.47, 0.59]
    quant = [0.49, 0.58, 0.43, 0.51, 0.69, 0.33, 0.65, 0.50, 0.44, 0.58]
    b = {str(i): v for i, v in enumerate(base)}
    q = {str(i): v for i, v in enumerate(quant)}
    cmp = compare("f1,none", True, (sum(base) / 10, None, b), (sum(quant) / 10, None, q))
    ci = ttest_rel(base, quant).confidence_interval(0.90)  # two-sided 90 %: one-sided 95 % each end
    d = np.array(base) - np.array(quant)
    e = d - d.mean()
    shift = (e**3).mean() / (6 * (e**2).mean() * 10)  # Johnson's skewness correction
    # The lower bound is Student t's; the upper one's critical value is t + 0.3 t^2 (stats.py's tail allowance).
    t95 = t_dist.ppf(0.95, 9)
    upper = d.mean() + shift + (t95 + 0.3 * t95**2) * d.std(ddof=1) / math.sqrt(10)
    assert (cmp.bounds.lower, cmp.bounds.upper) == (pytest.approx(ci.low + shift), pytest.approx(upper))
    assert cmp.bounds.method == "paired t on per-item differences"
    # At n = 10 even a bound far under the allowance is no pass: a t bound passes from 59 items.
    far = decide("f", GateSpec(max_drop=1.0), cmp)
    assert cmp.bounds.upper < 1.0 and (far.status, far.items_needed) == ("inconclusive", 59)


def _ppl_items(seed: int, n: int, scale: float) -> tuple[dict, dict]:
    rng = random.Random(seed)
    base = {str(i): [-rng.uniform(100, 300), float(rng.randint(20, 60))] for i in range(n)}
    quant = {k: [ll * scale + rng.gauss(0, 2), w] for k, (ll, w) in base.items()}
    return base, quant


def _ppl(items: dict) -> float:
    return math.exp(-sum(v[0] for v in items.values()) / sum(v[1] for v in items.values()))


def test_perplexity_is_judged_by_a_t_bound_on_linearized_terms_on_the_log_scale() -> None:
    base, quant = _ppl_items(1, 80, 1.01)
    cmp = compare("word_perplexity,none", False, (_ppl(base), None, base), (_ppl(quant), None, quant))
    assert cmp.log_scale and cmp.bounds.method == "paired t on 80 documents' linearized terms"
    # Computed here from the definition: log(ppl_q / ppl_b) = sum(ll_b - ll_q) / sum(words), its
    # ratio-estimator standard error, Johnson's skewness shift and Student t with 79 d.f.
    ll_b, w, ll_q = (np.array([v[i] for v in d.values()]) for d, i in ((base, 0), (base, 1), (quant, 0)))
    d = ll_b - ll_q
    r = d.sum() / w.sum()
    e = (d - r * w) / w.mean()
    shift = (e**3).mean() / (6 * (e**2).mean() * 80)
    t95 = t_dist.ppf(0.95, 79)
    assert cmp.bounds.lower == pytest.approx(r + shift - t95 * _ratio_se(d, w), rel=1e-9)
    assert cmp.bounds.upper == pytest.approx(r + shift + (t95 + 0.3 * t95**2) * _ratio_se(d, w), rel=1e-9)
    g1 = (e**3).mean() / (e**2).mean() ** 1.5
    assert cmp.bounds.skewness == pytest.approx(g1) and cmp.bounds.needs == max(59, math.floor(28 + 25 * g1**2) + 1)
    # Perplexity +4.6 % (bounds +3.5 % to +6.1 %): passes max_increase 7 %, fails 3 %, undecided at 6 % and 5 %.
    assert decide("p", GateSpec(max_increase=0.07), cmp).status == "pass"
    assert decide("p", GateSpec(max_increase=0.06), cmp).status == "inconclusive"
    assert decide("p", GateSpec(max_increase=0.03), cmp).status == "fail"
    assert decide("p", GateSpec(max_increase=0.05), cmp).status == "inconclusive"
    # Display standard error of each perplexity: the delta method's ppl * se(mean NLL).
    assert cmp.baseline_stderr == pytest.approx(_ppl(base) * _ratio_se(-ll_b, w), rel=1e-9)
    assert cmp.quantized_stderr == pytest.approx(_ppl(quant) * _ratio_se(-ll_q, w), rel=1e-9)


def test_a_t_bound_clear_of_the_allowance_on_too_few_items_is_inconclusive() -> None:
    """40 documents: the bound is under the allowance, but a pass needs 59 (stats.MIN_ITEMS)."""
    base, quant = _ppl_items(1, 40, 1.002)
    cmp = compare("word_perplexity,none", False, (_ppl(base), None, base), (_ppl(quant), None, quant))
    gate = decide("p", GateSpec(max_increase=0.05), cmp)
    assert math.expm1(cmp.bounds.upper) < 0.05
    assert (gate.status, gate.items_needed, gate.items) == ("inconclusive", 59, 40)
    assert "40 items are too few for a pass (at least 59, or a loss carried by 5 % of items can be missed)" in gate.reason


def test_skewed_differences_need_more_items_and_the_gate_says_how_many() -> None:
    """One document carries most of the loss: skewness near sqrt(n), so 28 + 25 g1^2 items."""
    base, quant = _ppl_items(3, 100, 1.0)
    quant["7"] = [base["7"][0] - 40.0, base["7"][1]]
    cmp = compare("word_perplexity,none", False, (_ppl(base), None, base), (_ppl(quant), None, quant))
    gate = decide("p", GateSpec(max_increase=0.05), cmp)
    assert cmp.bounds.skewness > 5 and gate.status == "inconclusive"
    assert gate.items_needed == cmp.bounds.needs == math.floor(28 + 25 * cmp.bounds.skewness**2) + 1
    assert "more than 28 + 25 x skewness^2" in gate.reason


def test_nan_scores_fail_with_a_line_not_a_traceback() -> None:
    base, quant = _ppl_items(1, 80, 1.0)
    quant["3"] = [float("nan"), quant["3"][1]]
    cmp = compare("word_perplexity,none", False, (_ppl(base), None, base), (float("nan"), None, quant))
    gate = decide("p", GateSpec(max_increase=0.05), cmp)
    assert (gate.status, gate.reason) == (
        "fail",
        "word_perplexity,none is not a finite number (some items): the scores cannot be compared",
    )
    inf = decide("p", GateSpec(max_increase=0.05), _cmp(10.0, float("inf"), hib=False))
    assert inf.status == "fail" and "not a finite number (the baseline 10, the quantized model inf)" in inf.reason


def _ratio_se(y: np.ndarray, w: np.ndarray) -> float:
    """Standard error of sum(y)/sum(w) over n documents by linearisation (the ratio estimator)."""
    n, r = len(y), y.sum() / w.sum()
    return math.sqrt(((y - r * w) ** 2).sum() * n / (n - 1)) / w.sum()


def test_perplexity_identical_on_every_document_is_inconclusive() -> None:
    base, _ = _ppl_items(2, 5, 1.0)
    cmp = compare("word_perplexity,none", False, (_ppl(base), None, base), (_ppl(base), None, dict(base)))
    gate = decide("p", GateSpec(max_increase=0.05), cmp)
    assert gate.status == "inconclusive" and "scored identically on all 5 items" in gate.reason


def test_perplexity_criteria() -> None:
    # Perplexity 10 -> 10.4: +4 %, bounds on log(q/b) of [+3 %, +5 %] -> max_increase 5 % undecided, 10 % passes.
    log_bounds = (math.log(1.03), math.log(1.045))
    assert (
        decide("p", GateSpec(max_increase=0.10), _cmp(10.0, 10.4, hib=False, bounds=log_bounds, log_scale=True)).status == "pass"
    )
    assert (
        decide("p", GateSpec(max_increase=0.02), _cmp(10.0, 10.4, hib=False, bounds=log_bounds, log_scale=True)).status == "fail"
    )
    gate = decide("p", GateSpec(min_recovery=0.95), _cmp(10.0, 10.4, hib=False, bounds=log_bounds, log_scale=True))
    assert gate.recovery == pytest.approx(10 / 10.4) and gate.status == "pass"
    # The tightest criterion governs.
    both = decide("p", GateSpec(min_recovery=0.95, max_drop=0.2), _cmp(10.0, 10.4, hib=False, bounds=log_bounds, log_scale=True))
    assert both.allowed_degradation == pytest.approx(0.2) and both.status == "fail"
    with pytest.raises(QserveError, match="max_increase applies to lower-is-better"):
        decide("s", GateSpec(max_increase=0.05), _cmp(0.5, 0.5))


def test_verdict_rule() -> None:
    """fail if any fails; inconclusive if any gate with signal is; pass needs a pass, the rest pass or no signal."""
    ok = decide("p", GateSpec(min_recovery=0.9), _cmp(10.0, 10.5, hib=False, bounds=(0.3, 0.7)))
    bad = decide("p", GateSpec(min_recovery=0.9), _cmp(10.0, 20.0, hib=False, bounds=(8.0, 12.0)))
    exceeded = decide("g", GateSpec(min_recovery=0.95), _cmp(0.5, 0.47, bounds=(0.01, 0.05)))  # past 0.025, within noise
    empty = decide("g", GateSpec(min_recovery=0.95), _cmp(0.0, 0.0))  # zero baseline: no signal
    assert (ok.status, bad.status, exceeded.status, empty.status) == ("pass", "fail", "inconclusive", "inconclusive")
    assert (exceeded.signal, empty.signal) == (True, False)
    assert verdict([ok, empty]) == "pass"  # no signal is a warning, not a veto
    assert verdict([ok, exceeded]) == "inconclusive"  # a pass elsewhere cannot outvote it
    assert verdict([ok, bad]) == "fail" and verdict([exceeded, bad]) == "fail"
    assert verdict([empty]) == "inconclusive" and verdict([]) == "inconclusive"


def test_a_gate_on_a_task_not_evaluated_is_an_error() -> None:
    from qserve.evaluate.evaluation import _check_gated_tasks
    from qserve.evaluate.tasks import resolve_tasks

    _check_gated_tasks({"gsm8k": []}, resolve_tasks(["gsm8k", "gsm8k_ppl"]))
    with pytest.raises(QserveError) as e:
        _check_gated_tasks({"gsm8k_mc": [], "gsm8k": []}, resolve_tasks(["gsm8k"]))
    assert (
        str(e.value) == "--gate names gsm8k_mc, which this eval does not run (tasks: gsm8k); add it to --tasks or drop the gate"
    )
    _check_gated_tasks({"mmlu_anatomy": [], "mmlu": []}, resolve_tasks(["mmlu"]))  # a group's task may be gated
    with pytest.raises(QserveError) as e:
        _check_gated_tasks({"gsm8k": []}, resolve_tasks(["mmlu"]))
    assert str(e.value) == (
        "--gate names gsm8k, which this eval does not run (tasks: mmlu, and 57 tasks inside its groups); "
        "add it to --tasks or drop the gate"
    )


def test_cli_gate_forms() -> None:
    gates = parse_cli_gates(["gsm8k=0.9", "gsm8k:max_drop=0.02", "gsm8k_ppl:max_increase=0.05", "gsm8k_mc@acc_norm=0.97"])
    assert gates["gsm8k"] == [GateSpec(min_recovery=0.9, max_drop=0.02)]
    assert gates["gsm8k_ppl"] == [GateSpec(max_increase=0.05)]
    assert gates["gsm8k_mc"] == [GateSpec(metric="acc_norm,none", min_recovery=0.97)]
    for bad in ("gsm8k", "gsm8k:max_speed=1", "=0.9", "gsm8k=x"):
        with pytest.raises(QserveError, match="expected TASK"):
            parse_cli_gates([bad])


def test_recipe_gate_forms_and_errors() -> None:
    base = "name: r\nscheme: FP8_DYNAMIC\nalgorithm: rtn\n"
    recipe = parse_recipe(base + "gates:\n  gsm8k: 0.9\n  gsm8k_ppl: {max_increase: 0.05}\n")
    assert recipe.gates == {"gsm8k": [GateSpec(min_recovery=0.9)], "gsm8k_ppl": [GateSpec(max_increase=0.05)]}
    with pytest.raises(
        QserveError, match=r"^r.yaml:6: gates.gsm8k.0.max_dorp: unknown field; valid fields: metric, min_recovery"
    ):
        parse_recipe(base + "gates:\n  gsm8k:\n    max_dorp: 0.1\n", "r.yaml")
    with pytest.raises(QserveError, match="a gate needs at least one of"):
        parse_recipe(base + "gates:\n  gsm8k: {metric: acc}\n")


def test_item_values_and_aggregation_match_lm_eval() -> None:
    samples = [
        {"doc_id": 0, "filter": "none", "word_perplexity": (-10.0, 5)},
        {"doc_id": 1, "filter": "none", "word_perplexity": (-20.0, 5)},
        {"doc_id": 0, "filter": "strict-match", "exact_match": 1.0},
    ]
    items = item_values(samples, "word_perplexity,none")
    assert items == {"0": [-10.0, 5.0], "1": [-20.0, 5.0]}
    assert aggregate("word_perplexity", list(items.values())) == pytest.approx(math.exp(30 / 10))
    assert item_values(samples, "exact_match,strict-match") == {"0": 1.0}


def test_paired_noise_is_tighter_than_unpaired() -> None:
    # Two models that differ by a small, consistent amount on very different items.
    base = {str(i): float(i % 2) for i in range(40)}
    quant = {str(i): float(i % 2) for i in range(40)}
    quant["0"] = 1.0  # one item better
    cmp = compare("acc,none", True, (0.5, 0.08, base), (0.525, 0.08, quant))
    assert cmp.items == 40 and not cmp.constant
    assert cmp.paired_stderr == pytest.approx(np.std([-1] + [0] * 39, ddof=1) / math.sqrt(40))
    assert cmp.paired_stderr < math.hypot(0.08, 0.08) / 3
    assert cmp.baseline_stderr == 0.08  # lm-eval's own standard error is kept


def test_tasks_registry_has_multiple_choice() -> None:
    names = {t.name for t in get_tasks(["gsm8k", "gsm8k_ppl", "gsm8k_mc", "arc_easy"])}
    assert names == {"gsm8k", "gsm8k_ppl", "gsm8k_mc", "arc_easy"}
    with pytest.raises(QserveError, match="^unknown task mmlux "):
        get_tasks(["mmlux"])
