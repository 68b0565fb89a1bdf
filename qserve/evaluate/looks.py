"""Every gate decision on a checkpoint's weights is a look; each look spends part of the 5 %.

Re-running an inconclusive gate with a larger --limit until it passes would pass a model at the
allowance far more often than 5 %: every run is another chance. So the k-th look at the same
weights is decided at one-sided level ALPHA * 6 / (pi^2 k^2) (3.04 %, 0.76 %, 0.34 %, ...), an
alpha-spending sequence whose sum is ALPHA: over any number of looks, a model at the allowance is
passed at most 5 % of the time (Bonferroni over the looks, which needs no independence between them).

A look is new evidence, not a new run: a gate run on the same items as an earlier one (the same
tasks, --limit and offset) is that look again, decided at its level, so it gives the same decision
and spends nothing; a run on more items is one new look on everything it scores.

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
from qserve.checkpoint.spending import ALPHA, level  # noqa: F401  (re-exported: the sequence this module applies)


def weights_key(manifest: Manifest) -> str:
    return hashlib.sha256(json.dumps(sorted(manifest.files.items())).encode()).hexdigest()


def ledgers() -> Path:
    """The folder of every weights' ledger in qserve's cache."""
    return paths.cache_dir() / "looks"


def ledger(manifest: Manifest) -> Path:
    return ledgers() / f"{weights_key(manifest)}.jsonl"


def earlier(manifest: Manifest) -> list[dict[str, Any]]:
    """The looks already taken at these weights, oldest first."""
    path = ledger(manifest)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def record(manifest: Manifest, look: dict[str, Any]) -> None:
    """Append one look (a line, so concurrent evals never lose one)."""
    path = ledger(manifest)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(look, sort_keys=True) + "\n")


def evidence(look: dict[str, Any]) -> str:
    """What a look scored: its tasks, limit and offset (the same items give the same scores)."""
    return json.dumps([sorted(look.get("tasks") or []), look.get("limit"), look.get("offset") or 0])


def number(earlier: list[dict[str, Any]], scored: dict[str, Any]) -> tuple[int, bool]:
    """(which look `scored` is, whether it is new): the same items as an earlier look are that look."""
    seen = list(dict.fromkeys(evidence(e) for e in earlier))
    key = evidence(scored)
    return (seen.index(key) + 1, False) if key in seen else (len(seen) + 1, True)
