"""Accuracy gates: criteria per task and metric, and decisions that respect sampling noise.

Every criterion becomes an allowed degradation of the quantized score relative to the
baseline, in the metric's own units (a drop for scores, an increase for perplexities).
A gate passes only when the degradation stays inside that allowance by more than the
noise of the comparison, and fails only when it exceeds it by more than the noise; when
the noise band straddles the limit, the sample is too small and the gate says "inconclusive".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from pydantic import ConfigDict

from qserve.errors import InvalidSpec
from qserve.gate import betting, paired_binary
from qserve.spec.gates import GateSpec, allowed_degradation

if TYPE_CHECKING:
    from qserve.gate.evidence import GateDecision, Ordered


class Status(StrEnum):
    """A gate's status and an eval's verdict (a str: records and JSON hold the value)."""

    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


@dataclass
class Bounds:
    """One-sided 95 % lower and upper bounds on the degradation, on the scale the gate decides on
    (log(quantized/baseline) for perplexities, the metric's units otherwise)."""

    lower: float
    upper: float
    method: str  # which test gave them (see stats.py)
    items: int
    discordant: tuple[int, int] | None = None  # 0/1 metrics: items lost, items gained
    stderr: float | None = None  # the t bound's standard error, on the same scale
    skewness: float | None = None  # of the per-item terms (t bounds)
    needs: int | None = None  # t bounds: the items a pass needs (policy.min_items, the skewness rule)
    needs_why: str | None = None  # which of the two set `needs`
    level: float = 0.05  # each bound's one-sided level (less than 5 % on a later look: looks.py)


@dataclass
class Comparison:
    """Baseline and quantized scores of one metric on the same items, with their noise."""

    metric: str
    higher_is_better: bool
    baseline: float
    quantized: float
    baseline_stderr: float | None = None
    quantized_stderr: float | None = None
    # Standard error of (quantized - baseline) from the paired per-item comparison (for display).
    paired_stderr: float | None = None
    items: int | None = None
    constant: bool = False  # every item scored the same on both: no variance to judge by
    bounds: Bounds | None = None  # what the gate decides on; None: no valid bound at this sample
    log_scale: bool = False  # perplexities: bounds are on log(quantized/baseline)
    non_finite: bool = False  # some item scored NaN or infinity
    flips: dict[str, int] | None = None  # 0/1 metrics: items the quantized model lost and gained
    level: float = 0.05  # the one-sided level the bounds are made at (looks.py)

    @property
    def degradation(self) -> float:
        """How much worse the quantized score is, in the metric's units (negative: better)."""
        return self.baseline - self.quantized if self.higher_is_better else self.quantized - self.baseline

    @property
    def noise(self) -> float | None:
        if self.paired_stderr is not None:
            return self.paired_stderr
        if self.baseline_stderr is not None and self.quantized_stderr is not None:
            return math.hypot(self.baseline_stderr, self.quantized_stderr)  # unpaired: conservative
        return None


@dataclass
class Gate:
    __pydantic_config__ = ConfigDict(extra="forbid")  # as the eval record holds it (records.EvalRecord)

    task: str
    metric: str
    higher_is_better: bool
    baseline: float
    baseline_stderr: float | None
    quantized: float
    quantized_stderr: float | None
    recovery: float | None
    degradation: float
    degradation_stderr: float | None
    allowed_degradation: float | None
    criteria: dict[str, float]
    status: Status
    reason: str
    # False when the comparison cannot tell the models apart at all (zero baseline, every item
    # scoring the same on both): such a gate neither passes nor holds up the verdict (a warning).
    signal: bool = True
    test: str | None = None  # the bound the decision used (stats.py)
    items_needed: int | None = None  # inconclusive: about how many items would decide
    items: int | None = None  # items both models scored (the paired comparison's n)
    # The decision's numbers for machines: one-sided bounds (at `level`) of the degradation and the
    # allowance, relative for perplexities (0.02 = +2 %), else in the metric's own units.
    bounds: dict[str, float | str | int] | None = None
    flips: dict[str, int] | None = None  # 0/1 metrics: items lost and gained against the baseline
    # The metric is the task's headline one: a policy gate that names no metric is met only by such a gate.
    headline: bool = False
    # Gates decided by betting (evidence.py): per criterion its decision, the wealth against each null
    # and the items bet on; and the items the bet could take (`population`), `whole` when that is the task.
    evidence: dict[str, Any] | None = None


def recovery(baseline: float, quantized: float, higher_is_better: bool) -> float | None:
    """quantized/baseline for scores, baseline/quantized for losses; None when undefined."""
    num, den = (quantized, baseline) if higher_is_better else (baseline, quantized)
    if den == 0 or not (math.isfinite(num) and math.isfinite(den)):
        return None
    return num / den


def decide(task: str, spec: GateSpec, cmp: Comparison, headline: bool = False) -> Gate:
    allowed = _allowed(task, spec, cmp)
    if cmp.flips is not None and allowed is not None and not cmp.constant:
        cmp.bounds = binary_bounds(cmp.flips["lost"], cmp.flips["gained"], cmp.items or 0, allowed, cmp.level)
    status, reason, needed = _status(allowed, cmp)
    return Gate(
        task=task,
        metric=cmp.metric,
        higher_is_better=cmp.higher_is_better,
        baseline=cmp.baseline,
        baseline_stderr=cmp.baseline_stderr,
        quantized=cmp.quantized,
        quantized_stderr=cmp.quantized_stderr,
        recovery=recovery(cmp.baseline, cmp.quantized, cmp.higher_is_better),
        degradation=cmp.degradation,
        degradation_stderr=cmp.noise,
        allowed_degradation=allowed,
        criteria=spec.criteria(),
        status=Status(status),
        reason=reason,
        signal=not (allowed is None or cmp.constant),
        test=cmp.bounds.method if cmp.bounds else None,
        items_needed=needed,
        items=cmp.items,
        bounds=_bounds_record(cmp, allowed),
        flips=cmp.flips,
        headline=headline,
    )


def _allowed(task: str, spec: GateSpec, cmp: Comparison) -> float | None:
    allowed = allowed_degradation(spec, cmp.baseline, cmp.higher_is_better)
    if cmp.flips is not None and allowed is not None and allowed >= 1:
        raise InvalidSpec(
            f"gate on {task}: an allowed drop of {allowed:g} on {cmp.metric}, whose items score 0 or 1, can never fail; "
            "give a drop below 1 (0.02 is 2 points)"
        )
    return allowed


# How a betting gate's test ends when every look takes a prefix of one order (Ville's inequality: looks are free).
EVERY_LOOK = "at 5 % over every look"
# What a betting gate's bounds are: not its test, which is the bet (no interval of the bet is computed).
FOR_SCALE = "one look's fixed-n bounds, for scale: the gate decided by betting"


def decide_by_betting(
    task: str, spec: GateSpec, cmp: Comparison, found: GateDecision, items: Ordered, headline: bool = False
) -> Gate:
    """A gate decided by betting (evidence.decide_gate) on `items`; the comparison's scores and bounds
    are shown as `decide` computes them."""
    shown = decide(task, spec, cmp, headline=headline)
    where = f"{items.size} items of the task" if items.whole else f"the {items.size} scored items (a claim about them)"
    if items.after:
        where = f"the task's {items.size} items after the first {items.after} of its order (a claim about them)"
    bet, order = betting.Spec(**next(iter(found.criteria.values())).evidence.spec), "the seeded order"
    if bet.size_biased:
        order += f" size-biased by {bet.unit}s, on each document's loss change per {bet.unit} (within ±{bet.cap:.3g} nats)"
    elif bet.kind == "perplexity":
        order += f", on each item's loss change (within ±{bet.cap:.3g} nats)"
    elif bet.scores is not None:
        order += f", each item's score within the declared score_range [{bet.scores[0]:g}, {bet.scores[1]:g}]"
    level = EVERY_LOOK if items.free else f"at {found.alpha:.2%}, this look's share of 5 %"
    status, needed = Status(found.status), None
    reason = (
        ""
        if shown.allowed_degradation is None
        else f"degradation {cmp.degradation:.4g} vs allowed {shown.allowed_degradation:.4g}: "
    )
    reason += found.reason
    if status == Status.INCONCLUSIVE:
        needed = _items_to_pass(cmp, found, items)
        more = (
            f"{'all' if needed == items.size else 'about'} {needed} items would pass 4 times in 5 at these rates (simulated)"
            if needed
            else f"at these rates fewer than 4 runs in 5 would pass, even on all {items.size} items (simulated)"
        )
        reason += f"; {more} (--limit)"
    criteria = {
        c: {"decision": d.decision, "wealth_pass": d.wealth_pass, "wealth_fail": d.wealth_fail, "items": d.items}
        for c, d in found.criteria.items()
    }
    return replace(
        shown,
        status=status,
        reason=reason,
        signal=shown.allowed_degradation is not None,
        test=f"betting without replacement (Waudby-Smith and Ramdas 2020) on {where}, in {order}, {level}",
        items_needed=needed,
        # The t bound's sample-size rule is not the bet's: only the bounds themselves are shown, labelled.
        bounds=(
            {k: v for k, v in shown.bounds.items() if k not in ("skewness", "items_for_a_pass")} | {"shown": FOR_SCALE}
            if shown.bounds
            else None
        ),
        evidence={"criteria": criteria, "population": items.size, "whole": items.whole, "threshold": 1 / found.alpha},
    )


def _items_to_pass(cmp: Comparison, found: GateDecision, items: Ordered) -> int | None:
    """The items by which 4 in 5 simulated runs pass, each continuing the same bets on the task's items
    with the ones not yet scored drawn from those scored; None when fewer pass by the last item."""
    needed = 0
    order = items.population.order or []
    for criterion, decision in found.criteria.items():
        if decision.decision == "pass":
            continue
        terms = (found.terms or {})[criterion]
        seen = [terms[i] for i in order if i in terms]
        spec = betting.Spec(**decision.evidence.spec)
        weights = [items.population.weights[i] for i in order] if items.population.weighted else None
        at = betting.items_to_pass_in_order(seen, spec, items.size, found.alpha, weights=weights)
        if not math.isfinite(at):
            return None
        needed = max(needed, int(at))
    return max(needed, (cmp.items or 0) + 1)


def binary_bounds(lost: int, gained: int, n: int, allowed: float, level: float) -> Bounds:
    """0/1 items: the exact score test's bounds, exact at the allowance (paired_binary.py)."""
    lower, upper = paired_binary.bounds(lost, gained, n, allowed, level)
    method = f"exact unconditional score test on discordant items ({lost} lost, {gained} gained of {n})"
    return Bounds(lower, upper, method, n, discordant=(lost, gained), level=level)


def _bounds_record(cmp: Comparison, allowed: float | None) -> dict[str, float | str | int] | None:
    b = cmp.bounds
    if b is None or allowed is None:
        return None
    size = {"level": b.level} | ({} if b.needs is None else {"skewness": b.skewness, "items_for_a_pass": b.needs})
    if cmp.log_scale and cmp.baseline > 0:
        return {
            "lower": math.expm1(b.lower),
            "upper": math.expm1(b.upper),
            "allowed": allowed / cmp.baseline,
            "scale": "relative",
        } | size
    return {"lower": b.lower, "upper": b.upper, "allowed": allowed, "scale": "metric"} | size


def _status(allowed: float | None, cmp: Comparison) -> tuple[str, str, int | None]:
    """(status, reason, items needed) from the one-sided bounds of the degradation."""
    deg = cmp.degradation
    if allowed is None:
        return "inconclusive", f"baseline {cmp.metric} is {cmp.baseline:g}: recovery is undefined, this gate says nothing", None
    if cmp.non_finite or not (math.isfinite(deg) and math.isfinite(cmp.baseline)):
        where = "some items" if cmp.non_finite else f"the baseline {cmp.baseline:g}, the quantized model {cmp.quantized:g}"
        return "fail", f"{cmp.metric} is not a finite number ({where}): the scores cannot be compared", None
    if cmp.constant:
        return (
            "inconclusive",
            f"all {cmp.items} items scored {cmp.baseline:g} on both models: no variance, nothing to judge by",
            None,
        )
    within = f"degradation {deg:.4g} vs allowed {allowed:.4g}"
    if cmp.log_scale and cmp.baseline > 0 and cmp.quantized > 0:
        # Multiplicative metrics: compare log(quantized/baseline) with log(1 + allowed/baseline).
        within = f"{cmp.quantized / cmp.baseline - 1:+.2%} vs allowed {allowed / cmp.baseline:+.2%}"
        deg, allowed = math.log(cmp.quantized / cmp.baseline), math.log1p(allowed / cmp.baseline)
    b = cmp.bounds
    if b is None:
        return _without_bounds(cmp, deg, allowed, within)
    band = f"[{_fmt(b.lower, cmp.log_scale)}, {_fmt(b.upper, cmp.log_scale)}] one-sided {1 - b.level:.2%}, {b.method}"
    if b.lower > allowed:
        return "fail", f"{within}: exceeded beyond noise, degradation {band}", None
    if b.upper < allowed and b.needs is not None and b.items < b.needs:
        return (
            "inconclusive",
            f"{within}, under the allowance, but {b.items} items are too few for a pass ({b.needs_why}); {b.needs} items would decide (--limit)",
            b.needs,
        )
    if b.upper < allowed:
        return "pass", f"{within}, clear of noise: degradation {band}", None
    needed = items_needed(cmp, deg, allowed)
    more = f"about {needed} items would decide" if needed else "more items may not decide it"
    if needed and b.discordant is not None:
        more = f"about {needed} items would pass 4 times in 5 if these flip rates hold"
    if deg > allowed:
        return "inconclusive", f"{within}: exceeded, but within noise {band}; {more} (--limit)", needed
    if b.discordant == (0, 0):
        return (
            "inconclusive",
            f"{within}: the models agreed on all {b.items} items, too few to bound the difference: {band}; {more} (--limit)",
            needed,
        )
    return "inconclusive", f"{within}: too close to call, degradation {band}; {more} (--limit)", needed


def _without_bounds(cmp: Comparison, deg: float, allowed: float, within: str) -> tuple[str, str, int | None]:
    """No valid paired bound (too few items, no per-item values, or identical scores): never a pass."""
    n = cmp.items
    if not n:
        noise = cmp.noise
        if noise is not None and deg - 1.645 * noise > allowed:  # unpaired normal bound: only ever a failure
            return "fail", f"{within}: exceeded beyond the unpaired noise ±{noise:.2g}", None
        return (
            "inconclusive",
            f"{within}: no per-item values give this score (lm-eval logged none, or a corpus metric's), so the noise cannot be judged",
            None,
        )
    if n < 2:
        return "inconclusive", f"{within}: one item gives no noise estimate; evaluate more items (--limit)", None
    return (
        "inconclusive",
        f"{within}: both models scored identically on all {n} items, so a paired test has no noise estimate; "
        "evaluate more items (--limit), or a task with 0/1 items",
        None,
    )


def items_needed(cmp: Comparison, deg: float, allowed: float) -> int | None:
    """About how many items would put the bound clear of the allowance, if the observed difference holds."""
    b = cmp.bounds
    if b is None or not (math.isfinite(deg) and math.isfinite(allowed)):
        return None
    if b.discordant is not None:
        # 0/1 items: the n at which the score test passes 80 % of the time if the observed flip rates hold.
        lost, gained = (k / b.items for k in b.discordant)
        need = paired_binary.items_for_power(lost, gained, min(allowed, 1 - 1e-9), b.level)
        return max(need, b.items + 1) if need is not None else None
    gap = abs(deg - allowed)
    half = b.upper - deg if deg < allowed else deg - b.lower  # the side that must clear the allowance
    if gap == 0 or half <= 0 or not math.isfinite(half):
        return None
    return max(b.items + 1, b.needs or 0, math.ceil(b.items * (half / gap) ** 2))


def _fmt(x: float, log_scale: bool) -> str:
    return f"{math.expm1(x):+.2%}" if log_scale else f"{x:+.4g}"


def verdict(gates: list[Gate]) -> Status:
    """fail if any gate fails; inconclusive if any gate with signal is inconclusive; pass if at
    least one gate passed and every other one passed or had no signal; else inconclusive.

    A gate past its allowance but within noise therefore holds the verdict at inconclusive: a
    passing gate on another task cannot outvote it.
    """
    statuses = [g.status for g in gates]
    if Status.FAIL in statuses:
        return Status.FAIL
    if any(g.status == Status.INCONCLUSIVE and g.signal for g in gates):
        return Status.INCONCLUSIVE
    return Status.PASS if Status.PASS in statuses else Status.INCONCLUSIVE
