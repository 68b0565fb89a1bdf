"""The gate as a test by betting (qserve/gate/evidence.py): each criterion of a gate spec as a
hypothesis fixed before any score. Expected decisions come from counts computed here; on a test set
scored in full the test without replacement decides exactly, so the verdict is known in advance."""

from __future__ import annotations

import math
import random

import pytest

from qserve.gate.betting import Population, Spec
from qserve.gate.evidence import decide_gate, hypotheses
from qserve.spec.gates import GateSpec

SIZE = 1000
ORDER = random.Random(0).sample(range(SIZE), SIZE)  # a fixed order, as item_order gives one


def _scores(base_right: int, quant_right: int) -> tuple[dict, dict]:
    """0/1 scores: the baseline right on its first `base_right` ids, the quantized model on `quant_right` of those."""
    base = {i: float(i < base_right) for i in range(SIZE)}
    quant = {i: float(i < quant_right) for i in range(SIZE)}
    return base, quant


@pytest.mark.parametrize(("quant_right", "status"), [(576, "pass"), (564, "fail")])
def test_min_recovery_on_a_whole_test_set_is_the_recovery_itself(quant_right: int, status: str) -> None:
    """Baseline 600 of 1,000 right; recovery 576 / 600 = 0.96 passes a 0.95 gate, 564 / 600 = 0.94 fails it."""
    base, quant = _scores(600, quant_right)
    assert (quant_right / 600 > 0.95) == (status == "pass")
    got = decide_gate(base, quant, GateSpec(min_recovery=0.95), "acc,none", True, Population.in_order(ORDER))
    assert got.status == status, got.reason
    assert got.criteria["min_recovery"].items <= SIZE


@pytest.mark.parametrize(("quant_right", "status"), [(570, "pass"), (550, "fail")])
def test_max_drop_in_points(quant_right: int, status: str) -> None:
    """3 points lost passes a 4-point max_drop, 5 points fails it."""
    base, quant = _scores(600, quant_right)
    got = decide_gate(base, quant, GateSpec(max_drop=0.04), "exact_match,strict-match", True, Population.in_order(ORDER))
    assert got.status == status, got.reason


def test_every_criterion_must_pass_and_any_failure_fails() -> None:
    base, quant = _scores(600, 570)  # recovery 0.95 exactly: not above it; 3 points lost
    both = decide_gate(base, quant, GateSpec(min_recovery=0.95, max_drop=0.04), "acc,none", True, Population.in_order(ORDER))
    assert {c: d.decision for c, d in both.criteria.items()} == {"max_drop": "pass", "min_recovery": "inconclusive"}
    assert both.status == "inconclusive"
    base, quant = _scores(600, 560)  # recovery 0.933, 4 points lost: exactly the allowance, not beyond it
    worse = decide_gate(base, quant, GateSpec(min_recovery=0.95, max_drop=0.04), "acc,none", True, Population.in_order(ORDER))
    assert worse.criteria["min_recovery"].decision == "fail" and worse.status == "fail"


def test_perplexity_criteria_are_the_allowed_rise() -> None:
    specs = hypotheses(GateSpec(min_recovery=0.95, max_increase=0.05), "word_perplexity,none", False)
    assert specs["min_recovery"][0] == Spec("perplexity", 1 / 0.95 - 1)  # baseline / quantized >= 0.95
    assert specs["max_increase"][0] == Spec("perplexity", 0.05)
    with pytest.raises(ValueError, match="max_drop on word_perplexity is in units of the measured baseline"):
        hypotheses(GateSpec(max_drop=0.5), "word_perplexity,none", False)


def test_byte_perplexity_and_bits_per_byte_are_bets_by_bytes() -> None:
    """byte_perplexity's criteria are word perplexity's, per byte. bits_per_byte is log2 of byte
    perplexity: a max_drop of 0.1 bits per byte is a loss rise of 0.1 ln 2 nats per byte, exactly; its
    min_recovery and max_increase are shares of the baseline's bits, and are not bet on."""
    ((byte_spec, _),) = hypotheses(GateSpec(max_increase=0.05), "byte_perplexity,none", False).values()
    assert byte_spec == Spec("perplexity", 0.05, unit="byte")
    ((bits, _),) = hypotheses(GateSpec(max_drop=0.1), "bits_per_byte,none", False).values()
    assert bits.unit == "byte" and bits.bet_range() == pytest.approx((-math.log(2), math.log(2), 0.1 * math.log(2)), rel=1e-12)
    for spec in (GateSpec(min_recovery=0.95), GateSpec(max_drop=0.1, max_increase=0.05)):
        with pytest.raises(ValueError, match="on bits_per_byte is in units of the measured baseline"):
            hypotheses(spec, "bits_per_byte,none", False)


@pytest.mark.parametrize(("rise", "status"), [(0.01, "pass"), (0.12, "fail")])
def test_a_perplexity_gate_decides_on_the_corpus(rise: float, status: str) -> None:
    """Every document's loss rises by log(1 + rise) nats per word: the corpus perplexity by `rise`
    exactly, against the 5.26 % a 0.95 recovery allows."""
    rng = random.Random(1)
    words = {i: rng.randint(20, 200) for i in range(SIZE)}
    base = {i: [-2.0 * w, w] for i, w in words.items()}
    quant = {i: [-(2.0 + math.log1p(rise)) * w, w] for i, w in words.items()}
    got = decide_gate(base, quant, GateSpec(min_recovery=0.95), "word_perplexity,none", False, Population(words))
    assert got.status == status, got.reason


def test_evidence_continues_by_criterion() -> None:
    base, quant = _scores(600, 576)
    population = Population.in_order(ORDER)
    first = {i: base[i] for i in ORDER[:100]}, {i: quant[i] for i in ORDER[:100]}
    early = decide_gate(*first, GateSpec(min_recovery=0.95), "acc,none", True, population)
    assert early.status == "inconclusive" and early.criteria["min_recovery"].items == 100
    later = decide_gate(base, quant, GateSpec(min_recovery=0.95), "acc,none", True, population, early.evidence())
    whole = decide_gate(base, quant, GateSpec(min_recovery=0.95), "acc,none", True, population)
    assert (later.status, later.criteria["min_recovery"].items) == (whole.status, whole.criteria["min_recovery"].items)
    with pytest.raises(ValueError, match=r"the evidence is of criteria \['min_recovery'\], this gate's are \['max_drop'\]"):
        decide_gate(base, quant, GateSpec(max_drop=0.04), "acc,none", True, population, early.evidence())


def test_scores_outside_the_declared_range_are_refused() -> None:
    base, quant = _scores(600, 576)
    quant[3] = 1.5
    with pytest.raises(ValueError, match=r"f1,none: the quantized's per-item value for document 3 is 1.5, outside \[0, 1\]"):
        decide_gate(base, quant, GateSpec(max_drop=0.04), "f1,none", True, Population.in_order(ORDER))
    with pytest.raises(ValueError, match="acc,none: max_increase is for lower-is-better metrics"):
        hypotheses(GateSpec(max_increase=0.1), "acc,none", True)
    # Lower is better: each criterion is a bound on q_i - s b_i, its range from the scores' [0, 1].
    specs = hypotheses(GateSpec(max_drop=0.02, max_increase=0.05, min_recovery=0.8), "pct_stereotype,none", False)
    assert {c: (s.allowance, s.bounds, s.higher_is_better, scale) for c, (s, scale) in specs.items()} == {
        "max_drop": (0.02, (-1.0, 1.0), False, 1.0),
        "max_increase": (0.0, (-1.05, 1.0), False, 1.05),
        "min_recovery": (0.0, (-1.25, 1.0), False, 1.25),
    }


def test_a_lower_is_better_rate_bets_on_the_quantized_minus_the_scaled_baseline() -> None:
    """A stereotype rate (lower is better) of 600 on the baseline and 624 quantized, of SIZE: max_increase 0.05
    allows 630, so on the whole set it passes; 0.03 allows 618, so it fails. Each item's term is q_i - (1 + a) b_i."""
    base, quant = _scores(600, 0)
    quant = {i: float(i < 624) for i in range(SIZE)}
    for allowance, status in ((0.05, "pass"), (0.03, "fail")):
        found = decide_gate(
            base, quant, GateSpec(max_increase=allowance), "pct_stereotype,none", False, Population.in_order(ORDER)
        )
        assert found.status == status, found.reason
        assert found.terms == {"max_increase": {str(i): quant[i] - (1 + allowance) * base[i] for i in range(SIZE)}}


def test_a_prefix_of_the_seeded_order_claims_the_task_and_other_windows_only_their_items() -> None:
    """--limit 30 takes the first 30 of the task's seeded order (docs/gates.md's sha256 rule, recomputed in
    conftest): the bet is on the whole order, free over looks. --offset 30's block, file order and the
    whole set otherwise: the scored items alone, and only the whole set is free."""
    from conftest import expected_order

    from qserve.gate.evidence import ordered

    order = [str(i) for i in expected_order("t", 200)]
    first = ordered("t", sorted(order[:30]), 200)
    assert (first.size, first.whole, first.free, first.population.order) == (200, True, True, order)
    later = ordered("t", sorted(order[30:60]), 200)
    assert (later.size, later.whole, later.free, sorted(later.population.order)) == (30, False, False, sorted(order[30:60]))
    files = ordered("t", [str(i) for i in range(30)], 200)
    assert (files.size, files.whole, files.free) == (30, False, False)
    every = ordered("t", [str(i) for i in range(200)], None)
    assert (every.size, every.whole, every.free) == (200, True, True)


def test_word_perplexity_bets_on_the_size_biased_order_and_names_a_document_past_the_cap() -> None:
    """`qserve eval`'s word-perplexity gate: --limit's prefix of the race by words (recomputed in conftest)
    is a claim about the task, free over looks; an --offset block, about the documents after those before
    it; a set in file order, about itself. On a prefix with no loss it passes (each item's wealth factor
    is 1 + l log(1/0.95) > 1); a document whose loss rose by 0.8 nats per word is past the log 2 cap and
    fails the gate, named."""
    from conftest import expected_weighted_order

    from qserve.gate.evidence import bettable, ordered

    rng = random.Random(2)
    words = {i: float(rng.randint(20, 200)) for i in range(300)}
    order = [str(i) for i in expected_weighted_order("t", [words[i] for i in range(300)])]
    first = ordered("t", sorted(order[:150]), 300, words)
    assert (first.size, first.whole, first.free, first.after, first.population.order) == (300, True, True, 0, order)
    assert first.population.weighted and first.population.weights == {str(i): w for i, w in words.items()}
    block = ordered("t", sorted(order[150:200]), 300, words)
    assert (block.size, block.whole, block.free, block.after, block.population.order) == (150, False, False, 150, order[150:])
    files = ordered("t", [str(i) for i in range(50)], 300, words)
    assert (files.size, files.whole, files.free, files.population.order) == (50, False, False, [i for i in order if int(i) < 50])
    # Runs made elsewhere count only the documents they scored: whichever 150 they are (here the prefix
    # the whole counts would make a claim about the task), the 300-document task is not theirs to claim.
    scored = {int(i): words[int(i)] for i in order[:150]}
    elsewhere = ordered("t", sorted(order[:150]), 300, scored)
    assert (elsewhere.size, elsewhere.whole, elsewhere.free) == (150, False, False)
    assert elsewhere.population.order == order[:150]  # the race restricted to them: each finish time is its own
    base = {i: [-2.0 * words[int(i)], words[int(i)]] for i in order[:150]}
    quant = {i: list(v) for i, v in base.items()}
    assert bettable(GateSpec(min_recovery=0.95), "word_perplexity,none", False, base, quant, words)
    assert not bettable(GateSpec(min_recovery=0.95), "word_perplexity,none", False, base, quant, None)
    assert bettable(GateSpec(min_recovery=0.95), "byte_perplexity,none", False, base, quant, words)  # the counts as bytes
    assert not bettable(GateSpec(min_recovery=0.95), "bits_per_byte,none", False, base, quant, words)  # a share of its bits
    assert not bettable(GateSpec(max_increase=1.0), "word_perplexity,none", False, base, quant, words)  # log 2: the cap
    same = decide_gate(base, quant, GateSpec(min_recovery=0.95), "word_perplexity,none", False, first.population)
    assert same.status == "pass" and same.criteria["min_recovery"].items < 150, same.reason
    broken = quant | {order[7]: [-(2.0 + 0.8) * words[int(order[7])], words[int(order[7])]]}
    got = decide_gate(base, broken, GateSpec(min_recovery=0.95), "word_perplexity,none", False, first.population)
    assert got.status == "fail" and f"document {order[7]}: the loss changed by more than the cap of 0.693" in got.reason


def test_a_recipe_may_declare_the_cap_and_a_cap_that_could_never_fail_is_refused() -> None:
    """`cap` is the range word perplexity's bet is declared in: a recipe's replaces log 2 in every
    criterion; a cap on another metric, or at or below log(1 + the allowed rise), is one error line."""
    from qserve.errors import InvalidSpec
    from qserve.spec.gates import check_allowance

    spec = GateSpec(min_recovery=0.95, max_increase=0.04, cap=0.405)
    found = hypotheses(spec, "word_perplexity,none", False)
    assert {c: s.cap for c, (s, _) in found.items()} == {"min_recovery": 0.405, "max_increase": 0.405}
    assert {c: s.bet_range()[:2] for c, (s, _) in found.items()} == {c: (-0.405, 0.405) for c in found}
    check_allowance("gsm8k_ppl", spec, "word_perplexity,none")
    # lambada's `perplexity` bets per item, by default within log 100 (a word 100 times less or more likely)
    ((per_item, scale),) = hypotheses(GateSpec(max_increase=0.05), "perplexity,none", False).values()
    assert (per_item.kind, per_item.unit, per_item.bet_range(), scale) == (
        "perplexity",
        "item",
        (-math.log(100), math.log(100), math.log1p(0.05)),
        1.0,
    )
    assert hypotheses(GateSpec(max_increase=0.05, cap=2.0), "perplexity,none", False)["max_increase"][0].cap == 2.0
    with pytest.raises(
        InvalidSpec,
        match=r"cap bounds a perplexity's per-document loss change \(word_perplexity, byte_perplexity, bits_per_byte, perplexity\), not acc",
    ):
        check_allowance("arc", GateSpec(min_recovery=0.95, cap=0.4), "acc,none")
    with pytest.raises(  # 0.1 bits per byte: log(1 + 2^0.1 - 1) = 0.1 ln 2 = 0.06931 nats per byte
        InvalidSpec, match=r"cap 0\.06 nats per byte is at or below the allowed rise's log\(1 \+ 0\.07177\) = 0\.06931"
    ):
        check_allowance("wikitext", GateSpec(max_drop=0.1, cap=0.06), "bits_per_byte,none")
    with pytest.raises(
        InvalidSpec, match=r"cap 0\.05 nats per word is at or below the allowed rise's log\(1 \+ 0\.05263\) = 0\.05129"
    ):
        check_allowance("gsm8k_ppl", GateSpec(min_recovery=0.95, cap=0.05), "word_perplexity,none")


# truthfulqa_gen's bleu_max: each answer's best BLEU against the true references, 0 to 100, on 817 questions.
TRUTHFUL = 817
BLEU = (0.0, 100.0)


def _bleu_pair(rng: random.Random, drop: float) -> tuple[dict, dict]:
    """Baseline BLEU-like scores (a third of the answers 0, the rest spread up to 100) and the quantized
    model's, each `drop` points lower where there is room (clipped at 0)."""
    base = {i: 0.0 if rng.random() < 1 / 3 else min(100.0, rng.expovariate(1 / 30)) for i in range(TRUTHFUL)}
    quant = {i: max(0.0, v - drop) for i, v in base.items()}
    return base, quant


def test_a_declared_score_range_bets_as_the_same_scores_scaled_into_0_1() -> None:
    """Every criterion on scores in [0, 100] is the bet on the same scores divided by 100 in [0, 1] (the bet is
    scale-free: its range, allowance and pseudo-item scale together), so the level and power shown for [0, 1]
    carry over; computed here through both ranges."""
    base, quant = _bleu_pair(random.Random(5), drop=1.0)
    order = Population.in_order(random.Random(6).sample(range(TRUTHFUL), TRUTHFUL))
    for points, range_spec, unit_spec in (
        (True, GateSpec(max_drop=2.0, score_range=BLEU), GateSpec(max_drop=0.02)),
        (True, GateSpec(min_recovery=0.9, score_range=BLEU), GateSpec(min_recovery=0.9)),
        (False, GateSpec(max_increase=0.05, max_drop=2.0, score_range=BLEU), GateSpec(max_increase=0.05, max_drop=0.02)),
    ):
        scaled = [{i: v / 100 for i, v in side.items()} for side in (base, quant)]
        sides = (base, quant) if points else (quant, base)  # lower is better: the quantized model scored lower
        wide = decide_gate(*sides, range_spec, "bleu_max,none", points, order)
        unit = decide_gate(*(scaled if points else scaled[::-1]), unit_spec, "bleu_max,none", points, order)
        assert wide.status == unit.status and set(wide.criteria) == set(unit.criteria)
        for c in wide.criteria:
            w, u = wide.criteria[c], unit.criteria[c]
            assert (w.decision, w.items) == (u.decision, u.items)
            assert math.log(w.wealth_pass) == pytest.approx(math.log(u.wealth_pass), abs=1e-9)
            assert math.log(w.wealth_fail) == pytest.approx(math.log(u.wealth_fail), abs=1e-9)
    assert {
        c: s.bet_range()
        for c, (s, _) in hypotheses(GateSpec(max_drop=2.0, min_recovery=0.9, score_range=BLEU), "bleu_max,none", True).items()
    } == {
        "max_drop": (-100.0, 100.0, 2.0),
        "min_recovery": (-100.0, 90.0, 0.0),  # 0.9 b - q over b, q in [0, 100]
    }


@pytest.mark.parametrize(("drop", "status"), [(0.5, "pass"), (4.0, "fail")])
def test_bleu_in_its_declared_range_passes_a_small_drop_and_fails_a_large_one(drop: float, status: str) -> None:
    """Every answer scored: the mean BLEU drop (recomputed here) against max_drop 2 points decides exactly."""
    base, quant = _bleu_pair(random.Random(7), drop)
    mean_drop = sum(base[i] - quant[i] for i in base) / TRUTHFUL
    assert (mean_drop < 2.0) == (status == "pass") and 0 < mean_drop
    order = Population.in_order(random.Random(8).sample(range(TRUTHFUL), TRUTHFUL))
    got = decide_gate(base, quant, GateSpec(max_drop=2.0, score_range=BLEU), "bleu_max,none", True, order)
    assert got.status == status, got.reason


def test_a_score_outside_the_declared_range_fails_the_gate_naming_it() -> None:
    base, quant = _bleu_pair(random.Random(9), drop=0.5)
    quant[12] = 100.5
    quant[13] = 100.00000000000004  # sacrebleu's exact match: rounding, not outside the range
    order = Population.in_order(random.Random(10).sample(range(TRUTHFUL), TRUTHFUL))
    got = decide_gate(base, quant, GateSpec(max_drop=2.0, score_range=BLEU), "bleu_max,none", True, order)
    assert got.status == "fail"
    assert got.reason == (
        "max_drop: document 12: a score lies outside the declared score_range [0, 100] (or is not finite): the test cannot bet on it"
    )


@pytest.mark.parametrize(
    ("spec", "metric", "message"),
    [
        (
            {"max_drop": 2.0, "score_range": (0.0, 1.5)},
            "bleu_max,none",
            "gate on truthfulqa_gen: max_drop=2 on bleu_max, whose items score in [0, 1.5], can never fail; give a drop below 1.5",
        ),
        (
            {"min_recovery": 0.9, "score_range": (-100.0, 100.0)},
            "bleu_diff,none",
            "gate on truthfulqa_gen: a recovery or a relative increase of bleu_diff needs scores of one sign; "
            "its score_range [-100, 100] takes max_drop",
        ),
        (
            {"max_increase": 0.05, "score_range": (0.0, 100.0)},
            "word_perplexity,none",
            "gate on truthfulqa_gen: score_range is for per-item scores; word_perplexity is bet on within its cap",
        ),
    ],
)
def test_a_score_range_that_could_never_fail_or_does_not_apply_is_one_error_line(spec: dict, metric: str, message: str) -> None:
    from qserve.errors import InvalidSpec
    from qserve.spec.gates import check_allowance

    with pytest.raises(InvalidSpec) as e:
        check_allowance("truthfulqa_gen", GateSpec(**spec), metric)
    assert str(e.value) == message


def test_a_score_range_names_its_lowest_score_first() -> None:
    from pydantic import ValidationError

    with pytest.raises(
        ValidationError, match=r"score_range \[100\.0, 0\.0\] must name the lowest score first, then a higher one"
    ):
        GateSpec(max_drop=2.0, score_range=(100.0, 0.0))


def test_a_recipe_declares_a_score_range_as_yaml_writes_it() -> None:
    from qserve.spec.recipe import parse_recipe

    text = "name: r\nscheme: W8A8\ngates:\n  truthfulqa_gen: {metric: bleu_max, max_drop: 2, score_range: [0, 100]}\n"
    (gate,) = parse_recipe(text, "r.yaml").gates["truthfulqa_gen"]
    assert (gate.metric, gate.max_drop, gate.score_range) == ("bleu_max", 2.0, (0.0, 100.0))
