"""Non-inferiority on 0/1 items: the exact unconditional score test on the paired (lost, gained) counts.

Both models answer the same n items; the quantized model lost b of them (the baseline was right, it
was wrong) and gained c. Its degradation is theta = p_lost - p_gained, and the gate passes when the
test rejects H0: theta >= delta (the allowance) at one-sided level alpha.

- The statistic is Tango's score statistic for a difference of paired proportions (Tango 1998,
  Statistics in Medicine 17:891-908), with the nuisance rate p_gained at its maximum-likelihood
  value under theta = delta. Only the discordant counts and n enter it.
- Its critical value is exact and unconditional (Chan 1998, Statistics in Medicine 17:1403-1413):
  the largest z* with P(Z < z*) <= alpha for every p_gained on the null boundary, from the trinomial
  probabilities themselves. So the level holds at every n; the plain asymptotic score test is
  slightly liberal at every n (tests/test_paired_binary.py sums its exact size).

qserve's earlier bound, two Clopper-Pearson bounds combined by Bonferroni, kept its level by rarely
deciding (docs/gate-levels.md shows the power of both). tests/test_gate_levels.py proves this one's
level over n 50-5,000, discordance 0-40 % and allowances 1-10 points, and its power against the score test.
"""

from __future__ import annotations

import math
from functools import lru_cache

# p_gained on the null boundary runs over [0, (1 - delta) / 2]; the level is held on this many points
# of it (the simulation checks the points between).
NUISANCE_GRID = 256
BOX_SD = 9.0  # trinomial mass beyond 9 binomial sd of either count is below 1e-18: left out of the sums


def score(lost, gained, n: int, delta: float):
    """Tango's score statistic at theta = delta (scalar or numpy arrays of counts); negative: better than delta."""
    import numpy as np

    b, c = np.asarray(lost, dtype=float), np.asarray(gained, dtype=float)
    # Restricted MLE of p_gained under p_lost - p_gained = delta: the root of A q^2 + B q + C = 0.
    a_, b_ = 2.0 * n, -b - c + (2.0 * n - b + c) * delta
    c_ = -c * delta * (1.0 - delta)
    q = (np.sqrt(np.maximum(b_ * b_ - 4.0 * a_ * c_, 0.0)) - b_) / (2.0 * a_)
    var = n * (2.0 * q + delta * (1.0 - delta))
    num = b - c - n * delta
    edge = np.where(num == 0, 0.0, np.copysign(np.inf, num))  # no variance left: only the sign speaks
    return np.where(var > 0, num / np.sqrt(np.where(var > 0, var, 1.0)), edge)


@lru_cache(maxsize=256)
def critical_values(n: int, delta: float, alpha: float) -> tuple[float, float]:
    """(z_pass, z_fail): a gate at exactly the allowance gets Z < z_pass, or Z > z_fail, at most `alpha`
    of the time, whatever p_gained is (on the grid)."""
    import numpy as np
    from scipy.special import gammaln

    log_factorial = gammaln(np.arange(n + 1, dtype=float) + 1.0)
    z_pass, z_fail = math.inf, -math.inf
    for p_gained in np.linspace(0.0, (1.0 - delta) / 2.0, NUISANCE_GRID):
        z, prob = _boundary_distribution(n, delta, float(p_gained), log_factorial)
        z_pass = min(z_pass, _tail_edge(z, prob, alpha))
        z_fail = max(z_fail, -_tail_edge(-z, prob, alpha))
    return z_pass, z_fail


def _tail_edge(z, prob, alpha: float) -> float:
    """The least z whose cells below it carry at most `alpha` (inf if every cell fits). Only the cells
    below the normal approximation's 2-alpha point are sorted, unless they carry too little mass: the
    answer is the same, as the sorted lower cells are the full sort's prefix."""
    import numpy as np
    from scipy.stats import norm

    cut = alpha * (1 + 1e-12)
    lower = z <= norm.ppf(min(2 * alpha, 0.5))
    if prob[lower].sum() <= cut:
        lower = np.ones_like(z, dtype=bool)
    zs, ps = z[lower], prob[lower]
    order = np.argsort(zs, kind="stable")
    edge = np.searchsorted(np.cumsum(ps[order]), cut, side="right")
    return float(zs[order][edge]) if edge < len(zs) else math.inf


def _boundary_distribution(n: int, delta: float, p_gained: float, log_factorial):
    """The score and the probability of every (lost, gained) count with non-negligible mass when
    p_lost = p_gained + delta."""
    import numpy as np

    p_lost, p_tied = p_gained + delta, max(1.0 - 2.0 * p_gained - delta, 0.0)
    (b0, b1), (c0, c1) = _box(n, p_lost), _box(n, p_gained)
    b, c = np.meshgrid(np.arange(b0, b1 + 1), np.arange(c0, c1 + 1), indexing="ij")
    keep = (b + c <= n) if p_tied > 0 else (b + c == n)
    b, c = b[keep], c[keep]
    tied = n - b - c
    logp = log_factorial[n] - log_factorial[b] - log_factorial[c] - log_factorial[tied]
    b, c, tied = b.astype(float), c.astype(float), tied.astype(float)
    logp = logp + (b * math.log(p_lost) if p_lost > 0 else np.where(b > 0, -np.inf, 0.0))
    logp = logp + (c * math.log(p_gained) if p_gained > 0 else np.where(c > 0, -np.inf, 0.0))
    logp = logp + (tied * math.log(p_tied) if p_tied > 0 else 0.0)
    return score(b, c, n, delta), np.exp(logp)


def _box(n: int, p: float) -> tuple[int, int]:
    sd = math.sqrt(n * p * (1 - p))
    return max(0, math.floor(n * p - BOX_SD * sd - 1)), min(n, math.ceil(n * p + BOX_SD * sd + 1))


def passes(lost, gained, n: int, delta: float, alpha: float):
    """Whether the gate passes: the test rejects theta >= delta (counts may be numpy arrays)."""
    if not 0 <= delta < 1:
        raise ValueError(f"a 0/1 allowance lies in [0, 1), not {delta}")
    return score(lost, gained, n, delta) < critical_values(n, delta, alpha)[0]


def fails(lost: int, gained: int, n: int, delta: float, alpha: float) -> bool:
    """Whether the gate fails: the test rejects theta <= delta."""
    return bool(score(lost, gained, n, delta) > critical_values(n, delta, alpha)[1])


def bounds(lost: int, gained: int, n: int, delta: float, alpha: float) -> tuple[float, float]:
    """The lower and upper bounds on theta that invert the score test with the critical values exact at
    delta: upper < delta exactly when the gate passes, lower > delta exactly when it fails."""
    z_pass, z_fail = critical_values(n, delta, alpha)
    return _invert(lost, gained, n, z_fail), _invert(lost, gained, n, z_pass)


def _invert(lost: int, gained: int, n: int, z: float) -> float:
    """The theta at which the score equals z (the score falls as theta rises), by bisection."""
    lo, hi = -1.0 + 1e-12, 1.0 - 1e-12
    for _ in range(60):
        mid = (lo + hi) / 2
        if float(score(lost, gained, n, mid)) > z:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def items_for_power(p_lost: float, p_gained: float, delta: float, alpha: float, power: float = 0.8) -> int | None:
    """About how many items a pass needs with probability `power` if the rates observed hold (the
    score test's normal approximation; None when the observed degradation is not below delta)."""
    from scipy.stats import norm

    theta = p_lost - p_gained
    if theta >= delta:
        return None
    # Variance per item under the null (restricted rates) and under the observed rates.
    q = float(score_null_gained(p_lost, p_gained, delta))
    v0, v1 = 2 * q + delta * (1 - delta), p_lost + p_gained - theta**2
    root = (norm.ppf(1 - alpha) * math.sqrt(v0) + norm.ppf(power) * math.sqrt(max(v1, 0.0))) / (delta - theta)
    return math.ceil(root**2)


def score_null_gained(p_lost: float, p_gained: float, delta: float) -> float:
    """The restricted p_gained under theta = delta given observed rates (Tango's MLE, per item)."""
    b_ = -p_lost - p_gained + (2.0 - p_lost + p_gained) * delta
    c_ = -p_gained * delta * (1.0 - delta)
    return (math.sqrt(max(b_ * b_ - 8.0 * c_, 0.0)) - b_) / 4.0
