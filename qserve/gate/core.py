"""The one decision: every gate of a run from two models' lm-eval outputs. `qserve eval` (its engines'
results) and `qserve gate` (lm-eval runs made elsewhere) both decide through `decide_gates`, so the
same outputs get the same decision whichever command reads them."""

from __future__ import annotations

from typing import Protocol

from qserve.errors import QserveError
from qserve.gate import stats
from qserve.gate.decisions import Gate, decide
from qserve.gate.policy import GateSpec, check_allowance
from qserve.gate.stats import ItemValues


class Scores(Protocol):
    """One model's lm-eval output as the gate reads it."""

    def higher_is_better(self, task: str, metric: str) -> bool:
        """lm-eval's own higher_is_better for the metric."""
        ...

    def score(self, task: str, metric: str) -> tuple[float, float | None, ItemValues | None]:
        """The stated score, its stderr if lm-eval gave one, and the per-item values."""
        ...

    def check_items_add_up(self, task: str, metric: str, scored: tuple[float, float | None, ItemValues | None]) -> None:
        """Refuse items that do not give the stated score (another run's, or edited)."""
        ...


def higher_is_better(raw: dict, task: str, metric: str, source: str) -> bool:
    """Which way a metric is better, as lm-eval's results state it (their `higher_is_better`)."""
    value = (raw.get("higher_is_better") or {}).get(task, {}).get(metric.partition(",")[0])
    if not isinstance(value, bool):
        raise QserveError(f"{source} does not say whether higher {metric} is better for {task} (lm-eval's higher_is_better)")
    return value


def decide_gates(
    specs: dict[str, list[GateSpec]], headlines: dict[str, str], base: Scores, quant: Scores, level: float
) -> list[Gate]:
    """Each task's gates (a spec without a metric gates the task's headline metric) at one-sided `level`."""
    decided = []
    for task, task_specs in specs.items():
        for spec in task_specs:
            metric = spec.metric or headlines[task]
            check_allowance(task, spec, metric)
            b, q = base.score(task, metric), quant.score(task, metric)
            if b[2] is not None and q[2] is not None and set(b[2]) != set(q[2]):
                raise QserveError(
                    f"{task}: the runs scored different items ({len(b[2])} in the baseline, {len(q[2])} quantized, "
                    f"{len(set(b[2]) & set(q[2]))} in common); run both with the same --limit and data"
                )
            base.check_items_add_up(task, metric, b)
            quant.check_items_add_up(task, metric, q)
            cmp = stats.compare(metric, base.higher_is_better(task, metric), b, q, level)
            decided.append(decide(task, spec, cmp, headline=metric == headlines[task]))
    return decided
