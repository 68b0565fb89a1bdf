"""Per-item scores from lm-eval's samples, and the noise of a baseline/quantized comparison.

Both models answer the same items, so the difference is judged per item (paired), which is
far tighter than combining two independent standard errors. lm-eval gives no standard error
for perplexities; a bootstrap over documents supplies one, using lm-eval's own aggregation.
"""

from __future__ import annotations

import math
from typing import Any

from qserve.evaluate.gates import Comparison

BOOTSTRAP_ITERS = 1000
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
    """Scores (lm-eval's), their standard errors (lm-eval's, else bootstrap) and the paired noise."""
    (b_score, b_se, b_items), (q_score, q_se, q_items) = baseline, quantized
    cmp = Comparison(metric_key, higher_is_better, b_score, q_score, b_se, q_se)
    metric = metric_key.partition(",")[0]
    if not b_items or not q_items:
        return cmp
    ids = sorted(set(b_items) & set(q_items), key=lambda k: (len(k), k))
    supported = metric in WEIGHTED or all(isinstance(b_items[i], float) for i in ids)
    if len(ids) < 2 or not supported:
        return cmp
    b = [b_items[i] for i in ids]
    q = [q_items[i] for i in ids]
    cmp.items = len(ids)
    cmp.constant = metric not in WEIGHTED and len(set(b) | set(q)) == 1
    log = metric in LOG_SCALE
    se_b, se_q, se_diff = _bootstrap(metric, b, q, log)
    if log:
        # Perplexity is exp(mean NLL): its noise is symmetric on the log scale, where the
        # gate decides; standard errors in perplexity units follow by the delta method.
        cmp.log_ratio_stderr = se_diff
        se_b, se_q, se_diff = se_b * b_score, se_q * q_score, se_diff * q_score
    cmp.baseline_stderr = b_se if b_se is not None else se_b
    cmp.quantized_stderr = q_se if q_se is not None else se_q
    cmp.paired_stderr = se_diff
    return cmp


def _bootstrap(metric: str, b: list, q: list, log: bool) -> tuple[float, float, float]:
    """Standard errors of each aggregate and of their difference (of their log ratio when
    `log`), resampling items jointly."""
    import random

    rng = random.Random(0)  # deterministic: the same data gives the same decision
    n = len(b)
    f = math.log if log else (lambda x: x)
    bs, qs, ds = [], [], []
    for _ in range(BOOTSTRAP_ITERS):
        idx = [rng.randrange(n) for _ in range(n)]
        vb = f(aggregate(metric, [b[i] for i in idx]))
        vq = f(aggregate(metric, [q[i] for i in idx]))
        bs.append(vb)
        qs.append(vq)
        ds.append(vq - vb)
    return _sd(bs), _sd(qs), _sd(ds)


def _sd(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
