"""Betting without replacement (qserve/gate/betting.py `wor_paths`): a finite test set's items in a
uniformly random order fixed before any score, as `--limit` takes them. Its level at the allowance
under any stopping rule, on finite populations of every shape the with-replacement bettor is shown
on, its exact decision once every item is scored, and what it needs against the with-replacement
bettor. Seeded; each figure is printed (`pytest -s`) and asserted.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from conftest import DATA_DIR

from qserve.gate import betting
from qserve.gate.betting import Evidence, Population, Spec
from qserve.gate.spending import ALPHA

THRESHOLD = math.log(1 / ALPHA)
PATHS = 2000
LIMIT = ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / PATHS)  # the level plus 3 Monte-Carlo standard errors
NEVER = np.iinfo(np.int64).max
SIZE = 1319  # GSM8K's test set
SHAPES = ("normal", "lognormal-1", "lognormal-2", "pareto-2.1", "rare-1%", "rare-2%", "rare-5%")


def _orders(values: np.ndarray, paths: int, rng) -> np.ndarray:
    """`paths` uniformly random orders of the population (items on axis 0, one order per column)."""
    return values[np.argsort(rng.random((len(values), paths)), axis=0)]


def _first(log_wealth: np.ndarray) -> np.ndarray:
    hit = log_wealth[1:] >= THRESHOLD
    return np.where(hit.any(0), hit.argmax(0) + 1, NEVER)


def _binary_population(size: int, gained: float, allowance: float) -> np.ndarray:
    """0/1 differences whose mean is exactly the allowance: lost = gained + allowance, as counts."""
    g = round(gained * size)
    lost = g + round(allowance * size)
    assert (lost - g) / size == allowance
    return np.concatenate([np.ones(lost), -np.ones(g), np.zeros(size - lost - g)])


def _population(shape: str, mean: float, cap: float, size: int, rng) -> np.ndarray:
    """`size` per-item differences of one shape inside [-cap, cap] whose mean is exactly `mean`."""
    if shape.startswith("rare-"):  # a share of documents at the cap carries the loss, the rest make the mean exact
        heavy = round(float(shape[5:-1]) / 100 * size)
        return np.concatenate([np.full(heavy, cap), np.full(size - heavy, (mean * size - heavy * cap) / (size - heavy))])
    index = 2.1  # Lomax, as tests/test_betting.py draws it
    pareto_sd = math.sqrt(index / ((index - 1) ** 2 * (index - 2)))
    u = {
        "normal": lambda: mean + mean * rng.standard_normal(size),
        "lognormal-1": lambda: mean * rng.lognormal(0.0, 1.0, size) / math.exp(0.5),
        "lognormal-2": lambda: mean * rng.lognormal(0.0, 2.0, size) / math.exp(2.0),
        "pareto-2.1": lambda: mean + mean * (rng.pareto(index, size) - 1 / (index - 1)) / pareto_sd,
    }[shape]()
    u = np.clip(u, -0.95 * cap, 0.95 * cap)
    u += mean - u.mean()
    assert np.abs(u).max() <= cap and abs(u.mean() - mean) < 1e-12
    return u


def _false_rates(values: np.ndarray, lo: float, hi: float, delta: float, seed: list[int]) -> tuple[float, float]:
    """Over PATHS random orders of a population whose mean is exactly delta: how often the pass bettor
    reaches 1/alpha at any item (the supremum Ville bounds, so every stopping rule's), and the fail bettor."""
    paths = betting.wor_paths(_orders(values, PATHS, np.random.default_rng(seed)), lo, hi, delta, len(values))
    return float(np.mean(_first(paths["log_wealth_pass"]) < NEVER)), float(np.mean(_first(paths["log_wealth_fail"]) < NEVER))


@pytest.mark.parametrize("allowance", [0.01, 0.04, 0.10])
@pytest.mark.parametrize("gained", [0.0, 0.05, 0.20, 0.40])
def test_binary_level_holds_over_every_item_of_a_finite_test_set(allowance: float, gained: float) -> None:
    values = _binary_population(1000, gained, allowance)
    passes, fails = _false_rates(values, -1.0, 1.0, allowance, [11, round(allowance * 100), round(gained * 100)])
    print(f"\nwithout replacement, binary allowance {allowance} gained {gained}: false pass {passes}, false fail {fails}")
    assert passes <= LIMIT and fails <= LIMIT


@pytest.mark.parametrize("shape", SHAPES)
def test_mean_level_holds_for_every_shape_inside_the_range(shape: str) -> None:
    """Per-item differences within a declared range of +-log 2 (the perplexity cap), mean exactly the
    allowance log 1.05: normal, skewed, heavy-tailed, and carried by 1, 2 or 5 % of the items."""
    delta, cap = math.log1p(0.05), math.log(2)
    values = _population(shape, delta, cap, SIZE, np.random.default_rng([12, SHAPES.index(shape)]))
    passes, fails = _false_rates(values, -cap, cap, delta, [13, SHAPES.index(shape)])
    print(f"\nwithout replacement, {shape} at the allowance: false pass {passes}, false fail {fails}")
    assert passes <= LIMIT and fails <= LIMIT


# lm-eval's `perplexity` (lambada's) bets per item within log 100 (betting.DEFAULT_CAPS), on lambada's 5,153 passages.
ITEM_CAP, LAMBADA = math.log(100), 5153


@pytest.mark.parametrize("shape", SHAPES)
def test_per_item_perplexity_level_holds_for_every_shape_inside_its_cap(shape: str) -> None:
    """Per-item loss changes within log 100 nats, mean exactly the allowance log 1.05, on a test set of
    lambada's size: normal, skewed, heavy-tailed, and carried by 1, 2 or 5 % of the items at the cap."""
    delta = math.log1p(0.05)
    values = _population(shape, delta, ITEM_CAP, LAMBADA, np.random.default_rng([37, SHAPES.index(shape)]))
    passes, fails = _false_rates(values, -ITEM_CAP, ITEM_CAP, delta, [38, SHAPES.index(shape)])
    print(f"\nper item within log 100, {shape} at the allowance: false pass {passes}, false fail {fails}")
    assert passes <= LIMIT and fails <= LIMIT


@pytest.mark.parametrize("shape", SHAPES)
def test_per_item_perplexity_passes_at_half_the_allowance_within_its_cap(shape: str) -> None:
    """Power per item at the log 100 cap: loss changes of each shape whose mean is half the allowance
    log 1.05, on lambada's 5,153 items. Over 1,000 orders every one decides by the test set's end
    (exact there) and at least 95 % pass: the fail bettor, whose null (degradation at or below the
    allowance) holds here, may fail such a model at most 5 % of the time (a loss carried by a few
    items at the cap sometimes is). The median items to a pass is printed: the wide cap's price."""
    delta = math.log1p(0.05)
    rng = np.random.default_rng([39, SHAPES.index(shape)])
    values = _population(shape, delta / 2, ITEM_CAP, LAMBADA, rng)
    paths = betting.wor_paths(_orders(values, 1000, rng), -ITEM_CAP, ITEM_CAP, delta, LAMBADA)
    to_pass, to_fail = _first(paths["log_wealth_pass"]), _first(paths["log_wealth_fail"])
    passed = float(np.mean(to_pass < to_fail))
    print(
        f"\nper item within log 100, {shape} at half the allowance: pass {passed}, median items to a pass {_median_to_pass(paths)}"
    )
    assert passed >= 1 - ALPHA and bool(np.all(np.minimum(to_pass, to_fail) <= LAMBADA))


def test_every_item_scored_decides_exactly() -> None:
    """Once every item is consumed the mean is known: one item's worth below the allowance passes on
    every order, one above fails on every order, exactly at it neither."""
    size = 200
    for lost, want in ((7, "pass"), (9, "fail"), (8, None)):  # allowance 8 / 200 = 0.04
        values = np.concatenate([np.ones(lost), np.zeros(size - lost)])
        paths = betting.wor_paths(_orders(values, 300, np.random.default_rng(14)), -1.0, 1.0, 0.04, size)
        end = {side: paths[f"log_wealth_{side}"][-1] == np.inf for side in ("pass", "fail")}
        assert [bool(end[s].all()) for s in ("pass", "fail")] == [want == "pass", want == "fail"]
        if want is None:
            assert not (end["pass"].any() or end["fail"].any())


def test_a_continued_call_is_the_single_call() -> None:
    values = _orders(_binary_population(300, 0.05, 0.04), 1, np.random.default_rng(15))[:, 0]
    whole = betting.wor_paths(values, -1.0, 1.0, 0.04, 300)
    first = betting.wor_paths(values[:120], -1.0, 1.0, 0.04, 300)
    state = (120, *(float(first[k][-1]) for k in ("sum_d", "sum_sq", "log_wealth_pass", "log_wealth_fail")))
    rest = betting.wor_paths(values[120:], -1.0, 1.0, 0.04, 300, start=state)
    for key in whole:
        np.testing.assert_allclose(whole[key][120:], rest[key], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="301 items taken without replacement from a population of 300"):
        betting.wor_paths(np.zeros(181), -1.0, 1.0, 0.04, 300, start=state)


def _median_to_pass(paths: dict) -> float:
    to_pass, to_fail = _first(paths["log_wealth_pass"]), _first(paths["log_wealth_fail"])
    return float(np.median(np.where(to_pass < to_fail, to_pass, NEVER)))


def test_without_replacement_needs_no_more_items_than_with_it() -> None:
    """0/1 items on GSM8K's 1,319, 5 % lost and 5 % gained, no true loss: items to a pass without
    replacement (the order --limit takes) against draws with replacement from the same test set. At
    allowance 4 points both meet the 600-item goal; at 2 points the draws need more than the test set
    holds (goal 2,400 draws) and without replacement every order passes by its last item."""
    rng = np.random.default_rng(16)
    g = round(0.05 * SIZE)
    values = np.concatenate([np.ones(g), -np.ones(g), np.zeros(SIZE - 2 * g)])
    medians = {}
    for allowance in (0.04, 0.02):
        wor = betting.wor_paths(_orders(values, PATHS, rng), -1.0, 1.0, allowance, SIZE)
        wr = betting.wealth_paths(values[rng.integers(SIZE, size=(3 * SIZE, PATHS))], -1.0, 1.0, allowance)
        medians[allowance] = (_median_to_pass(wor), _median_to_pass(wr))
        assert float(np.mean(_first(wor["log_wealth_pass"]) <= SIZE)) == 1.0  # exact at the end at the latest
    print(f"\nallowance: (median items to a pass without replacement, with) {medians}")
    assert medians[0.04][0] <= medians[0.04][1] <= 600
    assert medians[0.02][0] <= SIZE < medians[0.02][1]


def _gsm8k_words() -> np.ndarray:
    """GSM8K test answers' words, counted as lm-eval's word perplexity counts them (split on whitespace)."""
    import json

    rows = (DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()
    return np.array([len(re.split(r"\s+", json.loads(r)["answer"])) for r in rows], dtype=float)


def _gsm8k_bytes() -> np.ndarray:
    """GSM8K test answers' UTF-8 bytes, as lm-eval's byte perplexity and bits_per_byte count them."""
    import json

    rows = (DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()
    return np.array([len(json.loads(r)["answer"].encode("utf-8")) for r in rows], dtype=float)


def test_corpus_perplexity_in_a_uniform_order_pays_for_its_longest_document() -> None:
    """The design question for perplexity, on GSM8K's real answer lengths: per-word loss changes normal,
    sd = the allowance log 1.05, mean half of it, inside the log 2 cap. Size-biased draws with
    replacement (the module's perplexity test) bet on the per-word change; a uniform order without
    replacement must bet on each document's loss change minus the allowance's, over the mean length,
    whose range is the cap times the longest document over the mean. Printed: median items to a pass
    each way, and the distinct documents the draws touched (what the evals must score)."""
    rng = np.random.default_rng(17)
    words = _gsm8k_words()
    delta, cap = math.log1p(0.05), math.log(2)
    change = np.clip(delta / 2 + delta * rng.standard_normal(len(words)), -cap, cap)
    scale = words.mean()
    per_doc = (change - delta) * words / scale  # its population mean <= 0 iff the corpus ratio <= delta
    lo, hi = -(cap + delta) * words.max() / scale, (cap - delta) * words.max() / scale
    wor = betting.wor_paths(_orders(per_doc, 1000, rng), lo, hi, 0.0, len(words))
    index = rng.choice(len(words), size=(1500, 1000), p=words / words.sum())
    wr = betting.wealth_paths(change[index], -cap, cap, delta)
    wr_median = _median_to_pass(wr)
    touched = float(np.median([len(set(index[: int(wr_median), k])) for k in range(1000)]))
    print(
        f"\nGSM8K lengths (mean {scale:.1f}, longest {words.max():.0f} words): median items to a pass, "
        f"uniform order without replacement {_median_to_pass(wor)}, size-biased draws {wr_median} "
        f"touching {touched} documents"
    )
    assert _median_to_pass(wor) > touched  # the longest document's range costs more than repeats save


def _size_biased_orders(words: np.ndarray, paths: int, rng) -> np.ndarray:
    """`paths` size-biased orders without replacement (indices; one order per column): each next
    document with probability its words over the words not yet taken, by numpy's own exponentials
    (the race gate/order.weighted_order runs on hashes)."""
    return np.argsort(rng.exponential(size=(len(words), paths)) / words[:, None], axis=0)


WEIGHTED_SHAPES = (*SHAPES, "length-correlated")


def _per_word_population(shape: str, words: np.ndarray, delta: float, cap: float, rng) -> np.ndarray:
    """Per-word loss changes of one shape inside [-cap, cap] whose corpus (word-weighted) mean is
    exactly delta; the rare shapes' documents at the cap are picked at random."""
    if shape == "length-correlated":  # the longer the document, the more it loses per word
        r = delta * words * words.sum() / (words * words).sum()
    elif shape.startswith("rare-"):
        heavy = rng.permutation(len(words)) < round(float(shape[5:-1]) / 100 * len(words))
        rest = (delta * words.sum() - cap * words[heavy].sum()) / words[~heavy].sum()
        r = np.where(heavy, cap, rest)
    else:
        r = _population(shape, delta, cap, len(words), rng)
        r += delta - (words * r).sum() / words.sum()
    assert np.abs(r).max() <= cap and abs((words * r).sum() / words.sum() - delta) < 1e-12
    return r


def _size_biased_false_rates(weights: np.ndarray, delta: float, shape: str, seeds: tuple[int, int]) -> tuple[float, float]:
    """Over PATHS orders size-biased by `weights` (words or bytes), of per-unit loss changes of one shape
    inside the log 2 cap whose weighted mean is exactly delta: how often the pass bettor reaches 1/alpha
    at any item (the supremum Ville bounds, so every stopping rule's), and the fail bettor."""
    cap, index = math.log(2), WEIGHTED_SHAPES.index(shape)
    r = _per_word_population(shape, weights, delta, cap, np.random.default_rng([seeds[0], index]))
    order = _size_biased_orders(weights, PATHS, np.random.default_rng([seeds[1], index]))
    paths = betting.wor_paths(r[order], -cap, cap, delta, len(weights), None, weights[order], weights.sum())
    return float(np.mean(_first(paths["log_wealth_pass"]) < NEVER)), float(np.mean(_first(paths["log_wealth_fail"]) < NEVER))


@pytest.mark.parametrize("shape", WEIGHTED_SHAPES)
def test_size_biased_order_level_holds_for_corpus_perplexity_of_every_shape(shape: str) -> None:
    """Corpus perplexity on GSM8K's real answer lengths, in a size-biased order without replacement:
    per-word loss changes inside the log 2 cap whose corpus ratio is exactly the allowance log 1.05 --
    normal, skewed, heavy-tailed, carried by 1, 2 or 5 % of the documents, or growing with length.
    Over 2,000 orders neither bettor reaches 1/alpha at any item more often than the level (+3 SE)."""
    passes, fails = _size_biased_false_rates(_gsm8k_words(), math.log1p(0.05), shape, (24, 25))
    print(f"\nsize-biased order, {shape} at the allowance: false pass {passes}, false fail {fails}")
    assert passes <= LIMIT and fails <= LIMIT


# Median documents to a pass at half the allowance in a size-biased order, measured (seeded) below;
# two other seeds moved each by at most 5 documents (3 %), so each is asserted with 15 % over it.
WEIGHTED_MEDIANS = {
    "normal": 155,
    "lognormal-1": 154,
    "lognormal-2": 164,
    "pareto-2.1": 152,
    "rare-1%": 153,
    "rare-2%": 175,
    "rare-5%": 244,
    "length-correlated": 154,
}


@pytest.mark.parametrize("shape", WEIGHTED_SHAPES)
def test_size_biased_order_passes_a_model_at_half_the_allowance_for_every_shape(shape: str) -> None:
    """Power on every shape the size-biased order's level is shown on, on GSM8K's answer lengths:
    per-word loss changes inside the log 2 cap whose corpus ratio is half the allowance log 1.05.
    Over 1,000 orders none fails, every one passes by the test set's end (exact there), and the
    median documents to a pass stay within 15 % of the measured one."""
    words = _gsm8k_words()
    delta, cap = math.log1p(0.05), math.log(2)
    rng = np.random.default_rng([27, 0, WEIGHTED_SHAPES.index(shape)])
    r = _per_word_population(shape, words, delta / 2, cap, rng)
    order = _size_biased_orders(words, 1000, rng)
    paths = betting.wor_paths(r[order], -cap, cap, delta, len(words), None, words[order], words.sum())
    to_pass, to_fail = _first(paths["log_wealth_pass"]), _first(paths["log_wealth_fail"])
    median = _median_to_pass(paths)
    print(f"\nsize-biased order, {shape} at half the allowance: median documents to a pass {median}")
    assert float(np.mean(to_fail < to_pass)) == 0.0 and float(np.mean(to_pass <= len(words))) == 1.0
    assert median <= 1.15 * WEIGHTED_MEDIANS[shape]


# bits_per_byte's max_drop of 0.05 bits is a byte-perplexity rise of 2^0.05 - 1: delta = 0.05 log 2 nats per byte.
BYTE_DELTA = 0.05 * math.log(2)


@pytest.mark.parametrize("shape", WEIGHTED_SHAPES)
def test_size_biased_by_bytes_level_holds_for_bits_per_byte_of_every_shape(shape: str) -> None:
    """Byte perplexity and bits_per_byte bet the same way by bytes: on GSM8K's answer bytes, per-byte loss
    changes inside the log 2 cap whose byte-weighted mean is exactly the allowance of 0.05 bits per byte,
    in every shape above (length-correlated: by bytes). Over 2,000 orders size-biased by bytes neither
    bettor reaches 1/alpha at any item more often than the level (+3 SE)."""
    passes, fails = _size_biased_false_rates(_gsm8k_bytes(), BYTE_DELTA, shape, (34, 35))
    print(f"\nsize-biased by bytes, {shape} at 0.05 bits per byte: false pass {passes}, false fail {fails}")
    assert passes <= LIMIT and fails <= LIMIT


@pytest.mark.parametrize("shape", WEIGHTED_SHAPES)
def test_size_biased_by_bytes_passes_bits_per_byte_at_half_the_allowance_for_every_shape(shape: str) -> None:
    """Power by bytes on the same shapes: per-byte changes whose byte-weighted mean is half the 0.05 bits
    per byte allowance. Over 1,000 orders none fails and every one passes by the test set's end (exact
    there); the median documents to a pass is printed."""
    size, cap = _gsm8k_bytes(), math.log(2)
    rng = np.random.default_rng([36, WEIGHTED_SHAPES.index(shape)])
    r = _per_word_population(shape, size, BYTE_DELTA / 2, cap, rng)
    order = _size_biased_orders(size, 1000, rng)
    paths = betting.wor_paths(r[order], -cap, cap, BYTE_DELTA, len(size), None, size[order], size.sum())
    to_pass, to_fail = _first(paths["log_wealth_pass"]), _first(paths["log_wealth_fail"])
    print(f"\nsize-biased by bytes, {shape} at half of 0.05 bits per byte: median documents to a pass {_median_to_pass(paths)}")
    assert float(np.mean(to_fail < to_pass)) == 0.0 and float(np.mean(to_pass <= len(size))) == 1.0


def test_size_biased_order_decides_corpus_perplexity_with_fewer_documents_than_draws() -> None:
    """The issue's goals for per-document losses at the default cap, a model at half the allowance
    log 1.05: normal per-word changes with sd the allowance (goal 150 items) and centred lognormal
    sigma 1 (goal 250), on GSM8K's answer lengths. Median documents to a pass in a size-biased order
    without replacement (1,000 orders) against size-biased draws with replacement: never more. The
    normal case misses its goal (about 164; 200 keeps it from growing unseen): the truncation at the
    cap (0.5 / (log 2 - delta)), not the Kelly bet, sets its bets, so a smaller declared cap is what
    would buy items."""
    rng = np.random.default_rng(26)
    words = _gsm8k_words()
    delta, cap = math.log1p(0.05), math.log(2)
    shapes = {
        "normal": np.clip(delta / 2 + delta * rng.standard_normal(len(words)), -cap, cap),
        "lognormal-1": np.clip(delta / 2 * rng.lognormal(0.0, 1.0, len(words)) / math.exp(0.5), -cap, cap),
    }
    medians = {}
    for shape, r in shapes.items():
        order = _size_biased_orders(words, 1000, rng)
        wor = betting.wor_paths(r[order], -cap, cap, delta, len(words), None, words[order], words.sum())
        drawn = betting.wealth_paths(r[rng.choice(len(words), size=(1500, 1000), p=words / words.sum())], -cap, cap, delta)
        medians[shape] = (_median_to_pass(wor), _median_to_pass(drawn))
    print(f"\nmedian documents to a pass (size-biased order without replacement, draws with it): {medians}")
    assert all(wor <= drawn for wor, drawn in medians.values())
    assert medians["lognormal-1"][0] <= 250 and medians["normal"][0] <= 200


def test_a_size_biased_order_is_the_exponential_race_and_decide_takes_it() -> None:
    """gate/order.weighted_order: the first document is taken with probability its words over all
    (the race's law, checked over 4,000 tasks' hashes: within 4 SE), it continues as item_order does,
    and `decide` bets on a perplexity in it exactly as `wor_paths` does, a continued call being one."""
    from qserve.gate.order import weighted_order

    weights = {0: 1.0, 1: 3.0, 2: 6.0}
    firsts = np.bincount([weighted_order(f"task{k}", weights)[0] for k in range(4000)], minlength=3) / 4000
    assert np.all(np.abs(firsts - np.array([0.1, 0.3, 0.6])) <= 4 * np.sqrt(0.6 * 0.4 / 4000))
    words = {i: float(w) for i, w in enumerate(_gsm8k_words()[:400])}
    order = weighted_order("gsm8k_ppl", words)
    rng = np.random.default_rng(27)
    r = {i: 0.02 + 0.05 * rng.standard_normal() for i in words}
    base = {i: [-3.0 * words[i], words[i]] for i in words}
    quant = {i: [-3.0 * words[i] - r[i] * words[i], words[i]] for i in words}
    spec, population = Spec("perplexity", 0.05), Population.in_order(order, words)
    whole = betting.decide(base, quant, spec, population)
    w, d = np.array([words[i] for i in order]), np.array([r[i] for i in order])
    paths = betting.wor_paths(d, -math.log(2), math.log(2), math.log1p(0.05), len(order), None, w, w.sum())
    assert (whole.decision, whole.items) == ("pass", int(_first(paths["log_wealth_pass"])))
    early = betting.decide(base, {i: quant[i] for i in order[:60]}, spec, population)
    later = betting.decide(base, quant, spec, population, Evidence.from_json(early.evidence.to_json()))
    assert (early.items, later.items) == (60, whole.items)
    assert later.wealth_pass == pytest.approx(whole.wealth_pass, rel=1e-9)


def _by_hand(
    d: list[float], lo: float, hi: float, delta: float, size: int, w: list[float] | None = None, total: float = 0.0
) -> tuple[float, float]:
    """The docstring's bettors, one item at a time in plain Python: the log-wealths after the items
    (weighted by `w` out of `total` when given)."""
    s = sq = log_pass = log_fail = taken = weighted = 0.0
    for t, x in enumerate(d):  # t items consumed before x
        mean, var = ((lo + hi) / 2 + s) / (t + 1), (((hi - lo) / 2) ** 2 + sq) / (t + 1)
        m = (size * delta - s) / (size - t) if w is None else (total * delta - weighted) / (total - taken)
        if w is not None:
            taken, weighted = taken + w[t], weighted + w[t] * x
        gap = m - mean
        kelly = gap / (var + gap * gap)
        log_pass += math.log1p(min(max(kelly, 0.0), 0.5 / (hi - m)) * (m - x))
        log_fail += math.log1p(min(max(-kelly, 0.0), 0.5 / (m - lo)) * (x - m))
        s += x
        sq += (x - (((lo + hi) / 2 + s) / (t + 2))) ** 2
    return log_pass, log_fail


def test_the_bettors_are_the_docstrings_formulas() -> None:
    rng = np.random.default_rng(18)
    d = list(np.clip(0.01 + 0.05 * rng.standard_normal(60), -0.3, 0.3))
    paths = betting.wor_paths(d, -0.3, 0.3, 0.04, 500)
    assert (paths["log_wealth_pass"][-1], paths["log_wealth_fail"][-1]) == pytest.approx(
        _by_hand(d, -0.3, 0.3, 0.04, 500), rel=1e-9
    )
    w = list(rng.integers(5, 170, size=60).astype(float))
    paths = betting.wor_paths(d, -0.3, 0.3, 0.04, 500, None, w, 26000.0)
    assert (paths["log_wealth_pass"][-1], paths["log_wealth_fail"][-1]) == pytest.approx(
        _by_hand(d, -0.3, 0.3, 0.04, 500, w, 26000.0), rel=1e-9
    )


def _scored(order: list[int], lost: set[int], gained: set[int]) -> tuple[dict, dict]:
    base = {i: 1.0 if i in lost else 0.0 for i in order}
    quant = {i: 1.0 if i in gained else 0.0 for i in order}
    return base, quant


def test_decide_in_order_takes_the_order_and_continues_it() -> None:
    """`decide` on a population in order: the items in that order while both models scored them, the
    same decision and items as the bettors on that sequence, and continued evidence is one call."""
    rng = np.random.default_rng(19)
    order = [int(i) for i in rng.permutation(1319)]
    lost, gained = set(order[5::20]), set(order[7::20])  # 5 % each way, no true loss
    base, quant = _scored(order, lost, gained)
    spec, population = Spec("binary", 0.04), Population.in_order(order)
    whole = betting.decide(base, quant, spec, population)
    d = np.array([base[i] - quant[i] for i in order])
    paths = betting.wor_paths(d, -1.0, 1.0, 0.04, len(order))
    assert (whole.decision, whole.items) == ("pass", int(_first(paths["log_wealth_pass"])))
    assert whole.reason.endswith(f"after {whole.items} items: degradation < allowance")
    # The first 150 scored (a --limit), then the rest: the evidence carried is the one call's.
    first = {i: base[i] for i in order[:150]}, {i: quant[i] for i in order[:150]}
    early = betting.decide(*first, spec, population)
    assert (early.decision, early.items) == ("inconclusive", 150)
    later = betting.decide(base, quant, spec, population, Evidence.from_json(early.evidence.to_json()))
    assert (later.decision, later.items, later.new_items) == (whole.decision, whole.items, whole.items - 150)
    assert later.wealth_pass == pytest.approx(whole.wealth_pass, rel=1e-9)
    # A document out of order (not yet reached) adds nothing; an item skipped stops the bet before it.
    gap = {i: base[i] for i in order[:100] + order[101:200]}, {i: quant[i] for i in order[:100] + order[101:200]}
    assert betting.decide(*gap, spec, population).items == 100


def test_every_item_scored_decides_with_its_reason() -> None:
    order = list(range(200))
    base, quant = _scored(order, set(range(7)), set())  # 7 / 200 = 3.5 points lost, allowance 4
    got = betting.decide(base, quant, Spec("binary", 0.04), Population.in_order(order))
    assert got.decision == "pass" and got.items <= 200
    assert got.reason.startswith(f"after {got.items} of the 200 items the rest cannot bring the mean degradation up to")


def test_an_order_is_for_binary_and_mean_specs_and_its_own_evidence() -> None:
    order = list(range(50))
    population = Population.in_order(order)
    base, quant = _scored(order, set(), set())
    taken = "a population in order is taken as it is"
    with pytest.raises(ValueError, match=taken):
        betting.decide(base, quant, Spec("perplexity", 0.05), population)
    with pytest.raises(ValueError, match=taken):
        betting.decide(base, quant, Spec("binary", 0.04), population, order_seed=3)
    weighted = Population.in_order(order, {i: 10.0 for i in order})
    with pytest.raises(ValueError, match=taken):
        betting.decide(base, quant, Spec("perplexity", 0.05), Population.in_order(order))
    assert betting.decide(base, quant, Spec("binary", 0.04), weighted).decision == "pass"  # a group's mean of means
    drawn = betting.decide(base, quant, Spec("binary", 0.04), Population(order), limit=10).evidence
    with pytest.raises(ValueError, match="another population"):
        betting.decide(base, quant, Spec("binary", 0.04), population, drawn)
    with pytest.raises(ValueError, match="an order names each document once"):
        Population.in_order([1, 2, 2])
    with pytest.raises(ValueError, match="a weighted one every weighted document"):
        Population.in_order([1, 2], {1: 3.0, 2: 4.0, 3: 5.0})


def test_items_to_pass_in_order_is_where_decide_passes_4_runs_in_5() -> None:
    """The inconclusive gate's "about N items would pass 4 times in 5": 200 items seen (5 % lost, 4 %
    gained) against a 3-point max_drop on a 1,319-item set. Fresh runs (another seed) fill the other
    items from those seen, as the estimate assumes, and `decide` bets on them up to N: about 80 % pass.
    The estimate is an 80th percentile of 400 runs (rank +-2 % of runs) and this share has SE 0.023
    over 300 runs: 0.09 allows about 3 SE of both."""
    seen = [float(x) for x in np.random.default_rng(5).permutation([1.0] * 10 + [-1.0] * 8 + [0.0] * 182)]
    spec = Spec("binary", 0.03)
    alone = betting.decide(
        *_scored(list(range(200)), {i for i, x in enumerate(seen) if x == 1}, {i for i, x in enumerate(seen) if x == -1}),
        spec,
        Population.in_order(list(range(SIZE))),
    )
    assert (alone.decision, alone.items) == ("inconclusive", 200)
    n = int(betting.items_to_pass_in_order(seen, spec, SIZE))
    assert 200 < n <= SIZE
    rng, runs, passed = np.random.default_rng(23), 300, 0
    for _ in range(runs):
        d = seen + list(rng.choice(seen, size=SIZE - len(seen)))
        base, quant = _scored(list(range(SIZE)), {i for i, x in enumerate(d) if x == 1}, {i for i, x in enumerate(d) if x == -1})
        got = betting.decide(base, quant, spec, Population.in_order(list(range(SIZE))), limit=n)
        passed += got.decision == "pass"
    print(f"\n{n} items: {passed / runs:.1%} of {runs} fresh runs pass")
    assert abs(passed / runs - 0.8) <= 0.09


# An lm-eval group whose score is the mean of its tasks' means (weight_by_size false): tasks of mmlu-like
# sizes, 5 % of every task's items flipping each way, and the smallest task losing `extra` of its items more.
GROUP_SIZES = np.array([100, 200, 400, 1000])


def _group(extra: int) -> tuple[np.ndarray, np.ndarray]:
    """Each item's 0/1 difference and its weight 1 / its task's size, tasks one after the other."""
    d, w = [], []
    for k, n in enumerate(GROUP_SIZES):
        flips = n // 20
        lost = flips + (extra if k == 0 else 0)
        d += [1.0] * lost + [-1.0] * flips + [0.0] * (n - lost - flips)
        w += [1.0 / n] * n
    return np.array(d), np.array(w)


def _group_first_passes(extra: int, weighted: bool, seed: int) -> np.ndarray:
    """Over PATHS orders of the group's items (size-biased by 1 / task size, or uniform), the item at which
    the pass bettor first reaches 1/alpha (NEVER if it does not), the fail bettor not first."""
    d, w = _group(extra)
    rng = np.random.default_rng([seed, extra, weighted])
    keys = rng.exponential(size=(len(d), PATHS)) / (w[:, None] if weighted else 1.0)
    order = np.argsort(keys, axis=0)
    args = (None, w[order], float(w.sum())) if weighted else ()
    paths = betting.wor_paths(d[order], -1.0, 1.0, 0.04, len(d), *args)
    passed, failed = _first(paths["log_wealth_pass"]), _first(paths["log_wealth_fail"])
    return np.where(passed < failed, passed, NEVER)


def test_a_group_of_tasks_alike_is_bet_on_the_mean_of_their_means() -> None:
    """The smallest of 4 tasks (100, 200, 400, 1,000 items) loses 16 % of its items net, the rest nothing:
    the mean of the tasks' means is exactly the allowance of 4 points (16 / 4), while the items pooled lose
    0.94 points. In the order size-biased by 1 / task size (gate/order.pooled_order) the pass bettor's level
    holds at any item; a uniform order, as the gate took a group's items before, bets on the pooled mean
    and passes this group nearly always. At half the allowance (8 % in the smallest task) the weighted bet
    passes by the group's end."""
    d, w = _group(16)
    assert (w * d).sum() / w.sum() == pytest.approx(0.04, abs=1e-15) and d.mean() == pytest.approx(16 / 1700)
    level = float(np.mean(_group_first_passes(16, True, 1) < NEVER))
    pooled = float(np.mean(_group_first_passes(16, False, 1) < NEVER))
    half = _group_first_passes(8, True, 2)
    power, median = float(np.mean(half < NEVER)), float(np.median(half))
    print(f"\ngroup of tasks alike: false pass {level:.2%} (uniform order {pooled:.2%}), at half: {power:.1%}, median {median}")
    assert level <= LIMIT and pooled >= 0.9
    assert power >= 0.9 and median < len(d)


def test_decide_takes_a_group_in_its_pooled_order_and_decides_its_mean_of_means_exactly() -> None:
    """Every item of the group scored: decide on the population gate/evidence.pooled builds is certain
    at the end, and on the mean of means, where the uniform order would pass the pooled items."""
    from qserve.gate.evidence import pooled

    sizes = {"small": 100, "large": 1000}
    base = {f"small/{i}": 1.0 if i < 12 else 0.0 for i in range(100)} | {f"large/{i}": 0.0 for i in range(1000)}
    quant = dict.fromkeys(base, 0.0)  # 12 % lost in the small task, none in the large: mean of means 6 %, pooled 1.1 %
    spec = Spec("binary", 0.04)
    alike, by_size = pooled("g", sorted(base), sizes, by_size=False), pooled("g", sorted(base), sizes)
    assert (alike.whole, alike.free, by_size.whole, by_size.free) == (True, True, True, True)
    assert betting.decide(base, quant, spec, alike.population).decision == "fail"
    assert betting.decide(base, quant, spec, by_size.population).decision == "pass"
    first = sorted(by_size.population.order[:50])
    partial = pooled("g", first, sizes)
    assert (partial.whole, partial.free, partial.size) == (True, True, 1100)
    other = pooled("g", sorted(base)[:50], sizes)  # not a prefix of the order: the scored items alone
    assert (other.whole, other.free, other.size) == (False, False, 50)


# Lower-is-better 0/1 scores (crows_pairs' pct_stereotype: 1 when the model prefers the stereotyped
# sentence; crows_pairs_english holds 1,677 pairs). max_increase a bets on q_i - (1 + a) b_i against 0
# within [-(1 + a), 1] (gate/evidence.py): computed here from the pairs, not through qserve.
CROWS = 1677


def _stereotype_pairs(base_ones: int, gained: int, lost: int) -> tuple[np.ndarray, np.ndarray]:
    """Baseline and quantized 0/1 scores: `base_ones` stereotyped on the baseline, of which `gained` are
    not on the quantized model (it improved there), and `lost` of the others newly stereotyped."""
    b = np.zeros(CROWS)
    b[:base_ones] = 1.0
    q = b.copy()
    q[:gained] = 0.0
    q[base_ones : base_ones + lost] = 1.0
    return b, q


@pytest.mark.parametrize("allowance", [0.02, 0.05, 0.10])
@pytest.mark.parametrize("gained", [0, 50, 200])
def test_lower_is_better_max_increase_level_holds_at_the_allowance(allowance: float, gained: int) -> None:
    """A stereotype rate that rises by exactly the allowed share (1,000 of 1,677 on the baseline, 1,000 (1 + a)
    on the quantized model, `gained` pairs flipping each way beyond it): over 2,000 orders neither bettor
    reaches 1/alpha at any item more often than the level (+3 SE)."""
    lost = gained + round(1000 * allowance)
    b, q = _stereotype_pairs(1000, gained, lost)
    assert q.sum() == (1 + allowance) * b.sum()
    d = q - (1 + allowance) * b
    passes, fails = _false_rates(d, -(1 + allowance), 1.0, 0.0, [41, round(allowance * 100), gained])
    print(f"\nlower is better, max_increase {allowance}, {gained} gained: false pass {passes}, false fail {fails}")
    assert passes <= LIMIT and fails <= LIMIT


# Median items to a pass of an unchanged stereotype rate (60 %) at max_increase 0.05 with 5 % of the pairs
# flipping each way, measured (seeded) below; seeds 44 and 45 gave 578 and 559.5 (3 % apart), so it is
# asserted with 15 % over it.
UNCHANGED_MEDIAN = 562


def test_lower_is_better_passes_an_unchanged_rate_by_the_end() -> None:
    """Power: the quantized model as stereotyped as the baseline (1,006 of 1,677 each), 84 pairs flipping
    each way. Over 1,000 orders at max_increase 0.05 none fails and every one passes by the test set's
    end (exact there); the median items to a pass stays within 15 % of the measured one."""
    b, q = _stereotype_pairs(1006, 84, 84)
    assert q.sum() == b.sum()
    d = q - 1.05 * b
    paths = betting.wor_paths(_orders(d, 1000, np.random.default_rng(43)), -1.05, 1.0, 0.0, CROWS)
    to_pass, to_fail = _first(paths["log_wealth_pass"]), _first(paths["log_wealth_fail"])
    median = _median_to_pass(paths)
    print(f"\nlower is better, unchanged rate at max_increase 0.05: median items to a pass {median}")
    assert float(np.mean(to_fail < to_pass)) == 0.0 and float(np.mean(to_pass <= CROWS)) == 1.0
    assert median <= 1.15 * UNCHANGED_MEDIAN


# A score in a declared score_range (truthfulqa_gen's bleu_max in [0, 100], 817 questions): max_drop 2 points
# bets on b_i - q_i in [-100, 100] (gate/evidence.py; tests/test_gate_evidence.py shows it is the [0, 1] bet
# scaled). Level and power here in those units, computed from the differences, not through qserve's mapping.
TRUTHFUL, BLEU_DROP = 817, 2.0


@pytest.mark.parametrize("shape", SHAPES)
def test_a_declared_score_range_keeps_the_level_for_every_shape(shape: str) -> None:
    """BLEU drops with mean exactly 2 points: normal, skewed, heavy-tailed, and carried by 1, 2 or 5 % of the
    answers at the range's end; over 2,000 orders neither bettor reaches 1/alpha at any item more often than
    the level (+3 SE)."""
    values = _population(shape, BLEU_DROP, 100.0, TRUTHFUL, np.random.default_rng([71, SHAPES.index(shape)]))
    passes, fails = _false_rates(values, -100.0, 100.0, BLEU_DROP, [72, SHAPES.index(shape)])
    print(f"\nscore_range [0, 100], {shape} at max_drop 2: false pass {passes}, false fail {fails}")
    assert passes <= LIMIT and fails <= LIMIT


# Median answers to a pass with no true loss and per-answer BLEU changes of sd 15 points at max_drop 2, measured
# (seeded) below: seeds 61, 62 and 63 gave 321, 317.5 and 323 (2 % apart), asserted with 15 % over it.
BLEU_MEDIAN = 320


def test_a_declared_score_range_passes_an_unchanged_model_well_before_the_end() -> None:
    """Power: BLEU changes per answer of sd 15 points (clipped to the range) with mean 0, max_drop 2. Over
    1,000 orders none fails, every one passes by the end, and the median stays within 15 % of the measured."""
    rng = np.random.default_rng(61)
    d = np.clip(rng.normal(0.0, 15.0, TRUTHFUL), -95.0, 95.0)
    d -= d.mean()
    paths = betting.wor_paths(_orders(d, 1000, np.random.default_rng(71)), -100.0, 100.0, BLEU_DROP, TRUTHFUL)
    to_pass, to_fail = _first(paths["log_wealth_pass"]), _first(paths["log_wealth_fail"])
    median = _median_to_pass(paths)
    print(f"\nscore_range [0, 100], unchanged at max_drop 2: median answers to a pass {median}")
    assert float(np.mean(to_fail < to_pass)) == 0.0 and float(np.mean(to_pass <= TRUTHFUL)) == 1.0
    assert median <= 1.15 * BLEU_MEDIAN
