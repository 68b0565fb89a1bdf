"""Evidence by betting: a non-inferiority gate whose level holds however often, and after however
many items, it is looked at (a library; `qserve eval` and `qserve gate` call it through evidence.py).

Both models score the same items; item i's degradation d_i (baseline minus quantized, for a score
where higher is better) lies in a range [lo, hi] declared before any score is seen. Two bettors start
with wealth 1 and bet on each item in turn:

- against H0_pass "mean degradation >= delta": K_t = prod_i (1 + l_i (delta - d_i)), 0 <= l_i < 1 / (hi - delta);
- against H0_fail "mean degradation <= delta": K'_t = prod_i (1 + l'_i (d_i - delta)), 0 <= l'_i < 1 / (delta - lo).

Each bet depends on the items before it only (it is predictable), and the bounds on l keep every
factor positive. Assumption: given the items before it, each item's degradation has mean >= delta
under H0_pass (<= delta under H0_fail); the draws below make it hold by construction. Then K_t is
a nonnegative supermartingale and Ville's inequality gives P(K_t >= 1/alpha at any t) <= alpha
(Waudby-Smith and Ramdas, "Estimating means of bounded random variables by betting", JRSSB 2024,
their testing-by-betting construction with Ville's inequality). So the gate passes the first time
K_t reaches 1/alpha, fails the first time K'_t does, and stays inconclusive otherwise; stopping at
any look, with batches chosen from the wealth so far, keeps the level, so no alpha is spent per
look. The level rests on the declared range and on predictability alone, for every distribution in
the range: no constant of the bettor is set from a simulation.

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

Items are draws, with replacement, from the task's documents (its population, given before any
score: every doc id, and for perplexity its words counted from the text as lm-eval counts them). The
k-th draw is fixed by a hash of the seed and k, so the sequence is the same on every call, and a
limit of N draws (what `--limit N` is to mean once the gate draws) is the same N on every call. Drawing makes the assumption above true by construction:
the draws are independent and each has the population's distribution, whatever order the dataset
keeps its documents in (by source, length or difficulty), so the guarantee speaks of the task's
documents, not of a sample's luck. The same document may be drawn again; its scores are known, so a
repeat costs no evaluation, and once every document is scored the draws go on until a bettor decides
(the decision then is about the whole test set, exactly).

Kinds of items (Spec):
- binary: 0/1 scores, d in {-1, 0, 1}, range [-1, 1], delta = the allowance in points; uniform draws.
- mean: other per-item scores, with the degradation's range declared (`bounds`); uniform draws.
- perplexity: corpus word perplexity exp(sum loss / sum words) may rise by a share a at most:
  sum_j x_j / sum_j w_j <= log(1 + a), with x_j the quantized model's loss on document j minus the
  baseline's and w_j its words. Documents are drawn with probability proportional to their words
  (size-biased), and the item is the document's loss change per word, r_j = x_j / w_j: its mean over
  such draws is sum_j w_j r_j / sum_j w_j = sum x / sum w, the corpus condition itself. So the bet is
  on r against delta = log(1 + a), in the range [-cap, cap] of a declared cap on a document's loss
  change per word. Weighting the draws, not the items, keeps every item on the same per-word scale: an
  item divided by the longest document's length would make the usual document small next to the
  range, and the truncation, not the Kelly bet, would set the bet (about longest / mean length times
  the items). The default cap, log 2, says a quantized model that doubles (or halves) a document's
  perplexity is broken on that document whatever the corpus says: a scored document beyond the cap
  fails the gate, naming it, before any bet. Byte perplexity and bits per byte are the same bet by
  bytes (`unit`), a bits-per-byte allowance of b bits a rise of 2^b - 1. lm-eval's `perplexity`
  (lambada's: exp of minus the mean log-likelihood of each item's target) is the same bet per item
  (`unit` "item": every weight 1, so the order is uniform), within a cap per item (DEFAULT_CAPS).

Without replacement (`wor_paths`): a finite test set's items in the uniformly random order `--limit`
takes them (gate/order.item_order), each once, bet against the mean the remaining items
would need; Ville's inequality holds the same way and the last item decides exactly. For 0/1 and
bounded scores it needs fewer items than draws (tests/test_betting_wor.py prints both). For corpus
perplexity a uniform order would have to bet on each document's loss change weighted by its length,
whose range the longest document sets (on GSM8K's answers, more documents than the size-biased draws
touch); so its order is size-biased instead (`in_order` with every document's words:
gate/order.weighted_order), each next document taken with probability its words over the words not
yet taken, and the bet is on the per-word change against the weighted mean the rest would need
(`wor_paths` with weights): the draws' per-word scale without their repeats, and no more documents
than the draws on GSM8K's lengths. `qserve eval --limit` takes that order on word-perplexity tasks.

Evidence carries the draws consumed, the bettors' state, the seed, the level, the spec and a digest of
the population; a later call continues from the next draw, draws already consumed add nothing, and
the seed, the level, the spec and the population cannot change midway. A decision is final: once a
bettor reaches 1/alpha the test has stopped, and later draws are not consumed.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from qserve.gate.spending import ALPHA
from qserve.spec.gates import PERPLEXITY_UNITS

TRUNCATION = 0.5  # c: the paper's suggested truncation (the docstring says why)
# perplexity: the declared range of a document's loss change per unit. Per word or byte, log 2: a document
# whose perplexity doubles or halves fails the gate. One item's target (lambada's last word) moves far
# more than a document's average does (docs/gates.md has the measurement): per item, log 100.
DEFAULT_CAPS = {"word": math.log(2), "byte": math.log(2), "item": math.log(100)}
DEFAULT_CAP = DEFAULT_CAPS["word"]
KINDS = ("binary", "mean", "perplexity")
NAMED = 5  # documents a failure names at most
MAX_DRAWS = 100_000  # draws one call makes at most once every document is scored
BLOCK = 1024  # draws made at a time


@dataclass(frozen=True)
class Spec:
    """What is bet on. `allowance`: binary and mean, the largest allowed mean degradation in the
    score's units; perplexity, the largest relative rise of corpus perplexity (0.05 = +5 %)."""

    kind: str
    allowance: float
    higher_is_better: bool = True  # binary and mean: which way the score is better
    bounds: tuple[float, float] | None = None  # mean: the declared range of a per-item degradation
    cap: float = DEFAULT_CAP  # perplexity: the largest |loss change| per unit a document may show
    unit: str = "word"  # perplexity: what its log-likelihoods are divided by ("word", "byte" or "item")
    scores: tuple[float, float] | None = None  # mean: the declared range of each model's per-item score, if not [0, 1]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a betting spec's kind is one of {', '.join(KINDS)}, not {self.kind!r}")
        if self.unit not in PERPLEXITY_UNITS.values():
            raise ValueError(
                f"a perplexity's unit is one of {', '.join(sorted(set(PERPLEXITY_UNITS.values())))}, not {self.unit!r}"
            )
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
        if self.allowance <= 0:
            raise ValueError(f"a perplexity allowance is a relative rise above 0, not {self.allowance}")
        return -float(self.cap), float(self.cap), math.log1p(self.allowance)

    @property
    def size_biased(self) -> bool:
        """A perplexity per word or byte, whose documents come in an order size-biased by them; per
        item, the order is uniform."""
        return self.kind == "perplexity" and self.unit != "item"

    def as_dict(self) -> dict[str, Any]:
        """As Evidence keeps it: the unit only when it is not words and the scores' range only when declared,
        so evidence gathered before either existed continues."""
        out = json.loads(json.dumps(asdict(self)))
        defaults = {"unit": "word", "scores": None}  # left out at these values, as evidence before them kept none
        return {k: v for k, v in out.items() if k not in defaults or out[k] != defaults[k]}


@dataclass(frozen=True)
class Evidence:
    """Everything a later call needs to continue: JSON-serialisable (`to_json`, `from_json`)."""

    seed: int
    alpha: float
    spec: dict[str, Any]
    population: str  # digest of the doc ids and their weights the draws come from
    items: int = 0  # draws consumed
    sum_d: float = 0.0  # sum of the degradations bet on so far
    sum_sq: float = 0.0  # sum of (d_i - mu_i)^2: the bettor's running variance
    log_wealth_pass: float = 0.0
    log_wealth_fail: float = 0.0
    sum_w: float = 0.0  # a weighted order: the weight taken so far
    sum_wd: float = 0.0  # and its weighted sum of degradations
    decision: str | None = None  # "pass" or "fail" once final
    reason: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Evidence:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Decision:
    decision: str  # "pass", "fail" or "inconclusive"
    wealth_pass: float  # against "degradation >= allowance"; a pass needs 1/alpha
    wealth_fail: float  # against "degradation <= allowance"
    items: int  # draws consumed over every call so far
    new_items: int  # consumed by this call
    reason: str
    evidence: Evidence


class Population:
    """The documents draws come from: doc id -> weight (words for perplexity, 1 otherwise), fixed
    before any score is seen; ids as strings, as JSON keeps them."""

    def __init__(self, weights: dict[Any, float] | list[Any]) -> None:
        pairs = weights.items() if isinstance(weights, dict) else ((i, 1) for i in weights)
        self.weights = dict(sorted((str(k), float(w)) for k, w in pairs))
        if not self.weights or any(not (w > 0 and math.isfinite(w)) for w in self.weights.values()):
            raise ValueError("a population is at least one document, each with a finite weight above 0")
        self.ids = list(self.weights)
        cumulative = list(itertools.accumulate(self.weights.values()))
        self._cut = [c / cumulative[-1] for c in cumulative]
        self.digest = hashlib.sha256(json.dumps(self.weights, sort_keys=True).encode()).hexdigest()
        self.order: list[str] | None = None  # set by `in_order`: items taken without replacement
        self.weighted = False  # an order size-biased by the weights (`in_order` with weights)

    @classmethod
    def in_order(cls, ids: list[Any], weights: dict[Any, float] | None = None) -> Population:
        """Every document of a finite test set in a random order fixed before any score: uniformly
        random (as --limit takes them: gate/order.item_order), or with `weights` (every document's
        words) size-biased (gate/order.weighted_order), which corpus perplexity bets on. `decide`
        takes them in it, each once."""
        population = cls(list(ids) if weights is None else {i: weights[i] for i in ids})
        population.order = [str(i) for i in ids]
        population.weighted = weights is not None
        if len(set(population.order)) != len(population.order) or (weights is not None and len(weights) != len(ids)):
            raise ValueError("an order names each document once, and a weighted one every weighted document")
        named = {"order": population.order} | ({"weights": population.weights} if weights is not None else {})
        population.digest = hashlib.sha256(json.dumps(named, sort_keys=True).encode()).hexdigest()
        return population

    def draws(self, seed: int, start: int, count: int) -> list[str]:
        """Draws start .. start+count-1: draw k is the document whose cumulative weight share first
        exceeds a uniform fixed by a hash of (seed, k), so any draw is found without the ones before it."""
        out = []
        for k in range(start, start + count):
            u = int.from_bytes(hashlib.sha256(f"{seed}\0{k}".encode()).digest()[:8], "big") / 2**64
            out.append(self.ids[min(bisect.bisect_right(self._cut, u), len(self.ids) - 1)])
        return out


def decide(
    base: dict[Any, Any],
    quant: dict[Any, Any],
    spec: Spec,
    population: Population,
    evidence: Evidence | None = None,
    alpha: float = ALPHA,
    order_seed: int | None = None,
    limit: int | None = None,
) -> Decision:
    """Bet on the draws after those `evidence` consumed, while both models scored the drawn document,
    until a bettor reaches 1/alpha, `limit` draws in all are consumed, or (every document scored)
    MAX_DRAWS more. Values: binary and mean, the item's score; perplexity, lm-eval's
    [loglikelihood, words], the words as the population has them. `order_seed` must be fixed before
    any score is seen (default 0, or the evidence's).

    A population `in_order` is taken without replacement instead: the items after those consumed, in
    its order, while both models scored them, up to `limit` items or the last (which decides exactly):
    uniformly random for binary and mean specs and perplexity per item, size-biased by words or bytes
    (`weights`) for perplexity per word or byte. Binary and mean specs may be size-biased too: the
    bet is then on the weighted mean (an lm-eval group whose score is the mean of its tasks' means)."""
    if population.order is not None and (order_seed is not None or (spec.size_biased and not population.weighted)):
        raise ValueError(
            "a population in order is taken as it is (no seed), and perplexity per word (byte) only size-biased by words (bytes)"
        )
    evidence = _start(spec, population, evidence, alpha, order_seed)
    if evidence.decision is not None:
        return _decision(evidence, 0)
    # Doc ids as strings, as JSON keeps them; only documents both models scored are paired.
    b, q = ({str(k): v for k, v in side.items()} for side in (base, quant))
    scored = {i: (b[i], q[i]) for i in b if i in q}
    if unknown := sorted(set(scored) - set(population.weights))[:NAMED]:
        raise ValueError(f"scored documents outside the population: {', '.join(unknown)}")
    values, outside = _degradations(spec, population, scored)
    if outside:
        named = ", ".join(outside[:NAMED]) + (" ..." if len(outside) > NAMED else "")
        return _decision(replace(evidence, decision="fail", reason=f"document {named}: {_outside_why(spec)}"), 0)
    if population.order is not None:
        ahead = population.order[evidence.items : limit if limit is not None else len(population.order)]
        usable = list(itertools.takewhile(lambda i: i in values, ahead))
        weights = (population.weights, sum(population.weights.values())) if population.weighted else None
        state, consumed = (
            _bet(evidence, spec, [values[i] for i in usable], size=len(population.order), weights=weights, ids=usable)
            if usable
            else (evidence, 0)
        )
        return _decision(state, consumed)
    start, state, new = evidence.items, evidence, 0
    ceiling = limit if limit is not None else start + MAX_DRAWS
    while state.decision is None and start + new < ceiling:
        block = population.draws(evidence.seed, start + new, min(BLOCK, ceiling - start - new))
        usable = list(itertools.takewhile(lambda i: i in values, block))
        if not usable:
            break
        state, consumed = _bet(state, spec, [values[i] for i in usable])
        new += consumed
        if len(usable) < len(block):
            break
    return _decision(state, new)


def draws_to_decide(
    values: dict[Any, float],
    population: Population,
    spec: Spec,
    alpha: float = ALPHA,
    paths: int = 1000,
    horizon: int = 5000,
    seed: int = 0,
) -> dict[str, float]:
    """How many draws a decision takes if the documents behave as those scored: `paths` simulated
    sequences of draws from `population` (its weights), each document's degradation as scored
    (`values`, on the scale bet on: a per-word loss change for perplexity), run through the same
    bettors up to `horizon` draws. The shares that pass and fail, and the median and 90th percentile
    draws to a pass among the paths that pass. Documents not scored are left out of the draws (their
    weights renormalised): the estimate is as good as the scored documents are like the rest."""
    import numpy as np

    by_id = {str(k): float(v) for k, v in values.items()}
    ids = [i for i in population.ids if i in by_id]
    if not ids:
        raise ValueError("no scored document is in the population")
    d = np.array([by_id[i] for i in ids])
    weights = np.array([population.weights[i] for i in ids])
    rng = np.random.default_rng(seed)
    drawn = d[rng.choice(len(ids), size=(horizon, paths), p=weights / weights.sum())]
    wealth = wealth_paths(drawn, *spec.bet_range())
    threshold = math.log(1 / alpha)
    first = {}
    for side in ("pass", "fail"):
        hit = wealth[f"log_wealth_{side}"][1:] >= threshold
        first[side] = np.where(hit.any(0), hit.argmax(0) + 1, horizon + 1)
    passed = first["pass"] < first["fail"]
    failed = first["fail"] < first["pass"]
    to_pass = first["pass"][passed]
    return {
        "pass_share": float(passed.mean()),
        "fail_share": float(failed.mean()),
        "median_draws_to_pass": float(np.median(to_pass)) if passed.any() else math.inf,
        "p90_draws_to_pass": float(np.percentile(to_pass, 90)) if passed.any() else math.inf,
    }


def items_to_pass_in_order(
    seen: list[float],
    spec: Spec,
    size: int,
    alpha: float = ALPHA,
    paths: int = 400,
    share: float = 0.8,
    seed: int = 0,
    weights: list[float] | None = None,
) -> float:
    """The items by which `share` of simulated runs pass, continuing a bet without replacement on a test
    set of `size` items whose first items' degradations were `seen` (in the order bet on): each run
    fills the items not yet scored by drawing from `seen`, and bets on all of them in order, as
    `decide` on an in-order population does. `weights`: every item's, in the order, for a size-biased
    order (perplexity). math.inf when fewer than `share` pass by the last item."""
    import numpy as np

    rng = np.random.default_rng(seed)
    first = np.repeat(np.asarray(seen, dtype=float)[:, None], paths, axis=1)
    d = np.concatenate([first, rng.choice(np.asarray(seen, dtype=float), size=(size - len(seen), paths))])
    if weights is None:
        wealth = wor_paths(d, *spec.bet_range(), size)
    else:
        w = np.asarray(weights, dtype=float)
        wealth = wor_paths(d, *spec.bet_range(), size, weights=w[:, None], total=float(w.sum()))
    hit = {side: wealth[f"log_wealth_{side}"][1:] >= math.log(1 / alpha) for side in ("pass", "fail")}
    at = {side: np.where(h.any(0), h.argmax(0) + 1, math.inf) for side, h in hit.items()}
    passed = np.where(at["pass"] < at["fail"], at["pass"], math.inf)
    return float(np.percentile(passed, share * 100, method="higher"))


def wealth_paths(d, lo: float, hi: float, delta: float, start: tuple[float, ...] | None = None) -> dict[str, Any]:
    """The bettors on degradations `d` (items on axis 0; further axes are independent replicates, as the
    simulations pass them), continuing from `start` = (items, sum_d, sum_sq, log_wealth_pass,
    log_wealth_fail). Each returned array has one row more than `d`: row k is the state after k items."""
    import numpy as np

    d = np.asarray(d, dtype=float)
    t, head, sums, mean, sq, var, (lp0, lf0) = _running(d, lo, hi, start)
    gap = delta - mean[:-1]
    kelly = gap / (var[:-1] + gap * gap)
    bet_pass = np.clip(kelly, 0.0, TRUNCATION / (hi - delta))
    bet_fail = np.clip(-kelly, 0.0, TRUNCATION / (delta - lo))
    log_pass = np.cumsum(np.concatenate([head * lp0, np.log1p(bet_pass * (delta - d))]), axis=0)
    log_fail = np.cumsum(np.concatenate([head * lf0, np.log1p(bet_fail * (d - delta))]), axis=0)
    return {"sum_d": sums, "sum_sq": sq, "log_wealth_pass": log_pass, "log_wealth_fail": log_fail}


def wor_paths(
    d,
    lo: float,
    hi: float,
    delta: float,
    size: int,
    start: tuple[float, ...] | None = None,
    weights=None,
    total: float | None = None,
) -> dict[str, Any]:
    """The bettors on items taken without replacement, in a uniformly random order fixed before any
    score, from a finite population of `size` items whose mean is tested against `delta` (Waudby-Smith
    and Ramdas, "Confidence sequences for sampling without replacement", NeurIPS 2020). Arrays and
    `start` as in `wealth_paths`; `size` counts every item, consumed or not.

    Before item t (t - 1 consumed, summing to S), a population mean of delta leaves the remaining
    items a mean m_t = (size * delta - S) / (size - t + 1), and a uniformly random next item has that
    mean. Under H0_pass (population mean >= delta) the next item's mean is >= m_t, so the pass
    bettor's factor 1 + l (m_t - d_t) has mean <= 1, and the fail bettor's 1 + l' (d_t - m_t) likewise
    under H0_fail: supermartingales again, and Ville's inequality bounds every stopping rule. The bet
    is aGRAPA's with m_t in place of delta (the running mean predicts the next item's mean as well
    without replacement as with it), truncated to keep every factor positive over [lo, hi]. Two
    certainties need no bet: when m_t lies outside [lo, hi] the remaining items cannot bring the mean
    to delta; and once every item is consumed the mean is known, so the test decides exactly (at
    exactly delta, neither). Each arrives as an infinite log-wealth.

    Weighted (`weights`, each item's weight as `d` holds the items; `total`, every item's weights
    summed): the items come in a size-biased order without replacement, each next item drawn with
    probability its weight over the weights not yet taken (gate/order.weighted_order), and the null is
    the weighted mean sum w_j d_j / total = delta. Before item t, with weight V and weighted sum X
    taken, the next item's mean is the remaining weighted sum over the remaining weight, so under
    H0_pass it is >= m_t = (total * delta - X) / (total - V); the bets are the same with this m_t.
    Uniform weights make it the formula above. `start` then carries V and X too (7 entries), and the
    arrays `sum_w` and `sum_wd` come back with the rest."""
    import numpy as np

    d = np.asarray(d, dtype=float)
    if (taken := (int(start[0]) if start else 0) + d.shape[0]) > size:
        raise ValueError(f"{taken} items taken without replacement from a population of {size}")
    t, head, sums, mean, sq, var, (lp0, lf0) = _running(d, lo, hi, start)
    w = np.ones_like(d) if weights is None else np.broadcast_to(np.asarray(weights, dtype=float), d.shape)
    whole = float(size) if weights is None else float(total)
    v0, x0 = (start[5], start[6]) if start is not None and len(start) > 5 else (t[0], sums[0])
    taken = np.cumsum(np.concatenate([head * v0, w]), axis=0)  # V: weight taken after each row
    weighted = np.cumsum(np.concatenate([head * x0, w * d]), axis=0)  # X: weighted sum taken
    # m_t: the next item's mean at a (weighted) population mean of delta
    null = (whole * delta - weighted[:-1]) / (whole - taken[:-1])
    gap = null - mean[:-1]
    kelly = gap / (var[:-1] + gap * gap)
    # A certainty needs m_t (and at the end the mean) clear of the range by more than the running sums'
    # rounding: a sequential sum of t items is off by at most about t eps times the magnitudes summed.
    # (At a population mean of exactly delta, the last items at the range's end leave m_t at it, and
    # rounding alone would otherwise make a certainty of it.)
    with np.errstate(divide="ignore", invalid="ignore"):
        magnitude = max(abs(lo), abs(hi)) * taken + whole * abs(delta)
        rounding = (t + 2) * np.finfo(float).eps * magnitude / np.maximum(whole - taken, whole / size)
        tiny = np.maximum(1e-12 * (hi - lo), rounding)
        bet_pass = np.clip(kelly, 0.0, np.where(hi - null > tiny[:-1], TRUNCATION / (hi - null), 0.0))
        bet_fail = np.clip(-kelly, 0.0, np.where(null - lo > tiny[:-1], TRUNCATION / (null - lo), 0.0))
        step_pass = np.where(null > hi + tiny[:-1], np.inf, np.log1p(bet_pass * (null - d)))
        step_fail = np.where(null < lo - tiny[:-1], np.inf, np.log1p(bet_fail * (d - null)))
    log_pass = np.cumsum(np.concatenate([head * lp0, step_pass]), axis=0)
    log_fail = np.cumsum(np.concatenate([head * lf0, step_fail]), axis=0)
    done = t == size  # every item consumed: the mean is known
    exact = weighted / whole - delta
    log_pass = np.where(done & (exact < -tiny), np.inf, log_pass)
    log_fail = np.where(done & (exact > tiny), np.inf, log_fail)
    out = {"sum_d": sums, "sum_sq": sq, "log_wealth_pass": log_pass, "log_wealth_fail": log_fail}
    return out if weights is None else out | {"sum_w": taken, "sum_wd": weighted}


def _running(d, lo: float, hi: float, start: tuple[float, ...] | None) -> tuple:
    """The bettors' shared state over items `d`, continuing from `start`: the items consumed after each
    row, a row of ones, the running sum, the regularised running mean and variance (the docstring's
    mu_t, s2_t), and the carried log-wealths."""
    import numpy as np

    t0, s0, q0, lp0, lf0 = (start or (0, 0.0, 0.0, 0.0, 0.0))[:5]
    rest = d.shape[1:]
    t = (t0 + np.arange(d.shape[0] + 1, dtype=float)).reshape((-1,) + (1,) * len(rest))
    head = np.ones((1,) + rest)
    # Running sums start from the carried state, so a continued call adds in the same order as one call.
    sums = np.cumsum(np.concatenate([head * s0, d]), axis=0)
    mean = ((lo + hi) / 2 + sums) / (t + 1)
    sq = np.cumsum(np.concatenate([head * q0, (d - mean[1:]) ** 2]), axis=0)
    var = (((hi - lo) / 2) ** 2 + sq) / (t + 1)
    return t, head, sums, mean, sq, var, (lp0, lf0)


def _start(spec: Spec, population: Population, evidence: Evidence | None, alpha: float, seed: int | None) -> Evidence:
    """The evidence to continue, checked against this call's spec, population, level and seed."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha lies in (0, 1), not {alpha}")
    spec_dict = spec.as_dict()
    if evidence is None:
        return Evidence(seed=0 if seed is None else int(seed), alpha=alpha, spec=spec_dict, population=population.digest)
    # A level, spec, population or order chosen after seeing the wealth would be a choice among tests.
    for what, ours, theirs in (
        ("alpha", alpha, evidence.alpha),
        ("spec", spec_dict, evidence.spec),
        ("population", population.digest, evidence.population),
    ):
        if ours != theirs:
            raise ValueError(f"the evidence was gathered with another {what}: start new evidence for a new test")
    if seed is not None and int(seed) != evidence.seed:
        raise ValueError(f"the evidence's draws were made with seed {evidence.seed}, not {seed}")
    return evidence


def _degradations(spec: Spec, population: Population, scored: dict[str, tuple]) -> tuple[dict[str, float], list[str]]:
    """Each scored document's quantity bet on, and the documents outside the declared range."""
    lo, hi, _ = spec.bet_range()
    values, outside = {}, []
    for doc, (b, q) in scored.items():
        if spec.kind == "perplexity":
            value = _per_unit_change(b, q, population.weights[doc], spec.unit)
        else:
            if spec.kind == "binary" and not {float(b), float(q)} <= {0.0, 1.0}:
                raise ValueError(f"a binary spec takes 0/1 scores, not {b!r} and {q!r}")
            value = float(b) - float(q) if spec.higher_is_better else float(q) - float(b)
        if math.isfinite(value) and lo <= value <= hi:
            values[doc] = value
        else:
            outside.append(doc)
    return values, sorted(outside)


def _per_unit_change(base: list, quant: list, count: float, unit: str) -> float:
    """A document's loss change per word or byte (quantized minus baseline), from lm-eval's [loglikelihood, count]."""
    (ll_base, count_base), (ll_quant, count_quant) = base, quant
    if not count_base == count_quant == count:
        raise ValueError(
            f"a document's {unit}s must be the population's ({count:g}) for both models, not {count_base} and {count_quant}"
        )
    return (float(ll_base) - float(ll_quant)) / count  # the loss is minus the log-likelihood


def _outside_why(spec: Spec) -> str:
    if spec.kind == "perplexity":
        return f"the loss changed by more than the cap of {spec.cap:.3g} nats per {spec.unit} (or is not finite): the model is broken on it"
    if spec.scores is not None:
        lo, hi = spec.scores
        return f"a score lies outside the declared score_range [{lo:g}, {hi:g}] (or is not finite): the test cannot bet on it"
    lo, hi, _ = spec.bet_range()
    return f"the degradation lies outside the declared range [{lo:g}, {hi:g}] (or is not finite): the test cannot bet on it"


def _bet(
    evidence: Evidence,
    spec: Spec,
    d: list[float],
    size: int | None = None,
    weights: tuple[dict[str, float], float] | None = None,
    ids: list[str] | None = None,
) -> tuple[Evidence, int]:
    """Bet on the items' degradations in order (drawn with replacement, or taken without it from a
    population of `size`, size-biased when `weights` = (doc id -> weight, their sum) and `ids` name
    the items); stop at the first a bettor reaches 1/alpha on. The evidence after, and the items consumed."""
    import numpy as np

    lo, hi, delta = spec.bet_range()
    start = (evidence.items, evidence.sum_d, evidence.sum_sq, evidence.log_wealth_pass, evidence.log_wealth_fail)
    if size is None:
        paths = wealth_paths(d, lo, hi, delta, start)
    elif weights is None:
        paths = wor_paths(d, lo, hi, delta, size, start)
    else:
        w = [weights[0][i] for i in ids or []]
        paths = wor_paths(d, lo, hi, delta, size, (*start, evidence.sum_w, evidence.sum_wd), w, weights[1])
    threshold = math.log(1 / evidence.alpha)
    crossed = (paths["log_wealth_pass"][1:] >= threshold) | (paths["log_wealth_fail"][1:] >= threshold)
    k = int(np.argmax(crossed)) + 1 if crossed.any() else len(d)
    state = {key: float(paths[key][k]) for key in paths}
    verdict = "pass" if state["log_wealth_pass"] >= threshold else "fail" if state["log_wealth_fail"] >= threshold else None
    total = evidence.items + k
    reason = None
    if verdict is not None:
        side = "<" if verdict == "pass" else ">"
        null = "at or above" if verdict == "pass" else "at or below"
        reason = (
            f"the wealth against the mean degradation being {null} the allowance reached 1/alpha = "
            f"{1 / evidence.alpha:.3g} after {total} {'draws' if size is None else 'items'}: degradation {side} allowance"
        )
        if math.isinf(state[f"log_wealth_{verdict}"]):  # a certainty (wor_paths), no bet
            reason = (
                f"after {total} of the {size} items the rest cannot bring the mean degradation "
                f"{'up' if verdict == 'pass' else 'down'} to the allowance: degradation {side} allowance"
            )
    return replace(evidence, items=total, decision=verdict, reason=reason, **state), k


def _decision(evidence: Evidence, new_items: int) -> Decision:
    wealth_pass, wealth_fail = math.exp(evidence.log_wealth_pass), math.exp(evidence.log_wealth_fail)
    reason = evidence.reason or (
        f"neither bettor reached 1/alpha = {1 / evidence.alpha:.3g} after {evidence.items} items "
        f"(wealth for a pass {wealth_pass:.3g}, for a fail {wealth_fail:.3g}): more items continue the evidence"
    )
    return Decision(evidence.decision or "inconclusive", wealth_pass, wealth_fail, evidence.items, new_items, reason, evidence)
