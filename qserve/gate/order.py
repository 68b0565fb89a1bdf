"""The order items are taken in: --limit scores the first N of it, and the gate's betting takes the
scored items in it without replacement (betting.Population.in_order). Fixed before any score by a
hash, so a larger --limit continues a smaller one and every run of the same task agrees on it.
Uniformly random (`item_order`), except on tasks that report word perplexity, whose documents come
size-biased by their words (`weighted_order`: betting.py says why). An lm-eval group gated as one takes
its tasks' items in one order of the group (`pooled_order`), so --limit N is N items of the group."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

ORDER_SEED = 0
# How --limit picks items, recorded with every limited eval: a change of rule is a change of items.
ORDER = f"sha256({ORDER_SEED}, task, doc id), size-biased by lm-eval's word counts on word-perplexity tasks"
# A group's --limit takes a prefix of its pooled order instead: recorded beside ORDER where groups are gated.
GROUPS = (
    "a group's items (task/doc id) pooled: uniform, or size-biased by 1/its task's documents where lm-eval weighs its tasks alike"
)
WORDS = "word_perplexity"  # the metric whose per-document counts size-bias a task's order


def item_order(task: str, size: int, seed: int = ORDER_SEED) -> list[int]:
    """lm-eval's doc ids of `task` (0 .. size-1) in qserve's fixed random order: sorted by a hash of
    (seed, task, id). The first N are a simple random sample of the task's documents, whatever order
    its file keeps them in (by source, length or difficulty), and a larger N continues a smaller one."""
    return in_seeded_order(task, range(size), seed)


def in_seeded_order(task: str, ids: Iterable[Any], seed: int = ORDER_SEED) -> list[Any]:
    """`ids` (doc ids, or a group's `member/doc id` keys) sorted by the hash `item_order` sorts by."""
    return sorted(ids, key=lambda i: hashlib.sha256(f"{seed}\0{task}\0{i}".encode()).digest())


def weighted_order(task: str, weights: Mapping[Any, float], seed: int = ORDER_SEED) -> list[Any]:
    """The documents in a size-biased random order without replacement: each next one taken with
    probability its weight over the weights not yet taken (for corpus perplexity, its words). An
    exponential race (Efraimidis and Spirakis, "Weighted random sampling with a reservoir", 2006):
    document j finishes at E_j / w_j, E_j exponential from the hash as in `item_order`, and the order
    is by finishing time; the first N continue to the first N + 1 as there."""

    def finish(i: Any) -> float:
        u = (int.from_bytes(hashlib.sha256(f"{seed}\0{task}\0{i}".encode()).digest()[:8], "big") + 0.5) / 2**64
        return -math.log(u) / weights[i]

    return sorted(weights, key=finish)


def pooled_weights(sizes: Mapping[str, int]) -> dict[str, float]:
    """A group's items `member/doc id`, each weighted 1 / its member's documents: every member weighs 1."""
    return {f"{m}/{i}": 1.0 / n for m, n in sizes.items() for i in range(n)}


def pooled_order(group: str, sizes: Mapping[str, int], by_size: bool = True, seed: int = ORDER_SEED) -> list[str]:
    """A group's items (`member/doc id`, from each member's documents `sizes`) in the group's seeded
    order. `by_size` (lm-eval's weight_by_size: the group's score is the mean over all its items):
    uniformly random, so a prefix is a simple random sample of the group. Otherwise the score is the
    mean of its members' means, which weighs each item 1 / its member's size: the order is size-biased
    by those weights (`weighted_order`), so a bet on it is on that mean (betting.wor_paths)."""
    weights = pooled_weights(sizes)
    return in_seeded_order(group, weights, seed) if by_size else weighted_order(group, weights, seed)


def split_pooled(keys: Iterable[str]) -> dict[str, list[int]]:
    """A group's `member/doc id` keys by member (doc ids as ints, in the keys' order)."""
    out: dict[str, list[int]] = {}
    for key in keys:
        member, _, doc = key.rpartition("/")
        out.setdefault(member, []).append(int(doc))
    return out


# --until-decided's first round: a pass by betting needs more than 70 documents at perplexity's default
# cap and a few hundred items on 0/1 tasks, so fewer would rarely decide.
FIRST_ROUND = 100


def rounds(first: int, ceiling: int | None) -> Iterator[int]:
    """--until-decided's --limit per round: `first`, doubling, the last at the ceiling when one is given."""
    n = first if ceiling is None else min(first, ceiling)
    while True:
        yield n
        if ceiling is not None and n >= ceiling:
            return
        n = 2 * n if ceiling is None else min(2 * n, ceiling)
