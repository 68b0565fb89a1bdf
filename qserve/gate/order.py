"""The order items are taken in: --limit scores the first N of it, and the gate's betting takes the
scored items in it without replacement (betting.Population.in_order). Fixed before any score by a
hash, so a larger --limit continues a smaller one and every run of the same task agrees on it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

ORDER_SEED = 0
# How --limit picks items, recorded with every limited eval: a change of rule is a change of items.
ORDER = f"sha256({ORDER_SEED}, task, doc id)"


def item_order(task: str, size: int, seed: int = ORDER_SEED) -> list[int]:
    """lm-eval's doc ids of `task` (0 .. size-1) in qserve's fixed random order: sorted by a hash of
    (seed, task, id). The first N are a simple random sample of the task's documents, whatever order
    its file keeps them in (by source, length or difficulty), and a larger N continues a smaller one."""
    return in_seeded_order(task, range(size), seed)


def in_seeded_order(task: str, ids: Iterable[Any], seed: int = ORDER_SEED) -> list[Any]:
    """`ids` (doc ids, or a group's `member/doc id` keys) sorted by the hash `item_order` sorts by."""
    return sorted(ids, key=lambda i: hashlib.sha256(f"{seed}\0{task}\0{i}".encode()).digest())
