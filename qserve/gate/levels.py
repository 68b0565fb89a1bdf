"""How often each gate bound passes a model at exactly the allowance (its false-pass rate) and at
half of it (its power), by sample size and by the shape of the per-item losses, simulated.

The bounds are qserve's own (stats.py; betting.py for 0/1 items and word perplexity), called on
simulated items exactly as `qserve eval` calls them on lm-eval's. tests/test_gate_levels.py asserts
the levels; `qserve gate-levels` prints the table a user reads to choose --limit. Seeded: the same call gives the same table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qserve.gate import betting, looks, stats
from qserve.gate.spending import ALPHA, min_items

# The n the gate is used at, the first n a pass may rest on, and larger ones.
SIZES = (2, 3, 5, 10, 20, 50, 70, 100, 200, 500, 1000, 5000)
ALLOWANCE = math.log(1.05)  # +5 % perplexity, on the log scale the gate decides on
# 0/1 gates: the n, allowances (points of accuracy) and rates of items gained each way that the level is proven over.
BINARY_SIZES = (50, 100, 200, 500, 1000, 2000, 5000)
BINARY_ALLOWANCES = (0.01, 0.02, 0.05, 0.10)
BINARY_GAINED = (0.0, 0.02, 0.05, 0.10, 0.20, 0.40)
MEAN_WORDS = 110  # documents have 20-200 words


@dataclass(frozen=True)
class Shape:
    """Per-item degradation of one kind, scaled so that its population mean is `mean`."""

    name: str
    describe: str
    draw: Callable[[Any, float, tuple[int, int]], Any]  # (rng, mean, (n, draws)) -> per-word loss per item
    word_noise: float = 0.0  # sd of the per-word noise, as a multiple of the allowance at MEAN_WORDS words
    length: bool = False  # perplexity gates: the per-word loss grows in proportion to the document's length


def _mixture(share: float) -> Callable[[Any, float, tuple[int, int]], Any]:
    """`share` of the documents carry 80 % of the loss."""

    def draw(rng, mean, size):
        heavy = rng.random(size) < share
        return mean * (heavy * (0.8 / share) + ~heavy * (0.2 / (1 - share)))

    return draw


SHAPES = (
    Shape("constant", "the same per-word loss in every document, per-word noise", lambda r, m, s: m + 0 * r.random(s), 1.0),
    Shape("normal", "per-document loss normal, sd = the allowance", lambda r, m, s: m + ALLOWANCE * r.standard_normal(s)),
    Shape("lognormal-1", "lognormal, sigma 1 (all losses, skewed)", lambda r, m, s: m * r.lognormal(0, 1, s) / math.exp(0.5)),
    Shape(
        "lognormal-1.5", "lognormal, sigma 1.5 (strongly skewed)", lambda r, m, s: m * r.lognormal(0, 1.5, s) / math.exp(1.125)
    ),
    Shape("student-t3", "Student t, 3 d.f., scale = the allowance", lambda r, m, s: m + ALLOWANCE * r.standard_t(3, s)),
    Shape("rare-5%", "5 % of documents carry 80 % of the loss, small noise", _mixture(0.05), 0.3),
    Shape(
        "length-correlated",
        "per-word loss in proportion to the document's length, lognormal sigma 1, per-word noise",
        lambda r, m, s: m * r.lognormal(0, 1, s) / math.exp(0.5),
        0.3,
        length=True,
    ),
    Shape("pareto-4", "Pareto tail, index 4, centred, sd = the allowance", lambda r, m, s: m + ALLOWANCE * _pareto(r, 4.0, s)),
    Shape(
        "pareto-3",
        "Pareto tail, index 3 (no third moment), centred, sd = the allowance",
        lambda r, m, s: m + ALLOWANCE * _pareto(r, 3.0, s),
    ),
    Shape(
        "pareto-2.5",
        "Pareto tail, index 2.5, centred, sd = the allowance",
        lambda r, m, s: m + ALLOWANCE * _pareto(r, 2.5, s),
    ),
    Shape("pareto-3-noisy", "Pareto tail, index 3, all losses, per-word noise", lambda r, m, s: m * 2 * r.pareto(3.0, s), 1.0),
    Shape(
        "pareto-2.5-noisy", "Pareto tail, index 2.5, all losses, per-word noise", lambda r, m, s: m * 1.5 * r.pareto(2.5, s), 1.0
    ),
    Shape(
        "pareto-2.5-quiet",
        "Pareto tail, index 2.5, all losses, small per-word noise",
        lambda r, m, s: m * 1.5 * r.pareto(2.5, s),
        0.3,
    ),
)
# Outside the guarantee (docs/gate-levels.md shows them): a loss in fewer documents than the fewest
# items a pass needs can see (spending.RARE_LOSS_SHARE), and a tail without a variance.
OUTSIDE = (
    Shape("rare-1%", "1 % of documents carry 80 % of the loss, small noise", _mixture(0.01), 0.3),
    Shape(
        "pareto-1.8-noisy",
        "Pareto tail, index 1.8 (no variance), all losses, per-word noise",
        lambda r, m, s: m * 0.8 * r.pareto(1.8, s),
        1.0,
    ),
)
OUTSIDE_SIZES = (100, 300, 1000, 5000)
LATER_LOOKS = (2, 5)  # the next look, and one whose level is a twenty-fifth of the first's
LATER_SIZES = (100, 300, 1000)  # the n users re-run at
SEQUENCE = (100, 300, 1000)  # one user's looks at growing --limit, each on everything scored so far


def _pareto(rng, index: float, size):
    """Pareto (Lomax) draws of the given tail index, centred and scaled to sd 1."""
    mean, sd = 1 / (index - 1), math.sqrt(index / ((index - 1) ** 2 * (index - 2)))
    return (rng.pareto(index, size) - mean) / sd


def corpus_sample(shape: Shape, mean: float, n: int, draws: int, rng) -> tuple[Any, ...]:
    """Perplexity gates (the ratio bound): `draws` samples of n documents' log-likelihoods and word
    counts, baseline and quantized, items on axis 0."""
    import numpy as np

    words = rng.integers(20, 201, size=(n, draws)).astype(float)
    loss = words * shape.draw(rng, mean, (n, draws))
    if shape.length:  # scaled so that the corpus's loss per word stays `mean`: E[w] / E[w^2] over 20-200 words
        loss *= words * (sum(range(20, 201)) / sum(w * w for w in range(20, 201)))
    loss += shape.word_noise * ALLOWANCE * np.sqrt(MEAN_WORDS * words) * rng.standard_normal((n, draws))
    base = -2.0 * words  # the baseline's log-likelihood; only the difference matters
    return base, words, base - loss, words


def mean_sample(shape: Shape, mean: float, n: int, draws: int, rng) -> tuple[Any, ...]:
    """Per-item means that are not 0/1 (the mean bound): items of equal weight."""
    return (shape.draw(rng, mean, (n, draws)) + shape.word_noise * ALLOWANCE * rng.standard_normal((n, draws)),)


def _mean_terms(d: Any) -> tuple[Any, Any]:
    return d.mean(0), d - d.mean(0)


# bound -> (how its samples are drawn, how the gate reduces them to an estimate and linearized terms)
BOUNDS = {"corpus": (corpus_sample, stats.ratio_terms), "mean": (mean_sample, _mean_terms)}


def passes(estimate: Any, terms: Any, alpha: float) -> Any:
    """Which samples the gate passes at level `alpha`, exactly as `qserve eval` decides."""
    import numpy as np

    n = terms.shape[0]
    return stats.passes(stats.linearized_t(estimate, terms, alpha), ALLOWANCE, n) & np.isfinite(estimate)


def binary_passes(gained: float, loss: float, sizes: tuple[int, ...], draws: int, rng, allowance: float) -> dict[int, Any]:
    """0/1 gates as they are decided (betting.py, the `max_drop` bet at 5 % over every look): items
    gained at rate `gained`, lost at rate gained + loss, drawn independently (a task much larger than
    n); per n in `sizes`, which runs passed within their first n items. One run serves every n, as a
    --limit n is the first n items of the same order."""

    d = rng.choice([1.0, -1.0, 0.0], p=[gained + loss, gained, 1 - 2 * gained - loss], size=(max(sizes), draws))
    wealth = betting.wealth_paths(d, *betting.Spec("mean", allowance, bounds=(-1.0, 1.0)).bet_range())
    return _passed_by(wealth, sizes)


def _passed_by(wealth: dict[str, Any], sizes: tuple[int, ...]) -> dict[int, Any]:
    """Per n in `sizes`, which runs' pass bettor reached 1/alpha within n items, before any fail."""
    import numpy as np

    first = {}
    for side in ("pass", "fail"):
        hit = wealth[f"log_wealth_{side}"][1:] >= math.log(1 / ALPHA)
        first[side] = np.where(hit.any(0), hit.argmax(0) + 1, math.inf)
    return {n: (first["pass"] <= n) & (first["pass"] < first["fail"]) for n in sizes}


def simulate_binary(draws: int = 2000, sizes: tuple[int, ...] = BINARY_SIZES, seed: int = 0) -> list[dict[str, Any]]:
    """One row per n, allowance and rate of items gained: how often the 0/1 gate passes a model at
    exactly the allowance (false pass) and one with no true loss (power: items only flip each way)."""
    import numpy as np

    rows = []
    for i, allowance in enumerate(BINARY_ALLOWANCES):
        for j, gained in enumerate(BINARY_GAINED):
            rng = np.random.default_rng([seed, 100 + i, j])
            at, none = (binary_passes(gained, m, sizes, draws, rng, allowance) for m in (allowance, 0.0))
            rows += [
                {"bound": "binary", "allowance": allowance, "gained": gained, "n": n}
                | {"false_pass": float(np.mean(at[n])), "power": float(np.mean(none[n])), "draws": draws, "level": ALPHA}
                for n in sizes
            ]
    return rows


# Word perplexity under `qserve eval`: documents of this many (20-200 words each) stand for a task much
# larger than n, drawn in proportion to their words as its size-biased order takes them.
CORPUS_DOCUMENTS = 20_000


def word_population(shape: Shape, mean: float, rng) -> tuple[Any, Any]:
    """CORPUS_DOCUMENTS documents' (per-word loss change, words) of one shape as corpus_sample draws
    them, each inside 0.95 of the cap, shifted so that the corpus's loss per word is exactly `mean`."""
    import numpy as np

    cap = betting.DEFAULT_CAP
    base, words, quant, _ = corpus_sample(shape, mean, CORPUS_DOCUMENTS, 1, rng)
    r = np.clip(((base - quant) / words)[:, 0], -0.95 * cap, 0.95 * cap)
    w = words[:, 0]
    r += mean - (w * r).sum() / w.sum()
    return np.clip(r, -cap, cap), w


def word_perplexity_passes(shape: Shape, mean: float, sizes: tuple[int, ...], draws: int, rng) -> dict[int, Any]:
    """Word perplexity as `qserve eval` decides it (betting.py, the perplexity bet at the default cap, 5 %
    over every look): per n in `sizes`, which runs passed within their first n documents."""

    r, words = word_population(shape, mean, rng)
    d = r[rng.choice(len(r), size=(max(sizes), draws), p=words / words.sum())]
    wealth = betting.wealth_paths(d, *betting.Spec("perplexity", math.expm1(ALLOWANCE)).bet_range())
    return _passed_by(wealth, sizes)


def item_population(shape: Shape, mean: float, rng) -> Any:
    """CORPUS_DOCUMENTS items' loss changes of one shape as mean_sample draws them, each inside 0.95 of
    the per-item cap, shifted so that their mean is exactly `mean`."""
    import numpy as np

    cap = betting.DEFAULT_CAPS["item"]
    r = np.clip(mean_sample(shape, mean, CORPUS_DOCUMENTS, 1, rng)[0][:, 0], -0.95 * cap, 0.95 * cap)
    return np.clip(r + mean - r.mean(), -cap, cap)


def item_perplexity_passes(shape: Shape, mean: float, sizes: tuple[int, ...], draws: int, rng) -> dict[int, Any]:
    """lm-eval's `perplexity` (lambada's) as `qserve eval` decides it: the same bet per item, within the
    per-item cap, items drawn uniformly; per n in `sizes`, which runs passed within their first n items."""
    r = item_population(shape, mean, rng)
    d = r[rng.integers(0, len(r), size=(max(sizes), draws))]
    spec = betting.Spec("perplexity", math.expm1(ALLOWANCE), cap=betting.DEFAULT_CAPS["item"], unit="item")
    return _passed_by(betting.wealth_paths(d, *spec.bet_range()), sizes)


def simulate_word_perplexity(draws: int = 2000, sizes: tuple[int, ...] = BINARY_SIZES, seed: int = 0) -> list[dict[str, Any]]:
    """One row per shape (the class of stats.py's bound and the shapes outside it) and n: how often
    betting passes a model at exactly the allowance and one at half of it."""
    return _simulate_bets(word_perplexity_passes, draws, sizes, seed, 200)


def simulate_item_perplexity(draws: int = 2000, sizes: tuple[int, ...] = BINARY_SIZES, seed: int = 0) -> list[dict[str, Any]]:
    """The same rows for lambada's perplexity, bet per item within log 100."""
    return _simulate_bets(item_perplexity_passes, draws, sizes, seed, 300)


def _simulate_bets(
    bet: Callable[..., dict[int, Any]], draws: int, sizes: tuple[int, ...], seed: int, stream: int
) -> list[dict[str, Any]]:
    import numpy as np

    rows = []
    for k, shape in enumerate(SHAPES + OUTSIDE):
        rng = np.random.default_rng([seed, stream + k])
        at, half = (bet(shape, m, sizes, draws, rng) for m in (ALLOWANCE, ALLOWANCE / 2))
        rows += [
            {"bound": "betting", "shape": shape.name, "n": n}
            | {"false_pass": float(np.mean(at[n])), "power": float(np.mean(half[n])), "draws": draws, "level": ALPHA}
            for n in sizes
        ]
    return rows


def simulate(
    draws: int = 2000,
    sizes: tuple[int, ...] = SIZES,
    seed: int = 0,
    alphas: tuple[float, ...] | None = None,
    shapes: tuple[Shape, ...] = SHAPES,
) -> list[dict[str, Any]]:
    """One row per bound, shape, n and level: the pass rates at the allowance and at half of it, at
    the level of a first look (looks.py) unless `alphas` are given (each decided on the same samples)."""
    import numpy as np

    alphas = (looks.level(1),) if alphas is None else alphas
    rows = []
    for bound, (sample, reduce) in BOUNDS.items():
        for shape in shapes:
            for n in sizes:
                rng = np.random.default_rng([seed, (SHAPES + OUTSIDE).index(shape), bound == "mean", n])
                at, half = (reduce(*sample(shape, m, n, draws, rng)) for m in (ALLOWANCE, ALLOWANCE / 2))
                for alpha in alphas:
                    rates = {k: float(np.mean(passes(*x, alpha))) for k, x in (("false_pass", at), ("power", half))}
                    rows.append({"bound": bound, "shape": shape.name, "n": n} | rates | {"draws": draws, "level": alpha})
    return rows


def sequence_rows(draws: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    """One user's looks at growing --limit (SEQUENCE), each decided on everything scored so far at its
    look's level: how often any of them passes a model at the allowance, and a good one by the last."""
    import numpy as np

    rows = []
    for bound, (sample, reduce) in BOUNDS.items():
        for shape in SHAPES:
            rng = np.random.default_rng([seed, SHAPES.index(shape), bound == "mean", 7])
            rates = {}
            for key, m in (("false_pass", ALLOWANCE), ("power", ALLOWANCE / 2)):
                items = sample(shape, m, SEQUENCE[-1], draws, rng)
                any_pass = np.zeros(draws, dtype=bool)
                for look, n in enumerate(SEQUENCE, start=1):  # look k scores the first n items
                    any_pass |= passes(*reduce(*(a[:n] for a in items)), looks.level(look))
                rates[key] = float(np.mean(any_pass))
            rows.append(
                {"bound": bound, "shape": shape.name, "n": SEQUENCE[-1]} | rates | {"draws": draws, "level": stats.ONE_SIDED}
            )
    return rows


def limit(draws: int, level: float = stats.ONE_SIDED) -> float:
    """The most false passes a bound of this level may show in `draws` draws: level + 3 Monte-Carlo SE."""
    return level + 3 * math.sqrt(level * (1 - level) / draws)


def markdown(
    rows: list[dict[str, Any]],
    binary: list[dict[str, Any]],
    tails: list[dict[str, Any]],
    provenance: str,
    later: list[dict[str, Any]],
    sequence: list[dict[str, Any]],
    words: list[dict[str, Any]],
    items: list[dict[str, Any]],
) -> str:
    """The tables as a page: false pass at the allowance / power, per n."""
    out = _intro(rows[0]["draws"], rows[0]["level"], provenance) + _binary_section(binary) + _word_perplexity_section(words)
    out += _item_perplexity_section(items) + _means_section(rows, later) + _sequence_section(sequence)
    out += _outside_section(tails)
    return "\n".join(out)


MEAN_BOUNDS = (("corpus", "Perplexity / bits per byte"), ("mean", "Per-item means (not 0/1)"))


def _intro(draws: int, level: float, provenance: str) -> list[str]:
    return [
        "# What the gate guarantees, by n",
        "",
        provenance,
        "",
        f"Each cell: how often qserve's gate PASSES a model whose true degradation is exactly the allowance "
        f"(false pass) / how often it passes a good model (power), over {draws} simulated samples of n items. "
        f"0/1 items, and corpus perplexities as `qserve eval` scores them, are decided by betting, at 5 % over every "
        f"look (at most {limit(draws, ALPHA):.2%} allowed: 5 % + 3 Monte-Carlo SE), and so is lambada's perplexity, "
        f"per item, and so are scores where lower is better and corpus perplexities of lm-eval runs made "
        f"elsewhere on part of a task (a claim about the scored documents), and scores in a range the gate declares "
        f"(score_range: the [0, 1] bet scaled); the other tables (per-item means "
        f"outside [0, 1] with no declared range, lm-eval's `perplexity` on a rolling task) use the "
        f"bounds of a first look at a checkpoint's weights (one-sided {1 - level:.2%}, at most {level:.2%} + 3 SE = "
        f"{limit(draws, level):.2%} allowed; later looks spend less, so that all of them together stay within 5 %).",
        "",
    ]


def _binary_section(binary: list[dict[str, Any]]) -> list[str]:
    out = [
        "## 0/1 items (exact_match, acc, acc_norm)",
        "",
        f"Decided by betting (qserve/gate/betting.py, the gate's own bettor) at {ALPHA:.0%} over every look, so "
        "later looks need no smaller share; the level holds by Ville's inequality for every pattern of items "
        "lost and gained, and the table shows it at n items of a task much larger than n (items drawn "
        "independently; on a smaller test set the gate bets without replacement and decides sooner: "
        "docs/benchmark-power.md). Power: a model with no true loss whose items flip each way at the row's rate, as quantized models' items do. "
        "Read your allowance's table at your flip rate to see whether your --limit can decide.",
        "",
    ]
    sizes = sorted({r["n"] for r in binary})
    for allowance in dict.fromkeys(r["allowance"] for r in binary):
        out += [
            f"### Allowance {allowance * 100:g} point{'' if allowance == 0.01 else 's'}",
            "",
            "| items flipping each way | " + " | ".join(f"n={n}" for n in sizes) + " |",
        ]
        out.append("|---" * (len(sizes) + 1) + "|")
        for gained in dict.fromkeys(r["gained"] for r in binary):
            cells = {r["n"]: r for r in binary if r["allowance"] == allowance and r["gained"] == gained}
            out.append(
                f"| {gained:.0%} | " + " | ".join(f"{cells[n]['false_pass']:.1%} / {cells[n]['power']:.0%}" for n in sizes) + " |"
            )
        out.append("")
    return out


def _word_perplexity_section(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "## Word perplexity (byte perplexity, bits per byte) under `qserve eval`",
        "",
        f"Decided by betting at {ALPHA:.0%} over every look on each document's loss change per word within the "
        f"default cap (log 2 nats; a document beyond it fails the gate), the documents in the task's order "
        f"size-biased by words, so the bet is on the corpus ratio itself. The level holds by Ville's inequality "
        f"for every distribution within the cap: the shapes below, and those outside stats.py's class further down, "
        f"are examples, not the class. Byte perplexity and bits per byte are the same bet by bytes, with other weights. "
        f"Allowance +5 %; power: a model at half of it; n documents of a task much "
        f"larger than n ({CORPUS_DOCUMENTS:,} documents of 20-200 words, drawn in proportion to their words).",
        "",
    ]
    return out + _shape_tables(rows, (("betting", None),))


def _item_perplexity_section(rows: list[dict[str, Any]]) -> list[str]:
    cap = betting.DEFAULT_CAPS["item"]
    out = [
        "## lambada's perplexity (lm-eval's `perplexity` on a task of one target per item) under `qserve eval`",
        "",
        f"The same bet per item: each item's loss change within the per-item cap (log 100 = {cap:.3g} nats; an item "
        f"beyond it fails the gate), items in the task's uniform seeded order. The level holds by Ville's inequality "
        f"for every distribution within the cap; the shapes are stats.py's class and the two outside it, scaled to "
        f"the allowance as above. The wide cap is the price: the bets stay small next to it, so a model at half "
        f"the allowance needs more items than word perplexity's documents. Allowance +5 %; power: a model at half of "
        f"it; n items of a task much larger than n ({CORPUS_DOCUMENTS:,} items).",
        "",
    ]
    return out + _shape_tables(rows, (("betting", None),))


def _means_section(rows: list[dict[str, Any]], later: list[dict[str, Any]]) -> list[str]:
    level = rows[0]["level"]
    out = [
        "## Perplexity, bits per byte and other per-item means (stats.py's bounds)",
        "",
        "lm-eval's `perplexity` on a rolling task (per document) and per-item means outside [0, 1] with no declared "
        "score_range (the perplexity shapes below stand for them).",
        "",
        "Power here: a model at half the allowance. Perplexity allowance +5 %. A pass needs the upper bound "
        f"(Student t's critical value t plus {stats.TAIL:g} t^2) under the allowance, n >= {min_items(level)} and "
        f"n > {stats.SKEW_RULE[0]} + {stats.SKEW_RULE[1]} skewness^2 (qserve/gate/stats.py says why). "
        "The shapes below are the class the guarantee covers; the later looks' tables follow.",
        "",
    ]
    out += _shape_tables(rows, MEAN_BOUNDS)
    for alpha in dict.fromkeys(r["level"] for r in later):
        cells, many = [r for r in later if r["level"] == alpha], later[0]["draws"]
        out += [
            f"## Look {_look(alpha)}: level {alpha:.2%}",
            "",
            f"A later look at the same weights is decided at its own share of the 5 % (at most {limit(many, alpha):.2%} "
            f"with 3 Monte-Carlo SE over {many} samples per cell). 0/1 gates keep every look's share (exact test).",
            "",
        ]
        out += _shape_tables(cells, MEAN_BOUNDS)
    return out


def _sequence_section(sequence: list[dict[str, Any]]) -> list[str]:
    out = [
        "## Every look together",
        "",
        f"One user's looks at growing --limit ({', '.join(str(n) for n in SEQUENCE)}), each decided on everything scored "
        f"so far at its look's level: how often any of them passes a model at the allowance (at most 5 % + 3 Monte-Carlo "
        f"SE = {limit(sequence[0]['draws']):.2%}) / how often a model at half the allowance has passed by the last, over "
        f"{sequence[0]['draws']} users.",
        "",
        "| shape | perplexity / bits per byte | per-item means |",
        "|---|---|---|",
    ]
    for shape in SHAPES:
        cell = {r["bound"]: r for r in sequence if r["shape"] == shape.name}
        out.append(
            f"| {shape.describe} | "
            + " | ".join(f"{cell[b]['false_pass']:.1%} / {cell[b]['power']:.0%}" for b, _ in MEAN_BOUNDS)
            + " |"
        )
    return out


def _outside_section(tails: list[dict[str, Any]]) -> list[str]:
    out = [
        "",
        "## Outside the guarantee",
        "",
        "No rule on a sample can keep the level for every distribution with a finite variance (Bahadur and Savage, 1956, "
        "Annals of Mathematical Statistics 27:1115): a guarantee needs a class of shapes. Outside qserve's, at a first look: "
        "a loss carried by 1 % of documents, which most samples of a few hundred never draw (no bound can see it), and a "
        "tail without a variance (the page shows what the simulation finds; nothing is claimed for it):",
        "",
    ]
    return out + _shape_tables(tails, MEAN_BOUNDS)


def _look(alpha: float) -> int:
    return next(k for k in range(1, 1000) if math.isclose(looks.level(k), alpha))


def _shape_tables(rows: list[dict[str, Any]], bounds: tuple[tuple[str, str | None], ...]) -> list[str]:
    """One table per bound, a row per shape; a title None: no heading."""
    sizes = sorted({r["n"] for r in rows})
    shapes = {s.name: s.describe for s in SHAPES + OUTSIDE}
    out = []
    for bound, title in bounds:
        out += [f"### {title}", ""] if title else []
        out += ["| shape | " + " | ".join(f"n={n}" for n in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
        for name in dict.fromkeys(r["shape"] for r in rows if r["bound"] == bound):
            cells = {r["n"]: r for r in rows if r["bound"] == bound and r["shape"] == name}
            row = " | ".join(f"{cells[n]['false_pass']:.1%} / {cells[n]['power']:.0%}" for n in sizes)
            out.append(f"| {shapes[name]} | {row} |")
        out.append("")
    return out


def tail_rows(draws: int = 2000) -> list[dict[str, Any]]:
    """The shapes outside the guarantee, at OUTSIDE_SIZES."""
    return simulate(draws, sizes=OUTSIDE_SIZES, shapes=OUTSIDE)


def later_rows(draws: int = 2000) -> list[dict[str, Any]]:
    """The class's shapes at LATER_LOOKS' levels, at LATER_SIZES, on four times the draws (a smaller
    level needs them for its Monte-Carlo SE)."""
    return simulate(4 * draws, sizes=LATER_SIZES, alphas=tuple(looks.level(k) for k in LATER_LOOKS))


def page(draws: int = 2000) -> str:
    """docs/gate-levels.md: every table, seeded."""
    return markdown(
        simulate(draws),
        simulate_binary(draws),
        tail_rows(draws),
        provenance(draws),
        later_rows(draws),
        sequence_rows(draws),
        simulate_word_perplexity(draws),
        simulate_item_perplexity(draws),
    )


def provenance(draws: int) -> str:
    """The command, date and commit a page of this table was made with (the simulation needs no machine)."""
    from datetime import UTC, datetime

    from qserve.device.detect import commit

    return f"Made by `qserve gate-levels --draws {draws}` on {datetime.now(UTC):%Y-%m-%d}, commit {commit()} (seeded: any machine gives the same table)."
