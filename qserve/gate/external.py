"""`qserve gate`: the same paired gate on two lm-eval runs made elsewhere (`--log_samples` outputs).

lm-eval writes `results_<date>.json` (or `<stem>_<date>.json` for `--output_path x.json`) and one
`samples_<task>_<date>.jsonl` per task beside it, all with that run's date. The newest results file by
its own date is the run, and each task's items come from the samples file of exactly that task and
date. The two runs must have asked the same question: the same items, few-shot count, task config
and prompts (lm-eval's task hashes, each sample's doc and prompt hash), and each task's items must
add up to the score its results file states. The metric's direction comes from lm-eval's own
`higher_is_better`. A group lm-eval ran (its `group_subtasks`) is one gate over its tasks' items pooled,
its score the one lm-eval states for it; by default each top-level group and each task outside a group
is gated.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qserve.checkpoint.opened import Checkpoint
from qserve.errors import QserveError
from qserve.gate import evidence, looks, outside, stats
from qserve.gate.core import Group, decide_gates, gated_metrics, group, higher_is_better, output_type
from qserve.gate.decisions import Gate, verdict
from qserve.spec.gates import PERPLEXITY_UNITS, GateSpec, default_gate


def gate_runs(
    baseline: Path,
    quantized: Path,
    gates: dict[str, list[GateSpec]],
    tasks: list[str] | None = None,
    looks_from: Path | None = None,
    checkpoint: Checkpoint | None = None,
) -> dict[str, Any]:
    """Decide every gate (default: min_recovery 0.95 on each task's first metric) on two lm-eval outputs.
    `looks_from`: an earlier record (this command's --out, or a qserve_eval.json) whose look history
    these runs continue; without it this is a first look (looks.py: qserve counts only looks it is shown).
    `checkpoint` (opened, so its files match its manifest): the checkpoint the quantized run evaluated.
    The runs must be of it and its source model (outside.py) before anything is decided; its recipe's
    gates fill in for tasks `gates` does not name, its looks so far count, and the decision becomes its
    eval record, which `qserve serve` reads as it reads qserve's own."""
    base, quant = _LmEvalRun(baseline), _LmEvalRun(quantized)
    if checkpoint is not None:
        outside.check_runs(checkpoint, (base.raw, base.path), (quant.raw, quant.path))
        gates = checkpoint.manifest.recipe.gates | gates
    names = tasks or sorted(set(gates) or (set(base.units()) & set(quant.units())))
    if not names:
        raise QserveError(f"{baseline} and {quantized} have no task in common")
    groups = base.groups(names)
    leaves = {task: list(groups[task].members) if task in groups else [task] for task in names}
    history = _earlier(looks_from, checkpoint)
    limit = {task: sum(len(base.sample_hashes(leaf)) for leaf in leaves[task]) for task in names}
    scored = {"tasks": names, "limit": limit, "offset": 0}
    look, new = looks.number(history, scored)
    _same_prompting(base, quant)
    for leaf in dict.fromkeys(leaf for task in names for leaf in leaves[task]):
        _same_question(leaf, base, quant)
    specs = {task: gates.get(task) or default_gate() for task in names}
    headlines = {task: base.headline(task) for task in names if task not in groups}
    sizes = _sizes(base, quant, leaves)
    counts = _counts(specs, headlines, base, quant)
    decided = decide_gates(specs, headlines, base, quant, looks.level(look), groups, sizes, counts)
    decided_at, final = datetime.now(UTC).isoformat(timespec="seconds"), verdict(decided)
    entry = scored | {"decided_at": decided_at, "verdict": final, "level": looks.level(look)}
    summary = {
        "baseline_run": str(baseline),
        "quantized_run": str(quantized),
        "decided_at": decided_at,
        "verdict": final,
        "tasks": names,
        **({"groups": {n: asdict(g) for n, g in groups.items()}} if groups else {}),
        "look": {
            "number": look,
            "level": looks.level(look),
            "counted": new,
            "earlier": history,
            "history": looks.chained(history, *([entry] if new else [])),
        },
        "gates": [asdict(g) for g in decided],
    }
    if checkpoint is not None:
        _write_record(checkpoint, summary, base, quant)
    return summary


def _sizes(base: _LmEvalRun, quant: _LmEvalRun, leaves: dict[str, list[str]]) -> dict[str, int]:
    """Each task's documents as lm-eval's `n-samples` states them (`original`, before a limit): where fewer
    were scored, the gate bets on the scored ones as a sample of the task only if they are a block of its
    seeded order (gate/evidence.ordered). Both runs must state the same."""
    counts = [{t: (n or {}).get("original") for t, n in (run.raw.get("n-samples") or {}).items()} for run in (base, quant)]
    sizes = {}
    for task, members in leaves.items():
        stated = [[c.get(m) for m in members] for c in counts]
        if stated[0] != stated[1]:
            raise QserveError(
                f"{task}: the runs state different document counts (lm-eval's n-samples: {stated[0]} and {stated[1]})"
            )
        if all(isinstance(n, int) for n in stated[0]):
            sizes[task] = sum(stated[0])
    return sizes


def _counts(
    specs: dict[str, list[GateSpec]], headlines: dict[str, str], base: _LmEvalRun, quant: _LmEvalRun
) -> dict[str, dict[str, dict[int, float]]]:
    """Per task gated on a corpus perplexity: each scored document's words or bytes, as lm-eval's
    [loglikelihood, count] pairs count them from the text (task -> metric -> doc id -> count). The gate
    then bets on the documents in qserve's order size-biased by them (gate/order.py), fixed by the ids
    and the texts, never by a score: where every document was scored, the order `qserve eval` would
    have taken, a claim about the task whose last document decides exactly; where fewer were (lm-eval's
    --limit takes the first in file order; lm-eval's n-samples says how many the task holds), a claim
    about the scored documents alone, decided exactly by the last of them."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for task in headlines:
        metrics = {m for spec in specs.get(task, []) for m in gated_metrics(task, spec.metric, headlines, {})}
        for metric, name in ((m, m.partition(",")[0]) for m in metrics if evidence.counted(m)):
            items = base.score(task, metric)[2]
            pairs = list(items.values())
            if not pairs or not all(isinstance(v, list) and len(v) == 2 for v in pairs):
                continue
            other = quant.score(task, metric)[2]
            if set(other) != set(items):
                continue  # decide_gates refuses runs on different items, naming the counts
            if differ := [k for k, v in items.items() if not isinstance(other.get(k), list) or other[k][1] != v[1]][:1]:
                raise QserveError(
                    f"{task}: the runs count different {PERPLEXITY_UNITS[name]}s for document {differ[0]}: they scored other texts"
                )
            out.setdefault(task, {})[name] = {int(k): float(v[1]) for k, v in items.items()}
    return out


def _earlier(looks_from: Path | None, checkpoint: Checkpoint | None) -> list[dict[str, Any]]:
    """The looks these runs follow: --looks-from's record, and with a checkpoint the looks at its weights
    (its own record's history and the cache's ledger, as `qserve eval` counts them)."""
    given = _history(looks_from) if looks_from else []
    if checkpoint is None:
        return given
    from qserve.gate.records import read_eval

    record = read_eval(checkpoint.path)
    look = record.look if record else None
    mine = look.history if look and look.weights == looks.weights_key(checkpoint.manifest) else []
    return looks.merge(looks.earlier(checkpoint.manifest, mine), given)


def _write_record(checkpoint: Checkpoint, summary: dict[str, Any], base: _LmEvalRun, quant: _LmEvalRun) -> None:
    """The decision as the checkpoint's eval record (and its reports and card), the look in the cache's ledger."""
    from qserve.gate.reports import write_all

    summary["checkpoint"] = str(checkpoint.path.resolve())
    summary["look"]["weights"] = looks.weights_key(checkpoint.manifest)
    if summary["look"]["counted"]:  # the entry as `qserve eval` writes it: the ledger's lines are not chained
        looks.record(checkpoint.manifest, {k: v for k, v in summary["look"]["history"][-1].items() if k != "previous"})
    runs = {"baseline": outside.described(base.raw, base.path), "quantized": outside.described(quant.raw, quant.path)}
    record = outside.record(checkpoint, summary, runs, quant.raw.get("n-samples") or {})
    write_all(checkpoint.path, checkpoint.manifest, record, {"quantized": quant.raw, "baseline": base.raw})


def _history(path: Path) -> list[dict[str, Any]]:
    """The look history an earlier record carries, checked link by link."""
    try:
        record = json.loads(path.read_text())
    except OSError as exc:
        raise QserveError(f"cannot read the look record {path}: {exc.strerror}") from None
    except json.JSONDecodeError:
        raise QserveError(f"{path} is not a gate record (JSON) of `qserve gate --out` or `qserve eval`") from None
    history = ((record if isinstance(record, dict) else {}).get("look") or {}).get("history")
    if not isinstance(history, list):
        raise QserveError(f"{path} holds no look history (a record of `qserve gate --out` or `qserve eval` from this version)")
    return looks.checked(history, str(path))


def _same_question(task: str, base: _LmEvalRun, quant: _LmEvalRun) -> None:
    """Refuse two runs of a task that differ in what they asked: few-shot count, config, prompts."""
    for what, key in (
        ("few-shot count", "n-shot"),
        ("task config", "configs"),
        ("task version", "versions"),
        ("task hash", "task_hashes"),
    ):
        mine, theirs = base.section(key, task), quant.section(key, task)
        if key == "configs":
            mine, theirs = (_without_metadata(c) for c in (mine, theirs))
        if mine != theirs:
            raise QserveError(
                f"{task}: the runs differ in their {what} ({key} in {base.path.name} and {quant.path.name}): "
                "they did not ask the same question; run both with the same task, --num_fewshot and data"
            )
    b, q = base.sample_hashes(task), quant.sample_hashes(task)
    differ = sorted((i for i in set(b) & set(q) if b[i] != q[i]), key=lambda k: (len(k), k))
    if differ:
        raise QserveError(
            f"{task}: {len(differ)} items have other documents or prompts in the two runs (doc_hash / prompt_hash, "
            f"first doc_id {differ[0]}); run both with the same task, --num_fewshot and data"
        )


# How lm-eval prompted and generated, as its results file records it for the whole run (its tracker's fields,
# and `config`'s generation settings): the prompt hashes see a template, not a generation budget.
PROMPTING = ("chat_template_sha", "system_instruction_sha", "fewshot_as_multiturn")


def _same_prompting(base: _LmEvalRun, quant: _LmEvalRun) -> None:
    """Refuse two runs made with other lm-eval options: chat template, system instruction, few-shot turns,
    generation settings."""
    sides = [
        {k: run.raw.get(k) for k in PROMPTING} | {"gen_kwargs": (run.raw.get("config") or {}).get("gen_kwargs")}
        for run in (base, quant)
    ]
    differ = [k for k in sides[0] if sides[0][k] != sides[1][k]]
    if differ:
        raise QserveError(
            f"the runs were made with other lm-eval options ({', '.join(differ)} differ in {base.path.name} and "
            f"{quant.path.name}): run both with the same --apply_chat_template, --system_instruction, "
            "--fewshot_as_multiturn and --gen_kwargs"
        )


def _without_metadata(config: Any) -> Any:
    """lm-eval writes the model's arguments into a task config's metadata: not part of the question."""
    return {k: v for k, v in config.items() if k != "metadata"} if isinstance(config, dict) else config


# lm-eval's date in its output names: results_<date>.json, <stem>_<date>.json, samples_<task>_<date>.jsonl.
_DATE = re.compile(r"_(\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}(?:\.\d+)?)\.json$")


class _LmEvalRun:
    """One lm-eval output: its aggregated results and, per task, the per-item values of each metric."""

    def __init__(self, path: Path) -> None:
        if not path.exists():
            raise QserveError(f"{path} does not exist")
        files = [f for f in path.rglob("*.json") if _DATE.search(f.name)] if path.is_dir() else [path]
        if not files:
            raise QserveError(f"{path} holds no lm-eval results_<date>.json (run lm-eval with --output_path and --log_samples)")
        dated = sorted(files, key=lambda f: (m.group(1) if (m := _DATE.search(f.name)) else "", str(f)))
        self.path, self.folder = dated[-1], dated[-1].parent
        match = _DATE.search(self.path.name)
        if match is None:
            raise QserveError(f"{self.path} is not named as lm-eval names its results (<name>_<date>.json)")
        self.date = match.group(1)
        try:
            self.raw = json.loads(self.path.read_text())
            self.results = self.raw["results"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise QserveError(f"{self.path} is not an lm-eval results file") from None
        self._samples: dict[str, list[dict]] = {}

    def section(self, key: str, task: str) -> Any:
        return (self.raw.get(key) or {}).get(task)

    def check_items_add_up(self, task: str, metric: str, side: tuple[float, float | None, stats.ItemValues]) -> None:
        """The items must give the score the results file states: else they are another run's, or edited."""
        stated, _, items = side
        if not items:
            return
        if not stats.adds_up(metric, items, stated):
            from_items = stats.aggregate(metric.partition(",")[0], list(items.values()))
            raise QserveError(
                f"{task}: the {len(items)} items in {self.samples_file(task).name} give {metric} {from_items:.6g}, "
                f"but {self.path.name} states {stated:.6g}: they are not the items of that result"
            )

    def units(self) -> list[str]:
        """What is gated by default: each top-level group with a score of its own, each task outside them."""
        subtasks = self.raw.get("group_subtasks") or {}
        children = {c for cs in subtasks.values() for c in cs}
        tops = [g for g in subtasks if g not in children and self._stated(g)]
        grouped = {leaf for g in tops for leaf in self._leaves(g)}
        return tops + [t for t in self.results if t not in grouped and t not in subtasks]

    def groups(self, names: list[str]) -> dict[str, Group]:
        """The named groups this run has, each with its leaf tasks and the metrics lm-eval states for it."""
        subtasks = self.raw.get("group_subtasks") or {}
        out = {}
        for name in names:
            if name in subtasks:
                metrics = self._stated(name)
                if not metrics:
                    raise QserveError(f"{self.path} gives group {name} no score of its own: gate its tasks")
                leaves = self._leaves(name)
                reporting = {m: [leaf for leaf in leaves if m in self.results.get(leaf, {})] for m in metrics}
                headlines = {leaf: self.headline(leaf) for leaf in leaves if leaf in self.results}
                out[name] = group(name, leaves, [(m, True) for m in metrics], reporting, headlines)
        return out

    def _leaves(self, group: str) -> list[str]:
        subtasks = self.raw.get("group_subtasks") or {}
        return [leaf for c in subtasks.get(group, []) for leaf in (self._leaves(c) if c in subtasks else [c])]

    def _stated(self, group: str) -> list[str]:
        stated = (self.raw.get("groups") or {}).get(group) or self.results.get(group) or {}
        return [k for k in stated if "," in k and "_stderr," not in k]

    def sample_hashes(self, task: str) -> dict[str, tuple]:
        return {str(s["doc_id"]): (s.get("doc_hash"), s.get("prompt_hash")) for s in self._read_samples(task) if "doc_id" in s}

    def headline(self, task: str) -> str:
        keys = [k for k in self._task(task) if "," in k and "_stderr," not in k]
        if not keys:
            raise QserveError(f"{self.path} has no metric for {task}")
        return keys[0]

    def higher_is_better(self, task: str, metric: str) -> bool:
        return higher_is_better(self.raw, task, metric, str(self.path))

    def output_type(self, task: str) -> str | None:
        return output_type(self.raw, task)

    def score(self, task: str, metric: str) -> tuple[float, float | None, stats.ItemValues]:
        res = self._task(task)
        if metric not in res:
            raise QserveError(f"{self.path} has no {metric!r} for {task}; it has {', '.join(k for k in res if ',' in k)}")
        name, _, filt = metric.partition(",")
        stderr = res.get(f"{name}_stderr,{filt}")
        return float(res[metric]), stderr if isinstance(stderr, (int, float)) else None, self._items(task, metric)

    def _task(self, task: str) -> dict[str, Any]:
        found = self.results.get(task) or (self.raw.get("groups") or {}).get(task)  # lm-eval keeps groups apart
        if found is None:
            raise QserveError(f"{self.path} has no task {task}; it has {', '.join(self.results)}")
        return found

    def samples_file(self, task: str) -> Path:
        return self.folder / f"samples_{task}_{self.date}.jsonl"

    def _read_samples(self, task: str) -> list[dict]:
        if task not in self._samples:
            path = self.samples_file(task)
            if not path.is_file():
                raise QserveError(
                    f"{self.folder} has no {path.name} (the samples of {self.path.name}): run lm-eval with --log_samples"
                )
            try:
                self._samples[task] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            except json.JSONDecodeError as exc:
                raise QserveError(f"{path} is not lm-eval's samples file (line {exc.lineno}: {exc.msg})") from None
        return self._samples[task]

    def _items(self, task: str, metric: str) -> stats.ItemValues:
        return stats.item_values(self._read_samples(task), metric)


def format_report(summary: dict[str, Any]) -> str:
    """The terminal view of `qserve gate`: the gate table, one line per gate, the verdict."""
    from qserve.gate.card import gate_rows, text_table

    gates = [Gate(**g) for g in summary["gates"]]
    lines = text_table(gate_rows(gates))
    lines += [f"  {g.task} {g.metric}: {g.status}: {g.reason}" for g in gates]
    return "\n".join([*lines, f"verdict: {summary['verdict'].upper()}"])
