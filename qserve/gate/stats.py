"""Per-item scores from lm-eval's samples, and the noise of a baseline/quantized comparison.

Both models answer the same items, so the difference is judged per item (paired). The gate
passes only on a one-sided 95 % upper bound of the degradation that keeps its level at the n used;
tests/test_gate_levels.py proves each bound by simulation (`qserve gate-levels` prints the table).

- 0/1 items (exact_match, acc, acc_norm): the exact unconditional score test on the counts of items
  the quantized model lost and gained (paired_binary.py), decided at the gate's allowance. Only the
  discordant items move it, and it holds its level at any n, zero discordant items included.
- corpus-level metrics (word/byte perplexity, bits per byte: a ratio of sums over documents; and a
  metric with several values per item, IFEval's instruction-level accuracy, whose mean over all values
  is the ratio of the items' sums to their counts, so its items are documents here too) and
  other per-item means: a bound on the estimate's linearized per-document terms (the delta method for
  a ratio estimator, Cochran, Sampling Techniques, 1977, 6.4; for a mean the terms are the centred
  differences), centred with Johnson's (1978, JASA 73) skewness correction m3 / (6 m2 n). Student t
  is exact for normal terms, but skewed and heavy-tailed terms make its upper bound too low: the
  sample misses the tail, so both its mean and its spread come out small. Three rules keep the level
  for the class of loss shapes docs/gate-levels.md simulates (tails up to Pareto index 2.5, with or
  without per-word noise, at the looks and n the page shows):
  * the upper bound's critical value is t + TAIL t^2, where t is Student's. The skewness error of a
    studentized mean grows as t^2 (the n^-1/2 term of its Edgeworth expansion, Hall, The Bootstrap and
    Edgeworth Expansion, 1992, 2.6), which is why a later look, at a smaller level, needs relatively
    more; the sample's own skewness cannot size it (a Pareto sample that missed its tail looks normal),
    so TAIL is sized on the class's least favourable shapes: the least value that keeps every shape at
    every look within its level (a seeded simulation), and a quarter on top;
  * at least log(alpha) / log(0.95) items (policy.min_items: 59 at 5 %, 69 at a first look's
    3.04 %): below that, a loss carried by 5 % of documents is missed by the whole sample more than
    alpha of the time, and no formula can see it;
  * more than 28 + 25 g1^2, where g1 is the terms' sample skewness: Cochran's rule for when the
    normal approximation of a mean holds, as revised by Sugden, Smith and Jones (2000, Survey
    Methodology 26(2)). Strongly skewed per-document losses therefore need more documents; the gate
    says how many.
  No rule on a sample covers every distribution with a finite variance (Bahadur and Savage, 1956): a
  loss carried by 1 % of documents is outside the class, and the page shows by how much.
  Bootstrap bounds were measured and rejected: BCa (qserve's earlier bound) passed a model at the
  allowance up to 19 % of the time at n = 100 (lognormal sigma 1.5), the studentized bootstrap 14 %.

A FAIL needs the lower bound above the allowance (plain Student t, at any n >= 2): a wrong fail
costs a rerun, a wrong pass serves a degraded model, so only passes carry the size rules.

scipy and numpy are imported inside the functions that need them, so `qserve --help` stays instant.
"""

from __future__ import annotations

import math
from typing import Any

from qserve.errors import QserveError
from qserve.gate.decisions import Bounds, Comparison
from qserve.gate.spending import ALPHA, min_items

ONE_SIDED = ALPHA  # each bound is one-sided 95 % unless a caller spends less (looks.py)
SKEW_RULE = (28, 25)  # a pass needs n > 28 + 25 g1^2 (the docstring says why)
TAIL = 0.3  # the upper bound's critical value is t + TAIL t^2 (the docstring says why)
# lm-eval's corpus-level metrics: each item contributes (log-likelihood, words or bytes). lm-eval's
# `perplexity` (lambada's) logs one log-likelihood per item and states exp(-their mean): a count of 1 each.
WEIGHTED = {
    "word_perplexity": lambda ll, n: math.exp(-ll / n),
    "byte_perplexity": lambda ll, n: math.exp(-ll / n),
    "bits_per_byte": lambda ll, n: -ll / n / math.log(2),
    "perplexity": lambda ll, n: math.exp(-ll / n),
}
LOG_SCALE = {"word_perplexity", "byte_perplexity", "perplexity"}

ItemValues = dict[str, Any]  # doc_id (as str, for JSON) -> float, or [loglikelihood, count]


def item_values(samples: list[dict], metric_key: str) -> ItemValues:
    """The per-item values lm-eval logged for '<metric>,<filter>': numbers, or lists of them (several per
    item; [loglikelihood, count] for WEIGHTED metrics, [loglikelihood, 1] for `perplexity`). None of them
    when an item logged something else (a corpus metric's (reference, prediction) pair of texts)."""
    metric, _, filt = metric_key.partition(",")
    out: ItemValues = {}
    for s in samples:
        if s.get("filter", "none") != (filt or "none") or metric not in s:
            continue
        value = s[metric]
        if metric == "perplexity" and not isinstance(value, (list, tuple)):
            value = [value, 1.0]
        try:
            out[str(s["doc_id"])] = [float(v) for v in value] if isinstance(value, (list, tuple)) else float(value)
        except (TypeError, ValueError):
            return {}
    return out


def adds_up(metric_key: str, items: ItemValues, stated: Any) -> bool:
    """Whether the items give the score lm-eval states, as it aggregates them (a mean, or a ratio of sums):
    a corpus metric's items (MCC's, F1's (gold, prediction) pairs) do not, and say nothing of its noise."""
    if not items or not isinstance(stated, (int, float)):
        return False
    try:
        from_items = aggregate(metric_key.partition(",")[0], list(items.values()))
    except (TypeError, ValueError, ZeroDivisionError, IndexError, OverflowError):
        return False
    return abs(from_items - stated) <= 1e-6 * max(1.0, abs(stated))


def aggregate(metric: str, values: list) -> float:
    if metric in WEIGHTED:
        return WEIGHTED[metric](sum(v[0] for v in values), sum(v[1] for v in values))
    if values and all(isinstance(v, list) for v in values):  # several values per item: lm-eval flattens them
        flat = [x for v in values for x in v]
        return sum(flat) / len(flat)
    return sum(values) / len(values)


def several_per_item(metric: str, values: list) -> bool:
    """A metric that logs several values per item (IFEval's instruction-level accuracy: one per
    instruction) and states their mean over all of them: a ratio of per-item sums to per-item counts."""
    return metric not in WEIGHTED and bool(values) and all(isinstance(v, list) for v in values)


def compare(
    metric_key: str,
    higher_is_better: bool,
    baseline: tuple[float, float | None, ItemValues | None],
    quantized: tuple[float, float | None, ItemValues | None],
    alpha: float = ONE_SIDED,
) -> Comparison:
    """Scores (lm-eval's), their standard errors (lm-eval's, else linearized), and the paired bounds,
    each one-sided at level `alpha`."""
    (b_score, b_se, b_items), (q_score, q_se, q_items) = baseline, quantized
    cmp = Comparison(metric_key, higher_is_better, b_score, q_score, b_se, q_se)
    metric = metric_key.partition(",")[0]
    ids = sorted(set(b_items or {}) & set(q_items or {}), key=lambda k: (len(k), k))
    cmp.items = len(ids) or None
    b = [b_items[i] for i in ids] if ids else []
    q = [q_items[i] for i in ids] if ids else []
    if not all(_finite(v) for v in b + q):
        cmp.non_finite = True  # the gate fails on it with a line, never a traceback
        return cmp
    if several_per_item(metric, b + q):
        if any(not x or len(x) != len(y) for x, y in zip(b, q)):
            raise QserveError(f"{metric_key}: an item has no values, or other counts of values on the two models")
        # As a ratio of sums, as perplexities are: [-(sum of values), count] per item (their rate is the mean).
        b, q = ([[-sum(v), float(len(v))] for v in side] for side in (b, q))
        return _weighted(cmp, metric, b, q, alpha) if len(ids) >= 2 else cmp
    if metric in WEIGHTED:
        return _weighted(cmp, metric, b, q, alpha) if len(ids) >= 2 else cmp
    if not ids or not all(isinstance(v, float) for v in b + q):
        return cmp
    cmp.constant = len(ids) >= 2 and len(set(b) | set(q)) == 1  # one item says nothing of variance either way
    # Degradation per item, in the metric's units: positive where the quantized model did worse.
    d = [(x - y) if higher_is_better else (y - x) for x, y in zip(b, q)]
    cmp.paired_stderr = _sd(d) / math.sqrt(len(d)) if len(d) >= 2 else None
    cmp.level = alpha
    if all(v in (0.0, 1.0) for v in b + q):
        # The exact test is decided at the allowance (gates.decide), which the comparison does not know.
        cmp.flips = {"lost": d.count(1.0), "gained": d.count(-1.0)}
    else:
        cmp.bounds = mean_bounds(d, alpha)
    return cmp


def _finite(v: Any) -> bool:
    return all(math.isfinite(x) for x in v) if isinstance(v, list) else math.isfinite(v)


def mean_bounds(d: list[float], alpha: float = ONE_SIDED) -> Bounds | None:
    """Per-item means that are not 0/1: the t bound on the centred differences; None without spread."""
    import numpy as np

    if len(d) < 2 or len(set(d)) == 1:
        return None
    arr = np.asarray(d, dtype=float)
    return _bounds(linearized_t(float(arr.mean()), arr - arr.mean(), alpha), "paired t on per-item differences", len(d), alpha)


def linearized_t(estimate, terms, alpha: float = ONE_SIDED) -> dict[str, Any]:
    """One-sided bounds at level `alpha` from an estimate and its linearized terms (axis 0: items; further
    axes: independent replicates, as the simulation passes them), with the n a pass needs. The lower
    bound is Student t's; the upper one, which a pass rests on, carries the tail allowance."""
    import numpy as np
    from scipy.stats import t

    terms = np.asarray(terms, dtype=float)
    n = terms.shape[0]
    squares = terms * terms
    m2 = np.mean(squares, axis=0)
    se = np.sqrt(m2 * n / (n - 1) / n)
    t_crit = float(t.ppf(1 - alpha, n - 1))
    m3 = np.mean(squares * terms, axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        g1 = np.where(m2 > 0, m3 / m2**1.5, 0.0)
        shift = np.where(m2 > 0, m3 / (6 * m2 * n), 0.0)  # Johnson's (1978) skewness correction
    needs = np.maximum(min_items(alpha), np.floor(SKEW_RULE[0] + SKEW_RULE[1] * g1**2) + 1)
    centre = estimate + shift
    upper = centre + (t_crit + TAIL * t_crit**2) * se
    return {"estimate": estimate, "lower": centre - t_crit * se, "upper": upper, "se": se, "skewness": g1, "needs": needs}


def passes(result: dict[str, Any], allowed: float, n: int):
    """Where the bound lets a gate pass: its upper end under the allowance, at enough items."""
    return (result["upper"] < allowed) & (n >= result["needs"])


def ratio_terms(llb, nb, llq, nq) -> tuple[Any, Any]:
    """The corpus degradation (mean NLL per word or byte of the quantized model minus the
    baseline's: the log of the perplexity ratio) and its per-document linearized terms. Arrays with
    documents on axis 0; extra axes are replicates."""
    import numpy as np

    llb, nb, llq, nq = (np.asarray(a, dtype=float) for a in (llb, nb, llq, nq))
    rate_b, rate_q = -llb.sum(0) / nb.sum(0), -llq.sum(0) / nq.sum(0)
    terms = (-llq - rate_q * nq) / nq.mean(0) - (-llb - rate_b * nb) / nb.mean(0)
    return rate_q - rate_b, terms


def _weighted(cmp: Comparison, metric: str, b: list, q: list, alpha: float) -> Comparison:
    """Corpus-level metrics: linearized standard errors and the paired t bound over documents."""
    import numpy as np

    arr = np.array([[x[0], x[1], y[0], y[1]] for x, y in zip(b, q)], dtype=float).T  # llb, nb, llq, nq
    log, scale = metric in LOG_SCALE, (1 / math.log(2) if metric == "bits_per_byte" else 1.0)
    for side, (ll, count) in (("baseline", arr[0:2]), ("quantized", arr[2:4])):
        if getattr(cmp, f"{side}_stderr") is None:
            rate = -ll.sum() / count.sum()
            se = float(np.std((-ll - rate * count) / count.mean(), ddof=1) / math.sqrt(len(ll))) * scale
            setattr(cmp, f"{side}_stderr", se * getattr(cmp, side) if log else se)  # delta method for exp
    cmp.log_scale = log
    if np.allclose(arr[0] / arr[1], arr[2] / arr[3], rtol=0, atol=1e-12):
        cmp.paired_stderr = 0.0
        return cmp  # identical on every document: no spread, no bound
    estimate, terms = ratio_terms(*arr)
    sign = 1.0 if not cmp.higher_is_better else -1.0  # degradation: the loss went up
    res = linearized_t(sign * estimate * scale, sign * terms * scale, alpha)
    cmp.paired_stderr = float(res["se"]) * (cmp.quantized if log else 1.0)
    cmp.bounds = _bounds(res, f"paired t on {arr.shape[1]} documents' linearized terms", arr.shape[1], alpha)
    return cmp


def _bounds(res: dict[str, Any], method: str, n: int, alpha: float) -> Bounds:
    g1, needs = float(res["skewness"]), int(res["needs"])
    why = (
        f"the per-item differences are skewed ({g1:.2g}): more than {SKEW_RULE[0]} + {SKEW_RULE[1]} x skewness^2"
        if needs > min_items(alpha)
        else f"at least {needs}, or a loss carried by 5 % of items can be missed"
    )
    return Bounds(
        float(res["lower"]),
        float(res["upper"]),
        method,
        n,
        stderr=float(res["se"]),
        skewness=g1,
        needs=needs,
        needs_why=why,
        level=alpha,
    )


def _sd(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
