"""Every gate decision on a checkpoint's weights is a look; each look spends part of the 5 %.

Re-running an inconclusive gate with a larger --limit until it passes would pass a model at the
allowance far more often than 5 %: every run is another chance. So the k-th look at the same
weights is decided at one-sided level ALPHA * 6 / (pi^2 k^2) (3.04 %, 0.76 %, 0.34 %, ...), an
alpha-spending sequence whose sum is ALPHA: over any number of looks, a model at the allowance is
passed at most 5 % of the time (Bonferroni over the looks, which needs no independence between them).

A look is new evidence, not a new run: a gate run on the same items as an earlier one (the same
tasks, --limit, offset and item order) is that look again, decided at its level, so it gives the same decision
and spends nothing; a run on more items is one new look on everything it scores.

The history travels with the checkpoint: each eval record holds every look so far, each entry
naming the digest of the one before it, so a deleted or reordered entry shows. An eval merges that
history with the cache's ledger (a new cache or another machine starts from the record, not from
look 1), and `qserve gate --looks-from RECORD` continues a history the user keeps.

The ledger lives in qserve's cache, keyed by the hashes of the checkpoint's files (not its folder
or its manifest's timestamps), so a re-quantized copy with the same bytes counts the same looks.
A reused eval record is no new look; `qserve tune`'s search evals are not gate decisions (their
records are refused by serve) and are not counted.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from qserve import paths
from qserve.checkpoint.manifest import Manifest
from qserve.errors import QserveError
from qserve.gate.spending import ALPHA, level  # noqa: F401  (re-exported: the sequence this module applies)


def weights_key(manifest: Manifest) -> str:
    return hashlib.sha256(json.dumps(sorted(manifest.files.items())).encode()).hexdigest()


def ledgers() -> Path:
    """The folder of every weights' ledger in qserve's cache."""
    return paths.cache_dir() / "looks"


def ledger(manifest: Manifest) -> Path:
    return ledgers() / f"{weights_key(manifest)}.jsonl"


def earlier(manifest: Manifest, history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The looks already taken at these weights, oldest first: the cache's ledger merged with a
    record's `history` (checked link by link)."""
    path = ledger(manifest)
    cached = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return merge(cached, checked(history or []))


def digest(look: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(look, sort_keys=True).encode()).hexdigest()[:16]


def checked(history: list[dict[str, Any]], where: str = "the eval record") -> list[dict[str, Any]]:
    """A history whose every entry names the digest of the one before it; else one error line."""
    for k, look in enumerate(history):
        before = digest(history[k - 1]) if k else None
        if look.get("previous") != before:
            raise QserveError(
                f"the look history in {where} was edited: look {k + 1} does not follow the one before it "
                "(an entry was removed, reordered or changed); the gate cannot count the looks at these weights"
            )
    return history


def merge(*histories: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every look of either history once (by evidence and time), oldest first."""
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for look in (x for h in histories for x in h):
        seen.setdefault((evidence(look), str(look.get("decided_at"))), look)
    return sorted(seen.values(), key=lambda x: str(x.get("decided_at")))


def chained(history: list[dict[str, Any]], *new: dict[str, Any]) -> list[dict[str, Any]]:
    """`history` relinked in its order, with `new` looks appended: the history a record carries."""
    out: list[dict[str, Any]] = []
    for entry in [*history, *new]:
        out.append(entry | {"previous": digest(out[-1]) if out else None})
    return out


def record(manifest: Manifest, look: dict[str, Any]) -> None:
    """Append one look to the cache's ledger (a line, so concurrent evals never lose one)."""
    path = ledger(manifest)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(look, sort_keys=True) + "\n")


def evidence(look: dict[str, Any]) -> str:
    """What a look scored: its tasks, limit, offset and item order (the same items give the same scores;
    a look from before the seeded order, which has none, scored the first items in file order)."""
    return json.dumps([sorted(look.get("tasks") or []), look.get("limit"), look.get("offset") or 0, look.get("order")])


def number(earlier: list[dict[str, Any]], scored: dict[str, Any]) -> tuple[int, bool]:
    """(which look `scored` is, whether it is new): the same items as an earlier look are that look."""
    seen = list(dict.fromkeys(evidence(e) for e in earlier))
    key = evidence(scored)
    return (seen.index(key) + 1, False) if key in seen else (len(seen) + 1, True)
