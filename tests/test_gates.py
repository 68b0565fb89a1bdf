"""Gate arithmetic and statistics: criteria, zero baselines, noise, verdicts, CLI and recipe forms."""

from __future__ import annotations

import math

import pytest

from qserve.errors import QserveError
from qserve.evaluate.gates import Comparison, GateSpec, decide, parse_cli_gates, recovery, verdict
from qserve.evaluate.stats import aggregate, compare, item_values
from qserve.evaluate.tasks import get_tasks
from qserve.quantize.recipe import parse_recipe


def _cmp(b: float, q: float, hib: bool = True, noise: float | None = None, **kw) -> Comparison:
    return Comparison("m,none", hib, b, q, paired_stderr=noise, **kw)


def test_recovery_directions() -> None:
    assert recovery(0.5, 0.45, higher_is_better=True) == pytest.approx(0.9)
    assert recovery(10.0, 12.5, higher_is_better=False) == pytest.approx(0.8)


def test_zero_baseline_is_inconclusive_not_a_pass() -> None:
    gate = decide("gsm8k", GateSpec(min_recovery=0.95), _cmp(0.0, 0.0, noise=0.0))
    assert gate.status == "inconclusive" and gate.recovery is None
    assert verdict([gate]) == "inconclusive"


def test_all_items_identical_is_inconclusive() -> None:
    # 0/20 on both with max_drop: no division by zero, but nothing was measured either.
    gate = decide("gsm8k", GateSpec(max_drop=0.05), _cmp(0.0, 0.0, noise=0.0, items=20, constant=True))
    assert gate.status == "inconclusive" and "no variance" in gate.reason


@pytest.mark.parametrize(
    ("quantized", "noise", "status"),
    [
        (0.49, 0.005, "pass"),  # degradation 0.01, clear of the 0.025 allowance
        (0.49, 0.02, "inconclusive"),  # the same drop, but the noise band reaches the limit
        (0.47, 0.02, "inconclusive"),  # exceeded, within noise: the sample is too small
        (0.40, 0.02, "fail"),  # exceeded beyond noise
        (0.40, None, "fail"),  # no noise estimate: the point estimate decides
    ],
)
def test_noise_aware_decisions(quantized: float, noise: float | None, status: str) -> None:
    gate = decide("t", GateSpec(min_recovery=0.95), _cmp(0.5, quantized, noise=noise))
    assert gate.allowed_degradation == pytest.approx(0.025)
    assert gate.status == status, gate.reason


def test_perplexity_criteria() -> None:
    # Perplexity 10 -> 10.4: +4 %. max_increase 5 % passes, 3 % fails; min_recovery works inversely.
    assert decide("p", GateSpec(max_increase=0.05), _cmp(10.0, 10.4, hib=False, noise=0.01)).status == "pass"
    assert decide("p", GateSpec(max_increase=0.03), _cmp(10.0, 10.4, hib=False, noise=0.01)).status == "fail"
    gate = decide("p", GateSpec(min_recovery=0.95), _cmp(10.0, 10.4, hib=False, noise=0.01))
    assert gate.recovery == pytest.approx(10 / 10.4) and gate.status == "pass"
    # The tightest criterion governs.
    both = decide("p", GateSpec(min_recovery=0.95, max_drop=0.2), _cmp(10.0, 10.4, hib=False, noise=0.01))
    assert both.allowed_degradation == pytest.approx(0.2) and both.status == "fail"
    with pytest.raises(QserveError, match="max_increase applies to lower-is-better"):
        decide("s", GateSpec(max_increase=0.05), _cmp(0.5, 0.5))


def test_verdict_needs_a_real_pass_and_no_failure() -> None:
    ok = decide("p", GateSpec(min_recovery=0.9), _cmp(10.0, 10.5, hib=False))
    bad = decide("p", GateSpec(min_recovery=0.9), _cmp(10.0, 20.0, hib=False))
    empty = decide("g", GateSpec(min_recovery=0.95), _cmp(0.0, 0.0))
    assert ok.status == "pass" and bad.status == "fail"
    assert verdict([ok, empty]) == "pass"
    assert verdict([ok, bad]) == "fail"


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
    assert cmp.paired_stderr < math.hypot(0.08, 0.08) / 3
    assert cmp.baseline_stderr == 0.08  # lm-eval's own standard error is kept


def test_tasks_registry_has_multiple_choice() -> None:
    names = {t.name for t in get_tasks(["gsm8k", "gsm8k_ppl", "gsm8k_mc", "arc_easy"])}
    assert names == {"gsm8k", "gsm8k_ppl", "gsm8k_mc", "arc_easy"}
    with pytest.raises(QserveError, match="unknown task mmlu; available: arc_easy, gsm8k, gsm8k_mc, gsm8k_ppl"):
        get_tasks(["mmlu"])
