"""How much of the 5 % each gate decision may spend, and the fewest items a pass may rest on.

Plain arithmetic (no imports beyond math), shared by the policy serve enforces, the evaluation's
bounds and `--help`.
"""

from __future__ import annotations

import math

ALPHA = 0.05  # over all looks at a checkpoint's weights, a model at its allowance passes at most this often
# A loss carried by this share of the items is what the smallest passing n must not miss.
RARE_LOSS_SHARE = 0.05


def level(look: int) -> float:
    """The one-sided level the look-th gate decision on the same weights is made at
    (qserve/gate/looks.py says why): ALPHA * 6 / (pi^2 look^2), summing to ALPHA."""
    return ALPHA * 6 / (math.pi**2 * look**2)


def min_items(alpha: float) -> int:
    """The fewest items a pass on a t bound at level `alpha` may rest on: a loss carried by
    RARE_LOSS_SHARE of the items is then missed by the whole sample at most `alpha` of the time
    (qserve/gate/stats.py says why)."""
    return math.ceil(math.log(alpha) / math.log1p(-RARE_LOSS_SHARE))


MIN_ITEMS = min_items(level(1))  # 69: a first look
