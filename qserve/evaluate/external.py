"""`qserve gate`: the same paired gate on two lm-eval runs made elsewhere (`--log_samples` outputs).

lm-eval writes `results_<date>.json` and one `samples_<task>_<date>.jsonl` per task under its
--output_path. The baseline and the quantized run must have scored the same items; the metric's
direction comes from lm-eval's own `higher_is_better` in the results file.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qserve.checkpoint.policy import DEFAULT_MIN_RECOVERY, GateSpec
from qserve.errors import QserveError
from qserve.evaluate import looks, stats
from qserve.evaluate.gates import decide, verdict


def gate_runs(
    baseline: Path, quantized: Path, gates: dict[str, list[GateSpec]], tasks: list[str] | None = None, look: int = 1
) -> dict[str, Any]:
    """Decide every gate (default: min_recovery 0.95 on each task's first metric) on two lm-eval outputs,
    at the level of the look-th look at these weights (looks.py: qserve cannot count looks it did not run)."""
    base, quant = _LmEvalRun(baseline), _LmEvalRun(quantized)
    names = tasks or sorted(set(gates) or (set(base.results) & set(quant.results)))
    if not names:
        raise QserveError(f"{baseline} and {quantized} have no task in common")
    decided = []
    for task in names:
        for spec in gates.get(task) or [GateSpec(min_recovery=DEFAULT_MIN_RECOVERY)]:
            metric = spec.metric or base.headline(task)
            hib = base.higher_is_better(task, metric)
            b, q = base.score(task, metric), quant.score(task, metric)
            if set(b[2]) != set(q[2]):
                raise QserveError(
                    f"{task}: the runs scored different items ({len(b[2])} in the baseline, {len(q[2])} quantized, "
                    f"{len(set(b[2]) & set(q[2]))} in common); run both with the same --limit and data"
                )
            cmp = stats.compare(metric, hib, b, q, looks.level(look))
            decided.append(decide(task, spec, cmp))
    return {
        "baseline_run": str(baseline),
        "quantized_run": str(quantized),
        "decided_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "verdict": verdict(decided),
        "look": {"number": look, "level": looks.level(look), "counted": False, "earlier": []},
        "gates": [asdict(g) for g in decided],
    }


class _LmEvalRun:
    """One lm-eval output: its aggregated results and, per task, the per-item values of each metric."""

    def __init__(self, path: Path) -> None:
        if not path.exists():
            raise QserveError(f"{path} does not exist")
        files = sorted(path.rglob("results_*.json")) if path.is_dir() else [path]
        if not files:
            raise QserveError(f"{path} holds no lm-eval results_*.json (run lm-eval with --output_path and --log_samples)")
        self.path, self.folder = files[-1], files[-1].parent
        try:
            self.raw = json.loads(self.path.read_text())
            self.results = self.raw["results"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise QserveError(f"{self.path} is not an lm-eval results file") from None

    def headline(self, task: str) -> str:
        keys = [k for k in self._task(task) if "," in k and "_stderr," not in k]
        if not keys:
            raise QserveError(f"{self.path} has no metric for {task}")
        return keys[0]

    def higher_is_better(self, task: str, metric: str) -> bool:
        value = (self.raw.get("higher_is_better") or {}).get(task, {}).get(metric.partition(",")[0])
        if not isinstance(value, bool):
            raise QserveError(
                f"{self.path} does not say whether higher {metric} is better for {task} (lm-eval's higher_is_better)"
            )
        return value

    def score(self, task: str, metric: str) -> tuple[float, float | None, stats.ItemValues]:
        res = self._task(task)
        if metric not in res:
            raise QserveError(f"{self.path} has no {metric!r} for {task}; it has {', '.join(k for k in res if ',' in k)}")
        name, _, filt = metric.partition(",")
        stderr = res.get(f"{name}_stderr,{filt}")
        return float(res[metric]), stderr if isinstance(stderr, (int, float)) else None, self._items(task, metric)

    def _task(self, task: str) -> dict[str, Any]:
        if task not in self.results:
            raise QserveError(f"{self.path} has no task {task}; it has {', '.join(self.results)}")
        return self.results[task]

    def _items(self, task: str, metric: str) -> stats.ItemValues:
        files = sorted(self.folder.glob(f"samples_{task}_*.jsonl"))
        if not files:
            raise QserveError(f"{self.folder} has no samples_{task}_*.jsonl: run lm-eval with --log_samples")
        try:
            samples = [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise QserveError(f"{files[-1]} is not lm-eval's samples file (line {exc.lineno}: {exc.msg})") from None
        return stats.item_values(samples, metric)


def format_report(summary: dict[str, Any]) -> str:
    """The terminal view of `qserve gate`: the gate table, one line per gate, the verdict."""
    from qserve.checkpoint.card import gate_rows, text_table

    lines = text_table(gate_rows(summary))
    lines += [f"  {g['task']} {g['metric']}: {g['status']}: {g['reason']}" for g in summary["gates"]]
    return "\n".join([*lines, f"verdict: {summary['verdict'].upper()}"])
