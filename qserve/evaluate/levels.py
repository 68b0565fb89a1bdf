"""How often each gate bound passes a model at exactly the allowance (its false-pass rate) and at
half of it (its power), by sample size and by the shape of the per-item losses, simulated.

The bounds are qserve's own (stats.py), called on simulated items exactly as `qserve eval` calls
them on lm-eval's. tests/test_gate_levels.py asserts the levels; `qserve gate-levels` prints the
table a user reads to choose --limit. Seeded: the same call gives the same table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qserve.checkpoint.spending import min_items
from qserve.evaluate import looks, stats

SIZES = (2, 3, 5, 10, 20, 50, 70, 100, 200, 500)  # the n the gate is used at, the first n a t bound may pass at, and a larger one
ALLOWANCE = math.log(1.05)  # +5 % perplexity, on the log scale the gate decides on
BINARY_ALLOWANCE = 0.05  # 5 points of accuracy
MEAN_WORDS = 110  # documents have 20-200 words


@dataclass(frozen=True)
class Shape:
    """Per-item degradation of one kind, scaled so that its population mean is `mean`."""

    name: str
    describe: str
    draw: Callable[[Any, float, tuple[int, int]], Any]  # (rng, mean, (n, draws)) -> per-word loss per item
    word_noise: float = 0.0  # sd of the per-word noise, as a multiple of the allowance at MEAN_WORDS words


def _mixture(rng, mean, size):
    heavy = rng.random(size) < 0.05
    return mean * (heavy * (0.8 / 0.05) + ~heavy * (0.2 / 0.95))


SHAPES = (
    Shape("constant", "the same per-word loss in every document, per-word noise", lambda r, m, s: m + 0 * r.random(s), 1.0),
    Shape("normal", "per-document loss normal, sd = the allowance", lambda r, m, s: m + ALLOWANCE * r.standard_normal(s)),
    Shape("lognormal-1", "lognormal, sigma 1 (all losses, skewed)", lambda r, m, s: m * r.lognormal(0, 1, s) / math.exp(0.5)),
    Shape(
        "lognormal-1.5", "lognormal, sigma 1.5 (strongly skewed)", lambda r, m, s: m * r.lognormal(0, 1.5, s) / math.exp(1.125)
    ),
    Shape("student-t3", "Student t, 3 d.f., scale = the allowance", lambda r, m, s: m + ALLOWANCE * r.standard_t(3, s)),
    Shape("rare-5%", "5 % of documents carry 80 % of the loss, small noise", _mixture, 0.3),
)
BINARY_SHAPES = ((0.0, "no item gained"), (0.02, "2 % gained"), (0.10, "10 % gained"), (0.30, "30 % gained"))


def corpus_passes(shape: Shape, mean: float, n: int, draws: int, rng, alpha: float) -> Any:
    """Perplexity gates (the ratio bound): which of `draws` samples of n documents pass."""
    import numpy as np

    words = rng.integers(20, 201, size=(n, draws)).astype(float)
    loss = words * shape.draw(rng, mean, (n, draws))
    loss += shape.word_noise * ALLOWANCE * np.sqrt(MEAN_WORDS * words) * rng.standard_normal((n, draws))
    base = -2.0 * words  # the baseline's log-likelihood; only the difference matters
    estimate, terms = stats.ratio_terms(base, words, base - loss, words)
    return stats.passes(stats.linearized_t(estimate, terms, alpha), ALLOWANCE, n) & np.isfinite(estimate)


def mean_passes(shape: Shape, mean: float, n: int, draws: int, rng, alpha: float) -> Any:
    """Per-item means that are not 0/1 (the mean bound): items of equal weight."""
    d = shape.draw(rng, mean, (n, draws)) + shape.word_noise * ALLOWANCE * rng.standard_normal((n, draws))
    return stats.passes(stats.linearized_t(d.mean(0), d - d.mean(0), alpha), ALLOWANCE, n)


def binary_passes(gained: float, mean: float, n: int, draws: int, rng, alpha: float) -> Any:
    """0/1 gates (the exact bound): items lost with rate gained + mean, gained with rate `gained`."""
    counts = rng.multinomial(n, [gained + mean, gained, 1 - 2 * gained - mean], size=draws)
    _, hi_lost = stats.clopper_pearson(counts[:, 0], n, alpha / 2)
    lo_gain, _ = stats.clopper_pearson(counts[:, 1], n, alpha / 2)
    return (hi_lost - lo_gain) < BINARY_ALLOWANCE


def simulate(
    draws: int = 2000, sizes: tuple[int, ...] = SIZES, seed: int = 0, alpha: float | None = None
) -> list[dict[str, Any]]:
    """One row per bound, shape and n: the pass rates at the allowance and at half of it, at the
    level of a first look (looks.py) unless `alpha` is given."""
    alpha = looks.level(1) if alpha is None else alpha
    import numpy as np

    cells = [("corpus", s.name, corpus_passes, s, ALLOWANCE) for s in SHAPES]
    cells += [("mean", s.name, mean_passes, s, ALLOWANCE) for s in SHAPES]
    cells += [("binary", label, binary_passes, g, BINARY_ALLOWANCE) for g, label in BINARY_SHAPES]
    rows = []
    for i, (bound, name, passes, shape, allowance) in enumerate(cells):
        for n in sizes:
            rng = np.random.default_rng([seed, i, n])
            at, half = (float(np.mean(passes(shape, m, n, draws, rng, alpha))) for m in (allowance, allowance / 2))
            rows.append({"bound": bound, "shape": name, "n": n, "false_pass": at, "power": half, "draws": draws, "level": alpha})
    return rows


def limit(draws: int, level: float = stats.ONE_SIDED) -> float:
    """The most false passes a bound of this level may show in `draws` draws: level + 3 Monte-Carlo SE."""
    return level + 3 * math.sqrt(level * (1 - level) / draws)


def markdown(rows: list[dict[str, Any]], provenance: str) -> str:
    """The table as a page: false-pass at the allowance / pass rate at half the allowance, per n."""
    sizes = sorted({r["n"] for r in rows})
    draws, level = rows[0]["draws"], rows[0]["level"]
    out = [
        "# What the gate guarantees, by n",
        "",
        provenance,
        "",
        f"Each cell: how often qserve's gate PASSES a model whose true degradation is exactly the allowance "
        f"(false pass; at most {stats.ONE_SIDED:.0%} + 3 Monte-Carlo SE = {limit(draws):.1%} allowed) / at half the allowance "
        f"(power), over {draws} simulated samples of n items, with the bounds of a first look at a checkpoint's weights "
        f"(one-sided {1 - level:.2%}; later looks spend less, so that all of them together stay within 5 %). "
        "Perplexity allowance +5 %, accuracy allowance "
        f"{BINARY_ALLOWANCE:.0%} points. A pass on a t bound needs n >= {min_items(level)} and n > {stats.SKEW_RULE[0]} + {stats.SKEW_RULE[1]} skewness^2 "
        "(qserve/evaluate/stats.py says why).",
        "",
    ]
    shapes = {s.name: s.describe for s in SHAPES} | {label: label for _, label in BINARY_SHAPES}
    for bound, title in (("corpus", "Perplexity / bits per byte"), ("mean", "Per-item means (not 0/1)"), ("binary", "0/1 items")):
        out += [f"## {title}", "", "| shape | " + " | ".join(f"n={n}" for n in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
        for name in dict.fromkeys(r["shape"] for r in rows if r["bound"] == bound):
            cells = {r["n"]: r for r in rows if r["bound"] == bound and r["shape"] == name}
            out.append(
                f"| {shapes[name]} | "
                + " | ".join(f"{cells[n]['false_pass']:.1%} / {cells[n]['power']:.0%}" for n in sizes)
                + " |"
            )
        out.append("")
    return "\n".join(out)


def provenance(draws: int) -> str:
    """The command, date and commit a page of this table was made with (the simulation needs no machine)."""
    from datetime import UTC, datetime

    from qserve.device.detect import commit

    return f"Made by `qserve gate-levels --draws {draws}` on {datetime.now(UTC):%Y-%m-%d}, commit {commit()} (seeded: any machine gives the same table)."
