"""The one decision: every gate of a run from two models' lm-eval outputs. `qserve eval` (its engines'
results) and `qserve gate` (lm-eval runs made elsewhere) both decide through `decide_gates`, so the
same outputs get the same decision whichever command reads them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from qserve.errors import QserveError
from qserve.gate import evidence, stats
from qserve.gate.decisions import Gate, decide, decide_by_betting
from qserve.gate.stats import ItemValues
from qserve.spec.gates import GateSpec, check_allowance


class Scores(Protocol):
    """One model's lm-eval output as the gate reads it."""

    def higher_is_better(self, task: str, metric: str) -> bool:
        """lm-eval's own higher_is_better for the metric."""
        ...

    def output_type(self, task: str) -> str | None:
        """lm-eval's output_type for the task as its config in the results states it (None if not stated)."""
        ...

    def score(self, task: str, metric: str) -> tuple[float, float | None, ItemValues | None]:
        """The stated score, its stderr if lm-eval gave one, and the per-item values."""
        ...

    def check_items_add_up(self, task: str, metric: str, scored: tuple[float, float | None, ItemValues | None]) -> None:
        """Refuse items that do not give the stated score (another run's, or edited)."""
        ...


@dataclass(frozen=True)
class Group:
    """An lm-eval group gated as one: its leaf tasks' items pooled item by item into one paired test,
    its stated scores lm-eval's aggregation of theirs (its `aggregate_metric_list`), each metric over
    the members that report it."""

    name: str
    members: tuple[str, ...]  # leaf tasks, in lm-eval's order
    aggregate: tuple[tuple[str, bool], ...]  # ("<metric>,<filter>", weight_by_size), the first the headline
    # Each aggregate metric's members that report it; a metric not listed (records before it): every member.
    reporting: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # The metrics a gate that names none gates (`group`); empty (records before it): the headline alone.
    defaults: tuple[str, ...] = ()

    @property
    def metric(self) -> str:
        return self.aggregate[0][0]

    @property
    def gated(self) -> tuple[str, ...]:
        return self.defaults or (self.metric,)

    def reporters(self, metric: str) -> tuple[str, ...]:
        return dict(self.reporting).get(metric, self.members)


def group(
    name: str,
    members: Sequence[str],
    aggregate: Sequence[tuple[str, bool]],
    reporting: Mapping[str, Collection[str]],
    headlines: Mapping[str, str],
) -> Group:
    """A group whose gate without a metric reaches every member the group scores: its headline, then, for
    the first member no earlier metric reaches, that member's own headline where the group aggregates it
    (else the first aggregate metric that reaches it), and so on. lm-eval states each aggregate metric
    over the members reporting it, so the Open LLM Leaderboard's acc is mmlu_pro's alone, and its bbh,
    gpqa, musr, math and ifeval count under acc_norm, exact_match and ifeval's metrics."""
    metrics = [m for m, _ in aggregate]
    reach = {m: tuple(t for t in members if t in reporting.get(m, ())) for m in metrics}
    defaults, covered = [metrics[0]], set(reach[metrics[0]])
    for member in members:
        reaching = [m for m in metrics if member in reach[m]]
        if member in covered or not reaching:
            continue
        own = headlines.get(member)
        defaults.append(own if own in reaching else reaching[0])
        covered |= set(reach[defaults[-1]])
    return Group(name, tuple(members), tuple(aggregate), tuple(reach.items()), tuple(defaults))


def gated_metrics(unit: str, metric: str | None, headlines: Mapping[str, str], groups: Mapping[str, Group]) -> tuple[str, ...]:
    """The metrics a gate spec on a task or group gates: the `metric` it names, else the task's headline,
    or each of a group's defaults (all of them what a policy gate that names no metric asks for)."""
    if metric:
        return (metric,)
    return groups[unit].gated if unit in groups else (headlines[unit],)


class Pooled:
    """One model's scores (Scores) in which a group's score is its members': the members that report the
    metric (as lm-eval aggregates), their items keyed `member/doc_id`."""

    def __init__(self, scores: Scores, groups: dict[str, Group]) -> None:
        self.scores, self.groups = scores, groups

    def higher_is_better(self, task: str, metric: str) -> bool:
        if task not in self.groups:
            return self.scores.higher_is_better(task, metric)
        ways = {self.scores.higher_is_better(m, metric) for m in self._members(task, metric)}
        if len(ways) != 1:
            raise QserveError(f"group {task}: its tasks disagree on whether higher {metric} is better")
        return ways.pop()

    def output_type(self, task: str) -> str | None:
        """A group's: its members' one output_type, None if they differ."""
        if task not in self.groups:
            return self.scores.output_type(task)
        found = {self.scores.output_type(m) for m in self.groups[task].members}
        return found.pop() if len(found) == 1 else None

    def score(self, task: str, metric: str) -> tuple[float, float | None, ItemValues | None]:
        if task not in self.groups:
            return self.scores.score(task, metric)
        members = self._members(task, metric)
        items = {f"{m}/{i}": v for m, s in members.items() for i, v in s[2].items()}
        try:  # lm-eval's own score for the group, where its output has one (a run of the group itself)
            stated, stderr, _ = self.scores.score(task, metric)
        except QserveError:
            stated, stderr = self._aggregate(task, metric, members)
        return float(stated), stderr, items

    def check_items_add_up(self, task: str, metric: str, scored: tuple[float, float | None, ItemValues | None]) -> None:
        if task not in self.groups:
            return self.scores.check_items_add_up(task, metric, scored)
        for member, own in self._members(task, metric).items():
            self.scores.check_items_add_up(member, metric, own)

    def _aggregate(self, task: str, metric: str, members: dict) -> tuple[float, float | None]:
        """The group's score and stderr from its members' as lm-eval aggregates them (its Group.aggregate)."""
        from lm_eval.api.metrics import aggregate_subtask_metrics, pooled_sample_stderr, unweighted_mean_stderr

        sizes = [len(s[2]) for s in members.values()]
        by_size = dict(self.groups[task].aggregate).get(metric, True)
        value = aggregate_subtask_metrics([s[0] for s in members.values()], sizes, by_size)
        errors = [s[1] for s in members.values()]
        if None in errors:
            return value, None
        return value, pooled_sample_stderr(errors, sizes) if by_size else unweighted_mean_stderr(errors)

    def _members(self, task: str, metric: str) -> dict[str, tuple[float, float | None, ItemValues]]:
        """Each member's score, stderr and items, for the members that report `metric`."""
        out = {}
        for member in self.groups[task].members:
            try:
                scored = self.scores.score(member, metric)
            except QserveError:
                continue  # lm-eval's aggregation also leaves out members without the metric
            if scored[2] is None:
                raise QserveError(f"group {task}: {member} has no per-item values, so its items cannot be pooled")
            out[member] = scored
        if not out:
            raise QserveError(f"group {task}: none of its {len(self.groups[task].members)} tasks reports {metric}")
        return out


def output_type(raw: dict, task: str) -> str | None:
    """lm-eval's output_type of a task, from the config its results keep (None where they keep none)."""
    found = ((raw.get("configs") or {}).get(task) or {}).get("output_type")
    return found if isinstance(found, str) else None


def higher_is_better(raw: dict, task: str, metric: str, source: str) -> bool:
    """Which way a metric is better, as lm-eval's results state it (their `higher_is_better`)."""
    value = (raw.get("higher_is_better") or {}).get(task, {}).get(metric.partition(",")[0])
    if not isinstance(value, bool):
        raise QserveError(f"{source} does not say whether higher {metric} is better for {task} (lm-eval's higher_is_better)")
    return value


def decide_gates(
    specs: dict[str, list[GateSpec]],
    headlines: dict[str, str],
    base: Scores,
    quant: Scores,
    level: float,
    groups: dict[str, Group] | None = None,
    sizes: dict[str, int] | None = None,
    counts: dict[str, dict[str, dict[int, float]]] | None = None,
) -> list[Gate]:
    """Each task's (or group's) gates; a spec without a metric gates its defaults (`gated_metrics`). Scores in [0, 1],
    corpus perplexities on a task whose documents' `counts` are given (task -> metric -> doc id -> words
    or bytes, as lm-eval counts them: its order is size-biased by them), and lm-eval's `perplexity` on
    a task of one target per item (lambada's) are
    decided by betting (evidence.py) on the items in the task's seeded order (`sizes`: each task's
    documents, where fewer were scored): at 5 % over every look when each look takes a prefix of that
    order, else at `level`; the rest by stats.py's bounds at one-sided `level`."""
    decided = []
    groups = groups or {}
    headlines = headlines | {name: group.metric for name, group in groups.items()}
    base, quant = Pooled(base, groups), Pooled(quant, groups)
    for task, spec in ((t, s) for t, task_specs in specs.items() for s in task_specs):
        defaults = gated_metrics(task, None, headlines, groups)
        for metric in gated_metrics(task, spec.metric, headlines, groups):
            check_allowance(task, spec, metric)
            b, q = base.score(task, metric), quant.score(task, metric)
            if b[2] is not None and q[2] is not None and set(b[2]) != set(q[2]):
                raise QserveError(
                    f"{task}: the runs scored different items ({len(b[2])} in the baseline, {len(q[2])} quantized, "
                    f"{len(set(b[2]) & set(q[2]))} in common); run both with the same --limit and data"
                )
            base.check_items_add_up(task, metric, b)
            quant.check_items_add_up(task, metric, q)
            better = base.higher_is_better(task, metric)
            cmp = stats.compare(metric, better, b, q, level)
            headline = metric in defaults
            weights = (counts or {}).get(task, {}).get(metric.partition(",")[0])  # corpus perplexities' words or bytes
            targets = base.output_type(task) == "loglikelihood"  # one target per item: `perplexity` is per item
            if cmp.non_finite or not evidence.bettable(spec, metric, better, b[2], q[2], weights, targets):
                decided.append(decide(task, spec, cmp, headline=headline))
                continue
            items = _population(task, sorted(b[2]), metric, groups, sizes, weights)
            alpha = evidence.ALPHA if items.free else level
            found = evidence.decide_gate(b[2], q[2], spec, metric, better, items.population, alpha=alpha)
            decided.append(decide_by_betting(task, spec, cmp, found, items, headline=headline))
    return decided


def _population(
    task: str, scored: list[str], metric: str, groups: dict[str, Group], sizes: dict[str, int] | None, weights: dict | None
) -> evidence.Ordered:
    """The items a gate bets on: a task's (evidence.ordered), or a group's pooled (evidence.pooled) over its
    tasks' documents: as `sizes` states them, else (every document scored) the items each task reported."""
    total = _size(task, groups, sizes)
    if task not in groups:
        return evidence.ordered(task, scored, total, weights)
    group = groups[task]
    # lm-eval's score is over the members that report the metric: the pooled order restricted to them,
    # which is their own pooled order (each item's place comes from its own hash).
    members = {m: sizes[m] for m in group.reporters(metric) if m in (sizes or {})}
    if not members:
        if total is not None and total != len(scored):  # lm-eval's own --limit: the first in file order
            return evidence.ordered(task, scored, total)
        members = dict(Counter(key.rpartition("/")[0] for key in scored))
    return evidence.pooled(task, scored, members, dict(group.aggregate).get(metric, True))


def _size(task: str, groups: dict[str, Group], sizes: dict[str, int] | None) -> int | None:
    """The documents a task (or a group: its members') holds when fewer may have been scored; None when
    every document was scored."""
    if sizes is None:
        return None
    if task in groups and task not in sizes:
        return sum(sizes.get(m, 0) for m in groups[task].members)
    return sizes.get(task)
