"""Per-item scores from lm-eval's samples, and the noise of a baseline/quantized comparison.

Both models answer the same items, so the difference is judged per item (paired). The gate
decides on one-sided 95 % bounds of the degradation that are valid at the sample size used:

- 0/1 items (exact_match, acc, acc_norm): exact Clopper-Pearson bounds on the rate of items the
  quantized model lost and on the rate it gained, combined by Bonferroni (2.5 % each side). Only
  the discordant items move them, and they hold at any n, zero discordant items included.
- other per-item means: a paired Student t bound with n - 1 degrees of freedom.
- corpus-level metrics (word/byte perplexity, bits per byte: a ratio of sums over documents): a
  paired BCa bootstrap over documents (scipy.stats.bootstrap), on the log scale for perplexities.

scipy is imported inside the functions that need it, so `qserve --help` stays instant.
"""

from __future__ import annotations

import math
from typing import Any

from qserve.evaluate.gates import Bounds, Comparison

ONE_SIDED = 0.05  # each bound is one-sided 95 %
BOOTSTRAP_RESAMPLES = 2000
SEED = 0  # deterministic: the same data gives the same decision
# lm-eval's corpus-level metrics: each item contributes (log-likelihood, words or bytes).
WEIGHTED = {
    "word_perplexity": lambda ll, n: math.exp(-ll / n),
    "byte_perplexity": lambda ll, n: math.exp(-ll / n),
    "bits_per_byte": lambda ll, n: -ll / n / math.log(2),
}
LOG_SCALE = {"word_perplexity", "byte_perplexity"}

ItemValues = dict[str, Any]  # doc_id (as str, for JSON) -> float, or [loglikelihood, count]


def item_values(samples: list[dict], metric_key: str) -> ItemValues:
    """The per-item values lm-eval logged for '<metric>,<filter>'."""
    metric, _, filt = metric_key.partition(",")
    out: ItemValues = {}
    for s in samples:
        if s.get("filter", "none") != (filt or "none") or metric not in s:
            continue
        value = s[metric]
        out[str(s["doc_id"])] = [float(v) for v in value] if isinstance(value, (list, tuple)) else float(value)
    return out


def aggregate(metric: str, values: list) -> float:
    if metric in WEIGHTED:
        return WEIGHTED[metric](sum(v[0] for v in values), sum(v[1] for v in values))
    return sum(values) / len(values)


def compare(
    metric_key: str,
    higher_is_better: bool,
    baseline: tuple[float, float | None, ItemValues | None],
    quantized: tuple[float, float | None, ItemValues | None],
) -> Comparison:
    """Scores (lm-eval's), their standard errors (lm-eval's, else bootstrap), and the paired bounds."""
    (b_score, b_se, b_items), (q_score, q_se, q_items) = baseline, quantized
    cmp = Comparison(metric_key, higher_is_better, b_score, q_score, b_se, q_se)
    metric = metric_key.partition(",")[0]
    ids = sorted(set(b_items or {}) & set(q_items or {}), key=lambda k: (len(k), k))
    cmp.items = len(ids) or None
    b = [b_items[i] for i in ids] if ids else []
    q = [q_items[i] for i in ids] if ids else []
    if metric in WEIGHTED:
        return _weighted(cmp, metric, b, q) if len(ids) >= 2 else cmp
    if not ids or not all(isinstance(v, float) for v in b + q):
        return cmp
    cmp.constant = len(ids) >= 2 and len(set(b) | set(q)) == 1  # one item says nothing of variance either way
    # Degradation per item, in the metric's units: positive where the quantized model did worse.
    d = [(x - y) if higher_is_better else (y - x) for x, y in zip(b, q)]
    cmp.paired_stderr = _sd(d) / math.sqrt(len(d)) if len(d) >= 2 else None
    binary = all(v in (0.0, 1.0) for v in b + q)
    cmp.bounds = exact_binary_bounds(d) if binary else paired_t_bounds(d)
    return cmp


def exact_binary_bounds(d: list[float]) -> Bounds:
    """Bounds on mean(d) for d in {-1, 0, 1} (lost, tied, gained per item).

    The degradation is p_lost - p_gained. With exact one-sided 97.5 % Clopper-Pearson bounds on
    each rate, [L(lost) - U(gained), U(lost) - L(gained)] holds with at least 95 % confidence each
    side (Bonferroni), at any n.
    """
    n = len(d)
    lost, gained = d.count(1.0), d.count(-1.0)
    lo_lost, hi_lost = clopper_pearson(lost, n, ONE_SIDED / 2)
    lo_gain, hi_gain = clopper_pearson(gained, n, ONE_SIDED / 2)
    method = f"exact binomial on discordant items ({lost} lost, {gained} gained of {n})"
    return Bounds(lo_lost - hi_gain, hi_lost - lo_gain, method, n, discordant=(lost, gained))


def clopper_pearson(k: int, n: int, alpha: float) -> tuple[float, float]:
    """Exact bounds on a binomial rate: each misses the true rate with probability at most `alpha`."""
    from scipy.stats import beta

    lo = 0.0 if k == 0 else float(beta.ppf(alpha, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1 - alpha, k + 1, n - k))
    return lo, hi


def paired_t_bounds(d: list[float]) -> Bounds | None:
    """mean(d) -/+ t(0.95, n-1) * sd(d)/sqrt(n); None when there is no spread to estimate noise from."""
    from scipy.stats import t

    n = len(d)
    if n < 2 or len(set(d)) == 1:
        return None
    half = float(t.ppf(1 - ONE_SIDED, n - 1)) * _sd(d) / math.sqrt(n)
    mean = sum(d) / n
    return Bounds(mean - half, mean + half, f"paired t, {n - 1} degrees of freedom", n)


def _weighted(cmp: Comparison, metric: str, b: list, q: list) -> Comparison:
    """Corpus-level metrics: bootstrap standard errors and a paired BCa bound over documents."""
    import numpy as np

    log = metric in LOG_SCALE
    arr = np.array([[x[0], x[1], y[0], y[1]] for x, y in zip(b, q)], dtype=float).T  # llb, nb, llq, nq
    se_b, se_q = (_bootstrap(arr[i : i + 2], lambda a: _corpus(metric, a[0], a[1], log)).standard_error for i in (0, 2))
    cmp.baseline_stderr = cmp.baseline_stderr if cmp.baseline_stderr is not None else _unlog(se_b, cmp.baseline, log)
    cmp.quantized_stderr = cmp.quantized_stderr if cmp.quantized_stderr is not None else _unlog(se_q, cmp.quantized, log)
    sign = 1.0 if cmp.higher_is_better else -1.0  # degradation: baseline - quantized for scores

    def degradation(a):
        return sign * (_corpus(metric, a[0], a[1], log) - _corpus(metric, a[2], a[3], log))

    cmp.log_scale = log
    if np.allclose(arr[0] / arr[1], arr[2] / arr[3], rtol=0, atol=1e-12):
        cmp.paired_stderr = 0.0
        return cmp  # identical on every document: no spread, no bound
    res = _bootstrap(arr, degradation, method="BCa")
    se = float(res.standard_error)
    cmp.paired_stderr = _unlog(se, cmp.quantized, log)
    lo, hi = (float(x) for x in res.confidence_interval)
    cmp.bounds = Bounds(lo, hi, f"paired BCa bootstrap over {arr.shape[1]} documents", arr.shape[1], stderr=se)
    return cmp


def _corpus(metric: str, ll, n, log: bool):
    """lm-eval's aggregate over the last axis (log of it for perplexities), vectorised for the bootstrap."""
    import numpy as np

    mean_nll = -np.sum(ll, axis=-1) / np.sum(n, axis=-1)
    if metric == "bits_per_byte":
        return mean_nll / math.log(2)
    return mean_nll if log else np.exp(mean_nll)


def _bootstrap(arr, statistic, method: str = "percentile"):
    """scipy's paired bootstrap over documents (columns of `arr`), two-sided 90 %: one-sided 95 % each end."""
    import numpy as np
    from scipy.stats import bootstrap

    return bootstrap(
        tuple(arr),
        lambda *rows, axis=-1: statistic(np.stack(rows)),
        paired=True,
        vectorized=True,
        confidence_level=1 - 2 * ONE_SIDED,
        n_resamples=BOOTSTRAP_RESAMPLES,
        method=method,
        rng=np.random.default_rng(SEED),
    )


def _unlog(se: float, value: float, log: bool) -> float:
    """A log-scale standard error in the metric's units (delta method)."""
    return float(se * value) if log else float(se)


def _sd(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
