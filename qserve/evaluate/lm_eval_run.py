"""lm-eval as qserve runs it: all tasks through one engine, results without per-sample logs,
and per-item values kept for the paired noise estimate."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from qserve.checkpoint.manifest import VllmArgs
from qserve.device import detect
from qserve.engines import vllm as engine
from qserve.errors import QserveError
from qserve.evaluate import fallback
from qserve.evaluate.tasks import config_task_manager, task_counts, task_size
from qserve.gate import core, stats
from qserve.gate.order import GROUPS, ORDER, WORDS, item_order, pooled_order, split_pooled, weighted_order
from qserve.gate.stats import ItemValues
from qserve.progress import step
from qserve.spec.lm_eval_args import LmEvalArgs


@dataclass
class EngineRun:
    """One engine's lm-eval output: results without per-sample logs, per-item values, timing."""

    raw: dict[str, Any]
    items: dict[str, dict[str, ItemValues]] = field(default_factory=dict)  # task -> metric -> items
    seconds: float = 0.0
    extra: Any = None

    def higher_is_better(self, task: str, metric: str) -> bool:
        return core.higher_is_better(self.raw, task, metric, "lm-eval's results")

    def output_type(self, task: str) -> str | None:
        return core.output_type(self.raw, task)

    def check_items_add_up(self, task: str, metric: str, scored: tuple[float, float | None, ItemValues | None]) -> None:
        """Nothing to check: this run's items and scores come from the same lm-eval call (gate.core.Scores)."""

    def score(self, task: str, metric: str) -> tuple[float, float | None, ItemValues | None]:
        """The score lm-eval states, its stderr if it gave one, and the per-item values (gate.core.Scores)."""
        res = self.raw["results"].get(task, {})
        if metric not in res:
            reported = ", ".join(k for k in res if k != "alias")
            raise QserveError(f"lm-eval returned no {metric!r} for {task}; it reported {reported}")
        name, _, filt = metric.partition(",")
        stderr = res.get(f"{name}_stderr,{filt}")
        return (
            float(res[metric]),
            float(stderr) if isinstance(stderr, (int, float)) else None,
            self.items.get(task, {}).get(metric),
        )


@dataclass(frozen=True)
class Window:
    """Which items an eval scores: all (no limit), or per task the `limit` documents from `offset` on
    in its seeded order (gate/order.py: a held-out set when offset; built by `select`). The tasks of an
    lm-eval group gated as one take theirs from the group's pooled order instead: `limit` items of the
    group, so that each look is a prefix of one order the gate bets on (gate/order.pooled_order)."""

    limit: int | None
    offset: int = 0
    ids: dict[str, tuple[int, ...]] | None = None  # task -> lm-eval doc ids scored, when limited (possibly none)
    sizes: dict[str, int] | None = None  # task -> its documents, when limited (the population the gate bets on)
    # task -> corpus perplexity -> doc id -> its words or bytes (tasks.task_counts): the weights its gate
    # bets by; a task reporting word perplexity takes its order size-biased by the words
    counts: dict[str, dict[str, dict[int, float]]] | None = None
    orders: dict[str, list[Any]] | None = None  # task, or group pooling its tasks' items -> its seeded order
    pooled: dict[str, str] | None = None  # task -> the group whose pooled order takes its items

    @classmethod
    def select(
        cls, limit: int | None, offset: int, configs: list[dict[str, Any]], groups: dict[str, core.Group] | None = None
    ) -> Window:
        """The window over these complete task configs; a limit counts each task's documents first."""
        counts = {c["task"]: found for c in configs if (found := task_counts(c))}
        if limit is None:
            return cls(None, offset, counts=counts)
        words = {t: by_metric[WORDS] for t, by_metric in counts.items() if WORDS in by_metric}
        sizes = {c["task"]: len(words[c["task"]]) if c["task"] in words else task_size(c) for c in configs}
        pooled = _pooled(groups or {}, set(sizes) - set(words))
        orders: dict[str, list[Any]] = {
            t: weighted_order(t, words[t]) if t in words else item_order(t, n) for t, n in sizes.items() if t not in pooled
        }
        for name, group in (groups or {}).items():
            if members := {m: sizes[m] for m in group.members if pooled.get(m) == name}:
                orders[name] = pooled_order(name, members, dict(group.aggregate).get(group.metric, True))
        return cls(limit, offset, None, sizes, counts, orders, pooled).block(offset)

    def block(self, start: int) -> Window:
        """Items `start` .. offset + limit - 1 of each order: what a later round scores after the first `start`."""
        if self.limit is None or self.orders is None or not 0 <= start - self.offset < self.limit:
            raise ValueError(f"a block starts inside a limited window, not at {start} of {self.key()}")
        end = self.offset + self.limit
        ids: dict[str, list[int]] = {t: [] for t in self.sizes or {}}
        for unit, order in self.orders.items():
            if unit in ids:
                ids[unit] += order[start:end]
            else:  # a group: its items by member
                for member, docs in split_pooled(order[start:end]).items():
                    ids[member] += docs
        return replace(self, limit=end - start, offset=start, ids={t: tuple(sorted(d)) for t, d in ids.items()})

    def scored(self) -> set[str] | None:
        """The tasks with items to score (a group's task may have none in a block); None: every task."""
        return None if self.ids is None else {t for t, docs in self.ids.items() if docs}

    def key(self, task: str | None = None) -> str | None:
        """For the baseline cache: which items of `task`, by rule and range (None: every document); a
        group's task by the doc ids themselves, which the group's other tasks decide."""
        if self.limit is None:
            return None
        where = f"{ORDER}[{self.offset}:{self.offset + self.limit}]"
        if task is None or task not in (self.pooled or {}):
            return where
        docs = hashlib.sha256(json.dumps((self.ids or {}).get(task, ())).encode()).hexdigest()[:16]
        return f"{where} of group {(self.pooled or {})[task]} ({GROUPS}): doc ids {docs}"

    def describe(self) -> str:
        if self.offset:
            return f" (items {self.offset}-{self.offset + (self.limit or 0) - 1} of the seeded order)"
        return f" (limit {self.limit}, a seeded sample)" if self.limit else ""

    def lm_eval(self, tasks: list[str]) -> dict[str, Any]:
        """simple_evaluate's keywords: `samples` (doc ids per task) when limited, else none."""
        if self.limit is None:
            return {}
        if self.ids is None or set(tasks) - set(self.ids):
            raise ValueError("a limited window selects each task's items first: build it with Window.select")
        if empty := [t for t in tasks if not self.ids[t]]:
            raise ValueError(f"no items of {', '.join(empty)} in this window: leave them out of the run")
        return {"samples": {t: list(self.ids[t]) for t in tasks}}


def _pooled(groups: dict[str, core.Group], tasks: set[str]) -> dict[str, str]:
    """task -> the group gated as one whose pooled order takes its items (a task of two such groups
    would have two samples: refused)."""
    out: dict[str, str] = {}
    for name, group in groups.items():
        for member in group.members:
            if member in tasks and out.setdefault(member, name) != name:
                raise QserveError(
                    f"task {member} is in both groups {out[member]} and {name}; with --limit each group samples its own "
                    "items, so gate them in separate evals"
                )
    return out


@dataclass(frozen=True)
class Subject:
    """The model one lm-eval run scores: its files, vLLM's arguments for it, its name in messages,
    and whether it goes through transformers because vLLM cannot run its scheme here."""

    path: Path
    args: VllmArgs
    label: str
    emulated: bool = False


# lm-eval's own account of how it prompted: its EvaluationTracker's fields (simple_evaluate's results carry
# them only through a tracker), beside `n-shot` and `task_hashes` per task and `config`'s generation settings.
TRACKED = ("chat_template", "chat_template_sha", "system_instruction", "system_instruction_sha", "fewshot_as_multiturn")
CONFIG = ("gen_kwargs", "random_seed", "numpy_seed", "torch_seed", "fewshot_seed")


def run_lm_eval(
    subject: Subject,
    device: detect.Device,
    configs: list[dict],
    window: Window,
    during: Callable[[Any], Any] | None = None,
    options: LmEvalArgs = LmEvalArgs(),
) -> EngineRun:
    """All tasks through one vLLM engine (transformers if emulated), with lm-eval's `options`; `during(lm)`
    runs on it before it stops."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker

    names = [c["task"] for c in configs]
    args, label = subject.args, subject.label
    if subject.emulated:
        opened = fallback.open_transformers(subject.path, args.quantization, label, args.trust_remote_code)
    else:
        opened = engine.open_engine(subject.path, args, device, label)
    tracker = EvaluationTracker()  # no output path: it only records what simple_evaluate tells it
    with opened as lm:
        with step(f"lm-eval on {label}: {', '.join(names)}{window.describe()}") as timing:
            out = lm_eval.simple_evaluate(
                model=lm,
                tasks=configs,
                task_manager=config_task_manager(),
                log_samples=True,
                bootstrap_iters=1000,
                evaluation_tracker=tracker,
                **window.lm_eval(names),
                **options.resolved(),
            )
        extra = during(lm) if during else None
    keep = ("results", "n-samples", "n-shot", "configs", "versions", "higher_is_better")
    raw = _jsonable({k: out[k] for k in keep if k in out} | _prompting(out, tracker))
    items = {n: _items(out.get("samples", {}).get(n, []), raw["results"].get(n, {})) for n in names}
    return EngineRun(raw, items, timing["seconds"], extra)


def _prompting(out: dict[str, Any], tracker: Any) -> dict[str, Any]:
    """lm-eval's fields on how it prompted: the tracker's, `task_hashes` as lm-eval's tracker computes them when it
    saves results (EvaluationTracker.save_results_aggregated), and `config`'s generation settings."""
    from lm_eval.utils import hash_string

    samples = out.get("samples", {})
    hashes = {t: hash_string("".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"] for s in v)) for t, v in samples.items()}
    config = out.get("config", {})
    tracked = {k: getattr(tracker.general_config_tracker, k) for k in TRACKED}
    return tracked | {"task_hashes": hashes, "config": {k: config.get(k) for k in CONFIG}}


def prompting(raw: dict[str, Any]) -> dict[str, Any]:
    """How lm-eval prompted one model, in its own fields: what must be equal on both models."""
    return {k: raw.get(k) for k in (*TRACKED, "n-shot", "task_hashes", "config")}


def run_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The fields of `prompting` that are the run's, not a task's (a cached baseline task keeps them beside its own)."""
    return {k: raw[k] for k in (*TRACKED, "config") if k in raw}


def unjoinable(run: EngineRun) -> str | None:
    """Why `join` cannot rebuild this run's results from its items: a metric lm-eval logs no per-item
    values of, or whose score (or stderr) is not the mean or ratio of sums of them (lm-eval's
    mean_stderr) as lm-eval states it; None when every result follows from the items."""
    for task, res in run.raw.get("results", {}).items():
        for key, value in res.items():
            if "," not in key or "_stderr" in key:
                continue
            items = run.items.get(task, {}).get(key)
            if not items:
                return f"{task}'s {key} has no per-item values that give its score"
            if not stats.adds_up(key, items, value):
                return f"{task}'s {key} is not the mean (or ratio of sums) of the per-item values lm-eval logged"
            stderr = res.get(_stderr_key(key))
            if isinstance(stderr, (int, float)) and key.partition(",")[0] in stats.WEIGHTED:
                return f"{task}'s {_stderr_key(key)} is lm-eval's bootstrap, which the items do not give again"
            rebuilt = _rebuilt(key, items, res)
            if isinstance(stderr, (int, float)) and not math.isclose(rebuilt[_stderr_key(key)], stderr, rel_tol=1e-6):
                return f"{task}'s {_stderr_key(key)} is not lm-eval's mean_stderr of its per-item values"
    return None


def join(earlier: EngineRun, later: EngineRun) -> EngineRun:
    """One run over the items of both: `later` scored items of the same tasks that `earlier` did not (the
    next block of each task's seeded order). Each score is rebuilt from the joined items as lm-eval
    aggregates them (a mean, or a ratio of sums for perplexities; stderr by lm-eval's mean_stderr where it
    gave one), so both runs must pass `unjoinable`; a task only `earlier` scored is kept as it was."""
    from lm_eval.utils import hash_string

    for run in (earlier, later):
        if why := unjoinable(run):
            raise ValueError(f"the runs cannot be joined: {why}")
    raw = _jsonable(earlier.raw)
    for key in (*TRACKED, "config"):
        if key in later.raw and later.raw[key] != raw.get(key):
            raise QserveError(f"lm-eval ran the later items with another {key} than the earlier ones; their scores do not join")
    items = {task: dict(metrics) for task, metrics in earlier.items.items()}
    for task, res in later.raw.get("results", {}).items():
        for key, values in later.items.get(task, {}).items():
            joined = items.setdefault(task, {}).setdefault(key, {})
            if both := sorted(set(joined) & set(values))[:3]:
                raise ValueError(f"{task}: documents {', '.join(both)} were scored in both runs")
            items[task][key] = joined | values
        results = raw.setdefault("results", {})
        before = results.get(task, {})
        results[task] = before | res
        if isinstance(before.get("sample_len"), int) and isinstance(res.get("sample_len"), int):
            results[task]["sample_len"] = before["sample_len"] + res["sample_len"]  # lm-eval's count of items scored
        for key in res:
            if "," in key and "_stderr" not in key:
                results[task] |= _rebuilt(key, items[task][key], res)
        for section in ("n-shot", "configs", "versions", "higher_is_better"):
            if task in later.raw.get(section, {}):
                raw.setdefault(section, {})[task] = later.raw[section][task]
        counts = [run.raw.get("n-samples", {}).get(task, {}) for run in (earlier, later)]
        if counts[1]:  # a group's task may have had no items before this block
            effective = counts[0].get("effective", 0) + counts[1]["effective"]
            raw.setdefault("n-samples", {})[task] = counts[1] | {"effective": effective}
        hashes = [run.raw.get("task_hashes", {}).get(task, "") for run in (earlier, later)]
        raw.setdefault("task_hashes", {})[task] = hash_string("".join(hashes)) if hashes[0] else hashes[1]
    return EngineRun(raw, items, earlier.seconds + later.seconds, later.extra)


def _rebuilt(key: str, items: ItemValues, res: dict[str, Any]) -> dict[str, Any]:
    """A metric's score from its items as lm-eval aggregates them, and its stderr where lm-eval gave a number."""
    from lm_eval.api.metrics import mean_stderr

    values = list(items.values())
    out: dict[str, Any] = {key: stats.aggregate(key.partition(",")[0], values)}
    if isinstance(res.get(_stderr_key(key)), (int, float)) and key.partition(",")[0] not in stats.WEIGHTED:
        flat = [x for v in values for x in v] if stats.several_per_item(key.partition(",")[0], values) else values
        out[_stderr_key(key)] = mean_stderr(flat) if len(flat) > 1 else res[_stderr_key(key)]
    return out


def _stderr_key(key: str) -> str:
    name, _, filt = key.partition(",")
    return f"{name}_stderr,{filt}"


def _items(samples: list[dict], results: dict) -> dict[str, ItemValues]:
    """Per metric, the per-item values that give lm-eval's score (stats.adds_up); a corpus metric's have none."""
    keys = [k for k in results if "," in k and "_stderr" not in k]
    return {k: v for k in keys if (v := stats.item_values(samples, k)) and stats.adds_up(k, v, results[k])}


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))
