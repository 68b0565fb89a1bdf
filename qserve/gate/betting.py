"""Evidence by betting: a non-inferiority gate whose level holds however often, and after however
many items, it is looked at (a library; `qserve eval` and `qserve gate` do not call it yet).

Both models score the same items; item i's degradation d_i (baseline minus quantized, for a score
where higher is better) lies in a range [lo, hi] declared before any score is seen. Two bettors start
with wealth 1 and bet on each item in turn:

- against H0_pass "mean degradation >= delta": K_t = prod_i (1 + l_i (delta - d_i)), 0 <= l_i < 1 / (hi - delta);
- against H0_fail "mean degradation <= delta": K'_t = prod_i (1 + l'_i (d_i - delta)), 0 <= l'_i < 1 / (delta - lo).

Each bet depends on the items before it only (it is predictable), and the bounds on l keep every
factor positive. Assumption: given the items before it, each item's degradation has mean >= delta
under H0_pass (<= delta under H0_fail); items drawn independently from the task's documents with
that mean are the usual case. Then K_t is a nonnegative supermartingale and Ville's inequality gives
P(K_t >= 1/alpha at any t) <= alpha (Waudby-Smith and Ramdas, "Estimating means of bounded random
variables by betting", JRSSB 2024, their testing-by-betting construction with Ville's inequality).
So the gate passes the first time K_t reaches 1/alpha, fails the first time K'_t does, and stays
inconclusive otherwise; stopping at any look, with batches chosen from the wealth so far, keeps the
level, so no alpha is spent per look. The level rests on the declared range and on predictability
alone, for every distribution in the range: no constant of the bettor is set from a simulation.

The bet is the paper's aGRAPA ("approximate growth rate adapted to the particular alternative", its
section on GRAPA and aGRAPA): the Kelly bet to second order with plug-in moments,
    l_t = g / (s2_{t-1} + g^2), g = delta - mu_{t-1}, truncated to [0, c / (hi - delta)]
(the fail bettor mirrors it), where mu_t and s2_t are the paper's regularised running mean and
variance: one pseudo-item at the range's midpoint, variance (half the range's width)^2 (its 1/2 and
1/4 on [0, 1]), and s2 sums (d_i - mu_i)^2. Why aGRAPA: a gate wants its wealth to grow fastest
when the model is good, and aGRAPA tracks the growth-optimal constant bet, so the log-wealth grows in
proportion to the items. The paper's predictable plug-in (PrPl, l_t ~ sqrt(2 log(1/alpha) /
(s2 t log(1 + t)))) shrinks every bet as t grows whatever the items say: right for a confidence
sequence's width at every t, slow for a test. aGRAPA does not depend on alpha, either.
c = 1/2 is the truncation the paper suggests (1/2 or 3/4) and its authors' code's default: an item at
the worst end of the range at most halves the wealth, so one outlier cannot wipe out a bettor.

The price of a range: when the per-item spread is small next to the range, the truncation, not the
Kelly bet, sets the bet, and the items a decision needs grow with (hi - delta) / (delta - mean).

Kinds of items (Spec):
- binary: 0/1 scores, d in {-1, 0, 1}, range [-1, 1], delta = the allowance in points.
- mean: other per-item scores, with the degradation's range declared (`bounds`).
- perplexity: corpus word perplexity exp(sum loss / sum words) may rise by a share a at most:
  exp(sum x_j / sum w_j) <= 1 + a  <=>  sum_j (x_j - log(1 + a) w_j) <= 0, with x_j the quantized
  model's loss on document j minus the baseline's and w_j its words. So the bet is on
  d_j = (x_j - log(1 + a) w_j) / W against delta = 0: its mean over documents is <= 0 exactly when
  the corpus condition holds (for the documents' population). The range comes from a declared cap on
  a document's loss change per word, |x_j| / w_j <= cap, and W, the task's longest document in words
  (counted from the texts, as lm-eval counts them, before any score is seen):
  d_j in [-(cap + c_a), cap - c_a] with c_a = log(1 + a). W is a property of the task, not of the
  items drawn: a bound taken from the items scored so far would let a later, longer document break
  the range, and a bet scaled by each document's own length would bet on length, which the corpus
  condition says nothing about. The default cap, log 2, says a quantized model that doubles (or
  halves) a document's perplexity is broken on that document whatever the corpus says: a document
  beyond the cap fails the gate, naming it, before any bet.

Items are consumed in a seeded random order (a hash of the seed and the doc id), fixed before any
score is seen: lm-eval's documents come in the dataset's order (by source, length or difficulty),
and the order must say nothing about an item's degradation. Items already consumed add nothing, so a
later call with more items continues the same wealth (Evidence carries it); the seed, the level and
the spec travel with it and cannot change midway. A decision is final: once a bettor reaches 1/alpha
the test has stopped, and later items are not consumed.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from qserve.gate.spending import ALPHA

TRUNCATION = 0.5  # c: the paper's suggested truncation (the docstring says why)
DEFAULT_CAP = math.log(2)  # perplexity: a document whose perplexity doubles or halves fails the gate
KINDS = ("binary", "mean", "perplexity")
NAMED = 5  # documents a failure names at most


@dataclass(frozen=True)
class Spec:
    """What is bet on. `allowance`: binary and mean, the largest allowed mean degradation in the
    score's units; perplexity, the largest relative rise of corpus perplexity (0.05 = +5 %)."""

    kind: str
    allowance: float
    higher_is_better: bool = True  # binary and mean: which way the score is better
    bounds: tuple[float, float] | None = None  # mean: the declared range of a per-item degradation
    cap: float = DEFAULT_CAP  # perplexity: the largest |loss change| per word a document may show
    max_words: int | None = None  # perplexity: the task's longest document, in words

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a betting spec's kind is one of {', '.join(KINDS)}, not {self.kind!r}")
        lo, hi, delta = self.bet_range()
        if not lo < delta < hi:
            raise ValueError(f"the allowance must lie inside the degradation's range [{lo:g}, {hi:g}]")

    def bet_range(self) -> tuple[float, float, float]:
        """(lo, hi, delta): the range of the quantity bet on, and the null boundary."""
        if self.kind == "binary":
            return -1.0, 1.0, float(self.allowance)
        if self.kind == "mean":
            if self.bounds is None:
                raise ValueError("a mean spec needs bounds: the range of a per-item degradation, declared before scoring")
            return float(self.bounds[0]), float(self.bounds[1]), float(self.allowance)
        if self.max_words is None or self.max_words < 1:
            raise ValueError("a perplexity spec needs max_words: the task's longest document in words, counted from its text")
        if self.allowance <= 0:
            raise ValueError(f"a perplexity allowance is a relative rise above 0, not {self.allowance}")
        c = math.log1p(self.allowance)
        return -(self.cap + c), self.cap - c, 0.0


@dataclass(frozen=True)
class Evidence:
    """Everything a later call needs to continue: JSON-serialisable (`to_json`, `from_json`)."""

    seed: int
    alpha: float
    spec: dict[str, Any]
    items: int = 0
    sum_d: float = 0.0  # sum of the degradations bet on so far
    sum_sq: float = 0.0  # sum of (d_i - mu_i)^2: the bettor's running variance
    log_wealth_pass: float = 0.0
    log_wealth_fail: float = 0.0
    consumed: tuple[str, ...] = field(default_factory=tuple)
    decision: str | None = None  # "pass" or "fail" once final
    reason: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Evidence:
        data = json.loads(text)
        return cls(**(data | {"consumed": tuple(data["consumed"])}))


@dataclass(frozen=True)
class Decision:
    decision: str  # "pass", "fail" or "inconclusive"
    wealth_pass: float  # against "degradation >= allowance"; a pass needs 1/alpha
    wealth_fail: float  # against "degradation <= allowance"
    items: int  # consumed over every call so far
    new_items: int  # consumed by this call
    reason: str
    evidence: Evidence


def decide(
    base: dict[Any, Any],
    quant: dict[Any, Any],
    spec: Spec,
    evidence: Evidence | None = None,
    alpha: float = ALPHA,
    order_seed: int | None = None,
) -> Decision:
    """Bet on every item both models scored that `evidence` has not consumed, in the seeded order,
    until a bettor reaches 1/alpha. Values: binary and mean, the item's score; perplexity, lm-eval's
    [loglikelihood, words]. `order_seed` must be fixed before any score is seen (default 0, or the
    evidence's)."""
    evidence = _start(spec, evidence, alpha, order_seed)
    if evidence.decision is not None:
        return _decision(evidence, 0)
    done = set(evidence.consumed)
    # Doc ids as strings, as JSON keeps them; only items both models scored are paired.
    b, q = ({str(k): v for k, v in side.items()} for side in (base, quant))
    ids = order((i for i in b if i in q and i not in done), evidence.seed)
    d, outside = _degradations(spec, [b[i] for i in ids], [q[i] for i in ids])
    if outside:
        named = ", ".join(ids[j] for j in outside[:NAMED]) + (" ..." if len(outside) > NAMED else "")
        why = _outside_why(spec)
        return _decision(replace(evidence, decision="fail", reason=f"document {named}: {why}"), 0)
    return _bet(evidence, spec, ids, d)


def order(ids, seed: int) -> list[str]:
    """Doc ids in the seeded order they are consumed in: a hash, so the same id always has the same place."""
    return sorted(ids, key=lambda i: hashlib.sha256(f"{seed}\0{i}".encode()).digest())


def wealth_paths(d, lo: float, hi: float, delta: float, start: tuple[float, ...] | None = None) -> dict[str, Any]:
    """The bettors on degradations `d` (items on axis 0; further axes are independent replicates, as the
    simulations pass them), continuing from `start` = (items, sum_d, sum_sq, log_wealth_pass,
    log_wealth_fail). Each returned array has one row more than `d`: row k is the state after k items."""
    import numpy as np

    d = np.asarray(d, dtype=float)
    t0, s0, q0, lp0, lf0 = start or (0, 0.0, 0.0, 0.0, 0.0)
    rest = d.shape[1:]
    t = (t0 + np.arange(d.shape[0] + 1, dtype=float)).reshape((-1,) + (1,) * len(rest))
    head = np.ones((1,) + rest)
    # Running sums start from the carried state, so a continued call adds in the same order as one call.
    sums = np.cumsum(np.concatenate([head * s0, d]), axis=0)
    mean = ((lo + hi) / 2 + sums) / (t + 1)
    sq = np.cumsum(np.concatenate([head * q0, (d - mean[1:]) ** 2]), axis=0)
    var = (((hi - lo) / 2) ** 2 + sq) / (t + 1)
    gap = delta - mean[:-1]
    kelly = gap / (var[:-1] + gap * gap)
    bet_pass = np.clip(kelly, 0.0, TRUNCATION / (hi - delta))
    bet_fail = np.clip(-kelly, 0.0, TRUNCATION / (delta - lo))
    log_pass = np.cumsum(np.concatenate([head * lp0, np.log1p(bet_pass * (delta - d))]), axis=0)
    log_fail = np.cumsum(np.concatenate([head * lf0, np.log1p(bet_fail * (d - delta))]), axis=0)
    return {"sum_d": sums, "sum_sq": sq, "log_wealth_pass": log_pass, "log_wealth_fail": log_fail}


def perplexity_terms(loss_change, words, spec: Spec):
    """d_j = (x_j - log(1 + a) w_j) / W for loss changes x_j (nats, quantized minus baseline) and words
    w_j (numpy arrays of any shape)."""
    import numpy as np

    c = math.log1p(spec.allowance)
    return (np.asarray(loss_change, dtype=float) - c * np.asarray(words, dtype=float)) / spec.max_words


def _start(spec: Spec, evidence: Evidence | None, alpha: float, seed: int | None) -> Evidence:
    """The evidence to continue, checked against this call's spec, level and seed."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha lies in (0, 1), not {alpha}")
    spec_dict = json.loads(json.dumps(asdict(spec)))  # as it reads back from JSON
    if evidence is None:
        return Evidence(seed=0 if seed is None else int(seed), alpha=alpha, spec=spec_dict)
    # A level, spec or order chosen after seeing the wealth would be a choice among tests.
    for what, ours, theirs in (("alpha", alpha, evidence.alpha), ("spec", spec_dict, evidence.spec)):
        if ours != theirs:
            raise ValueError(f"the evidence was gathered at {what} {theirs}, not {ours}: start new evidence for a new test")
    if seed is not None and int(seed) != evidence.seed:
        raise ValueError(f"the evidence's items were ordered with seed {evidence.seed}, not {seed}")
    return evidence


def _degradations(spec: Spec, base: list, quant: list) -> tuple[list[float], list[int]]:
    """The per-item quantity bet on, and the positions of items outside the declared range."""
    lo, hi, _ = spec.bet_range()
    d, outside = [], []
    for j, (b, q) in enumerate(zip(base, quant)):
        if spec.kind == "perplexity":
            value, ok = _perplexity_term(spec, b, q)
        else:
            if spec.kind == "binary" and not {float(b), float(q)} <= {0.0, 1.0}:
                raise ValueError(f"a binary spec takes 0/1 scores, not {b!r} and {q!r}")
            value = float(b) - float(q) if spec.higher_is_better else float(q) - float(b)
            ok = math.isfinite(value) and lo <= value <= hi
        d.append(value)
        if not ok:
            outside.append(j)
    return d, outside


def _perplexity_term(spec: Spec, base: list, quant: list) -> tuple[float, bool]:
    (ll_base, words), (ll_quant, words_quant) = base, quant
    if words != words_quant or not 0 < words <= spec.max_words:
        raise ValueError(
            f"a document's words must be the same for both models and within 1..max_words ({spec.max_words}): "
            f"{words} and {words_quant}"
        )
    change = float(ll_base) - float(ll_quant)  # the loss is minus the log-likelihood
    ok = math.isfinite(change) and abs(change) / words <= spec.cap
    return (float(perplexity_terms(change, words, spec)) if ok else math.nan), ok


def _outside_why(spec: Spec) -> str:
    if spec.kind == "perplexity":
        return (
            f"the loss changed by more than the cap of {spec.cap:.3g} nats per word (or is not finite): the model is broken on it"
        )
    lo, hi, _ = spec.bet_range()
    return f"the degradation lies outside the declared range [{lo:g}, {hi:g}] (or is not finite): the test cannot bet on it"


def _bet(evidence: Evidence, spec: Spec, ids: list[str], d: list[float]) -> Decision:
    """Bet on the new items in order; stop at the first item a bettor reaches 1/alpha on."""
    import numpy as np

    if not ids:
        return _decision(evidence, 0)
    lo, hi, delta = spec.bet_range()
    start = (evidence.items, evidence.sum_d, evidence.sum_sq, evidence.log_wealth_pass, evidence.log_wealth_fail)
    paths = wealth_paths(d, lo, hi, delta, start)
    threshold = math.log(1 / evidence.alpha)
    crossed = (paths["log_wealth_pass"][1:] >= threshold) | (paths["log_wealth_fail"][1:] >= threshold)
    k = int(np.argmax(crossed)) + 1 if crossed.any() else len(ids)
    state = {key: float(paths[key][k]) for key in paths}
    verdict = "pass" if state["log_wealth_pass"] >= threshold else "fail" if state["log_wealth_fail"] >= threshold else None
    total = evidence.items + k
    reason = None
    if verdict is not None:
        side = "<" if verdict == "pass" else ">"
        reason = (
            f"the wealth against the mean degradation being {'at or above' if verdict == 'pass' else 'at or below'} "
            f"the allowance reached 1/alpha = {1 / evidence.alpha:.3g} after {total} items: degradation {side} allowance"
        )
    new = replace(evidence, items=total, consumed=evidence.consumed + tuple(ids[:k]), decision=verdict, reason=reason, **state)
    return _decision(new, k)


def _decision(evidence: Evidence, new_items: int) -> Decision:
    wealth_pass, wealth_fail = math.exp(evidence.log_wealth_pass), math.exp(evidence.log_wealth_fail)
    reason = evidence.reason or (
        f"neither bettor reached 1/alpha = {1 / evidence.alpha:.3g} after {evidence.items} items "
        f"(wealth for a pass {wealth_pass:.3g}, for a fail {wealth_fail:.3g}): more items continue the evidence"
    )
    return Decision(evidence.decision or "inconclusive", wealth_pass, wealth_fail, evidence.items, new_items, reason, evidence)
