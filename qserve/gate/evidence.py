"""The gate as a test by betting: one gate spec on one metric, both models' per-item values keyed by lm-eval's doc ids, and the evidence
so far -> the decision and the evidence to carry (`decide_gate`).

Each criterion of the spec becomes one hypothesis fixed before any score, in the units betting.py
bets on, so no allowance rests on a measured baseline:
- scores per item in [0, 1], higher is better (lm-eval's acc, acc_norm, exact_match, f1, ...):
  `max_drop` a bets on b_i - q_i against a (0/1 scores: the binary spec); `min_recovery` r bets on
  r b_i - q_i against 0 in [-1, r], since mean q > r mean b is recovery above r, exactly. Where lower
  is better (crows_pairs' pct_stereotype, a toxicity rate): `max_drop` a bets on q_i - b_i against a;
  `max_increase` a on q_i - (1 + a) b_i against 0 in [-(1 + a), 1], and `min_recovery` r (recovery
  b / q) on q_i - b_i / r against 0 in [-1/r, 1], each the criterion exactly. Scores in another range
  the gate declares (`score_range` [lo, hi]: truthfulqa_gen's bleu_max in [0, 100]) are the same bets
  in the ranges [lo, hi] gives; an item scored outside it fails the gate, named. The items
  are taken without replacement in the task's seeded order (`Population.in_order`); a group's pooled
  items in the group's order (`pooled`), size-biased by 1 / task size where lm-eval weighs its tasks alike.
- corpus perplexities (word_perplexity by words, byte_perplexity and bits_per_byte by bytes; lm-eval's
  per-document [loglikelihood, count]): `min_recovery` r lets the corpus perplexity rise by 1/r - 1,
  `max_increase` a by a, and on bits_per_byte `max_drop` b bits per byte is a byte perplexity rise of
  2^b - 1, exactly; on size-biased orders (betting.py says why), each document's loss change per word
  (or byte) within the spec's `cap` (default log 2). A criterion that would rest on the measured
  baseline (`max_drop` in perplexity points; bits_per_byte's `min_recovery` and `max_increase`, shares
  of its baseline's bits) is refused.
- lm-eval's `perplexity` on a task whose items are one target each (its output_type `loglikelihood`:
  lambada's last word): the same criteria per item (lm-eval's [loglikelihood, 1]), in the task's
  uniform seeded order, each item's loss change within the `cap` (default log 100, betting.DEFAULT_CAPS).
Anything else (per-item scores outside [0, 1] with no declared range) is refused.
`qserve eval` and `qserve gate` decide every gate `bettable` says yes to through `decide_gate`: scores
in [0, 1] or the declared range, corpus perplexities with each document's count as lm-eval counts it (`qserve eval`
counts them before any model runs, `qserve gate` reads them from the runs: on part of a task, lm-eval's
--limit in file order, a claim about the scored documents alone), and `perplexity` per target.
The rest (per-item values outside [0, 1] with no score_range, `perplexity` on a rolling task, the criteria refused above) keep stats.py's bounds.

A spec with several criteria passes only when every one passes (an intersection-union test: each at
alpha, so the pass keeps alpha), fails when any fails, and is inconclusive otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from qserve.gate import betting
from qserve.gate.order import in_seeded_order, item_order, pooled_order, pooled_weights, weighted_order
from qserve.gate.spending import ALPHA
from qserve.spec.gates import PERPLEXITY_UNITS, GateSpec, allowed_rises

ROUNDING = 1e-9  # a share of a declared range's width: a score past an end by less is that end, rounded


@dataclass(frozen=True)
class GateDecision:
    status: str  # "pass", "fail" or "inconclusive"
    criteria: dict[str, betting.Decision]  # criterion -> its test's decision and evidence
    reason: str
    alpha: float = ALPHA
    # criterion -> doc id -> the degradation bet on (what a simulation of more items draws from)
    terms: dict[str, dict[str, float]] | None = None

    def evidence(self) -> dict[str, str]:
        """What a later call continues from: each criterion's evidence as JSON."""
        return {c: d.evidence.to_json() for c, d in self.criteria.items()}


def hypotheses(gate: GateSpec, metric: str, higher_is_better: bool) -> dict[str, tuple[betting.Spec, float]]:
    """criterion -> (the spec bet on, the factor the baseline's per-item values are scaled by)."""
    name = metric.partition(",")[0]
    if name in PERPLEXITY_UNITS:
        return {c: (spec, 1.0) for c, spec in _corpus(gate, name).items()}
    lo, hi = gate.score_range or (0.0, 1.0)
    if higher_is_better:
        if gate.max_increase is not None:
            raise ValueError(
                f"{metric}: max_increase is for lower-is-better metrics; a score where higher is better takes max_drop"
            )
        # max_drop a bets on b_i - q_i against a; min_recovery r on r b_i - q_i against 0, in [r lo - hi, r hi - lo].
        scaled = {"min_recovery": gate.min_recovery}
    else:
        # Lower is better (a rate of stereotyped or toxic answers): q_i - b_i against a, or q_i - s b_i against 0,
        # in [lo - s hi, hi - s lo].
        scaled = {
            "min_recovery": None if gate.min_recovery is None else 1 / gate.min_recovery,
            "max_increase": None if gate.max_increase is None else 1 + gate.max_increase,
        }
    out: dict[str, tuple[betting.Spec, float]] = {}
    if gate.max_drop is not None:
        spec = betting.Spec("mean", gate.max_drop, higher_is_better, bounds=(lo - hi, hi - lo), scores=gate.score_range)
        out["max_drop"] = spec, 1.0
    for criterion, s in scaled.items():
        if s is not None:
            bounds = (s * lo - hi, s * hi - lo) if higher_is_better else (lo - s * hi, hi - s * lo)
            out[criterion] = betting.Spec("mean", 0.0, higher_is_better, bounds=bounds, scores=gate.score_range), s
    return out


def _corpus(gate: GateSpec, name: str) -> dict[str, betting.Spec]:
    """A corpus perplexity's criteria as bets on allowed rises of its perplexity (spec.gates.allowed_rises)."""
    rises = allowed_rises(gate, name)
    if on_baseline := sorted(set(gate.criteria()) - set(rises)):
        raise ValueError(f"{', '.join(on_baseline)} on {name} is in units of the measured baseline; no bet is declared before it")
    unit = PERPLEXITY_UNITS[name]
    cap = betting.DEFAULT_CAPS[unit] if gate.cap is None else gate.cap
    return {c: betting.Spec("perplexity", rise, cap=cap, unit=unit) for c, rise in rises.items()}


def decide_gate(
    base: dict[Any, Any],
    quant: dict[Any, Any],
    gate: GateSpec,
    metric: str,
    higher_is_better: bool,
    population: betting.Population,
    evidence: dict[str, str] | None = None,
    alpha: float = ALPHA,
    limit: int | None = None,
) -> GateDecision:
    """Decide one gate from the items both models scored. `population`: for scores, the task's doc ids
    `in_order` (the seeded order --limit takes); for perplexities, size-biased by words (or bytes). `evidence`:
    an earlier GateDecision.evidence() of the same gate, metric and population."""
    tests = hypotheses(gate, metric, higher_is_better)
    if gate.score_range is not None:  # an item scored outside it is no bet: not finite, so it fails the gate, named
        base, quant = (_outside_as_nan(side, *gate.score_range) for side in (base, quant))
    elif metric.partition(",")[0] not in PERPLEXITY_UNITS:
        _check_scores(metric, base, quant)
    if evidence is not None and set(evidence) != set(tests):
        raise ValueError(f"the evidence is of criteria {sorted(evidence)}, this gate's are {sorted(tests)}")
    decisions, terms = {}, {}
    for criterion, (spec, scale) in tests.items():
        carried = betting.Evidence.from_json(evidence[criterion]) if evidence else None
        scaled = base if scale == 1.0 else {k: scale * float(v) for k, v in base.items()}
        decisions[criterion] = betting.decide(scaled, quant, spec, population, carried, alpha, limit=limit)
        if spec.kind != "perplexity":
            sign = 1.0 if higher_is_better else -1.0  # the degradation bet on: baseline minus quantized, or the reverse
            terms[criterion] = {str(k): sign * (float(v) - float(quant[k])) for k, v in scaled.items() if k in quant}
        else:  # the loss change per word (or byte) bet on (the item's [loglikelihood, count])
            terms[criterion] = {str(k): (float(v[0]) - float(quant[k][0])) / float(v[1]) for k, v in base.items() if k in quant}
    reason = "; ".join(f"{c}: {d.reason}" for c, d in decisions.items())
    return GateDecision(_status(decisions), decisions, reason, alpha, terms or None)


def _status(decisions: dict[str, betting.Decision]) -> str:
    found = {d.decision for d in decisions.values()}
    return "fail" if "fail" in found else "pass" if found == {"pass"} else "inconclusive"


def _outside_as_nan(values: dict[Any, Any], lo: float, hi: float) -> dict[Any, float]:
    """Scores outside [lo, hi] as NaN; within rounding of an end (sacrebleu's exact match is 100.00000000000004), that end."""
    slack = ROUNDING * (hi - lo)
    return {k: min(max(float(v), lo), hi) if lo - slack <= float(v) <= hi + slack else math.nan for k, v in values.items()}


def _check_scores(metric: str, base: dict[Any, Any], quant: dict[Any, Any]) -> None:
    """Per-item scores must lie in [0, 1]: the range every bet on them is declared in."""
    for side, values in (("baseline", base), ("quantized", quant)):
        outside = [k for k, v in values.items() if not 0.0 <= float(v) <= 1.0]
        if outside:
            raise ValueError(
                f"{metric}: the {side}'s per-item value for document {outside[0]} is {values[outside[0]]}, outside [0, 1]; "
                "betting needs the range declared before scoring"
            )


def counted(metric: str) -> bool:
    """Whether a metric's gate bets on documents size-biased by their words or bytes (a corpus perplexity)."""
    return PERPLEXITY_UNITS.get(metric.partition(",")[0], "item") != "item"


def bettable(
    gate: GateSpec,
    metric: str,
    higher_is_better: bool,
    base: dict[Any, Any] | None,
    quant: dict[Any, Any] | None,
    counts: dict[int, float] | None = None,
    targets: bool = False,
) -> bool:
    """Whether `decide_gate` decides this gate today: per-item scores in [0, 1], or any numbers where the
    gate declares their score_range (max_increase only where lower is better); or a corpus perplexity ([loglikelihood, count] per document) with every document's
    `counts` (words or bytes), by which its order is size-biased, or lm-eval's `perplexity` on a task
    whose items are one target each (`targets`: its output_type is loglikelihood, not rolling), with
    criteria that do not rest on the measured baseline and an allowance inside the cap."""
    if not base or not quant:
        return False
    try:  # a criterion no bet is declared for (hypotheses says why): stats.py's checks and bound instead
        hypotheses(gate, metric, higher_is_better)
    except ValueError:
        return False
    if metric.partition(",")[0] in PERPLEXITY_UNITS:
        pairs = list(base.values()) + list(quant.values())
        known = counts is not None if counted(metric) else targets
        return known and all(isinstance(v, list) and len(v) == 2 for v in pairs)
    values = list(base.values()) + list(quant.values())
    if gate.score_range is not None:  # declared: a score outside it fails the gate, named (betting.py)
        return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    return all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in values)


@dataclass(frozen=True)
class Ordered:
    """The items a gate bets on, in the order it takes them. `whole`: a claim about the task (its seeded
    order from the first document, or every document); otherwise about the scored items alone, or with
    `after` about the task's documents after the first `after` of its order. `free`: every look takes a
    prefix of the same order, so one wealth process is watched and Ville's inequality holds over all
    looks; otherwise each look is a new test and spends its own share of 5 %."""

    population: betting.Population
    size: int
    whole: bool
    free: bool
    after: int = 0


def ordered(task: str, scored: list[str], size: int | None, counts: dict[int, float] | None = None) -> Ordered:
    """The population for `scored` doc ids of `task` with `size` documents: when they are the first items
    of the task's seeded order (what --limit takes), that whole order, a uniformly random order of the
    documents fixed before any score; otherwise (an --offset, or file order) the scored items alone, in
    the seeded order. A group gated as one: `pooled`. With `counts` (every document's words
    or bytes), the order is size-biased by them (gate/order.weighted_order)."""
    if counts is not None:
        return _size_biased(task, scored, counts, size)
    if size is not None and all(i.isdigit() for i in scored):
        order = [str(i) for i in item_order(task, size)]
        if set(order[: len(scored)]) == set(scored):
            return Ordered(betting.Population.in_order(order), size, True, True)
    own = in_seeded_order(task, scored)
    whole = size is None or len(own) == size
    return Ordered(betting.Population.in_order(own), len(own), whole, whole)


def pooled(group: str, scored: list[str], sizes: dict[str, int], by_size: bool = True) -> Ordered:
    """The population of a group gated as one: its tasks' items (`member/doc id`; `sizes`: each member's
    documents) in the group's pooled order (gate/order.pooled_order), the whole group when `scored` is a
    prefix of it (what `qserve eval --limit` takes). Weighted by 1 / member size where lm-eval weighs its
    members alike (not `by_size`), so the bet is on the mean of their means, the group's score. Any other
    set (lm-eval's own --limit, in file order) is the scored items alone, in the seeded order."""
    order = pooled_order(group, sizes, by_size)
    if set(order[: len(scored)]) == set(scored):
        population = betting.Population.in_order(order, None if by_size else pooled_weights(sizes))
        return Ordered(population, len(order), True, True)
    own = in_seeded_order(group, scored)
    return Ordered(betting.Population.in_order(own), len(own), False, False)


def _size_biased(task: str, scored: list[str], counts: dict[int, float], size: int | None = None) -> Ordered:
    """A corpus perplexity's population: the task's order size-biased by `counts` from its first document
    when `scored` is a prefix of it. An --offset block is the rest of that order after the documents before it (given
    those, the rest is a size-biased order of the remaining documents, as the race is memoryless), a
    claim about them. Any other set (file order, or a byte perplexity's documents that --limit took by
    their words), or `counts` of fewer than the task's `size` documents (runs made elsewhere on part of
    it), is the scored documents alone, in the race's order: a claim about them."""
    weights = {str(i): float(w) for i, w in counts.items()}
    order = [str(i) for i in weighted_order(task, weights)]
    place = {doc: k for k, doc in enumerate(order)}
    if unknown := sorted(set(scored) - set(place))[:5]:
        raise ValueError(f"{task}: scored documents outside the task: {', '.join(unknown)}")
    first = min((place[i] for i in scored), default=0)
    covers = size is None or len(order) >= size  # counts of every document: runs elsewhere count only theirs
    if covers and set(order[first : first + len(scored)]) == set(scored):
        rest = order[first:]
        population = betting.Population.in_order(rest, {i: weights[i] for i in rest})
        return Ordered(population, len(rest), first == 0, first == 0, first)
    own = [i for i in order if i in set(scored)]
    population = betting.Population.in_order(own, {i: weights[i] for i in own})
    whole = covers and len(own) == len(order)
    return Ordered(population, len(own), whole, whole)
