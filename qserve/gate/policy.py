"""The gate a checkpoint must meet before `qserve serve` or `qserve sign` accepts it: its policy.

A gate record says what was measured and decided; the policy says what was required. By default
it is the recipe's declared gates (written into the manifest), every task and metric of them, each
at MIN_ITEMS items or more; an operator may name a policy file instead. A record whose criteria are looser than the policy, or
whose n is below the minimum, is refused with one line naming the difference, unless the operator
accepts the difference explicitly; the acceptance is then written into the eval record and the
model card, so whoever reads the checkpoint sees it.

Spec arithmetic lives here (not in qserve.evaluate) so that serving never imports the evaluation stack.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from qserve.errors import InvalidSpec, QserveError
from qserve.gate.spending import MIN_ITEMS, level, min_items  # noqa: F401  (the policy's defaults)

DEFAULT_MIN_RECOVERY = 0.95
CRITERIA = ("min_recovery", "max_drop", "max_increase")


class GateSpec(BaseModel):
    """One gate on one metric of a task. A bare number in a recipe means min_recovery."""

    model_config = ConfigDict(extra="forbid")
    metric: str | None = Field(None, description="lm-eval '<metric>,<filter>' key; default: the task's headline metric")
    min_recovery: float | None = Field(None, gt=0, le=2, description="quantized/baseline (baseline/quantized for losses)")
    max_drop: float | None = Field(None, ge=0, description="largest allowed degradation in the metric's own units")
    max_increase: float | None = Field(None, ge=0, description="lower-is-better metrics: largest relative increase (0.05 = 5%)")

    @model_validator(mode="after")
    def _has_criterion(self) -> GateSpec:
        if all(getattr(self, c) is None for c in CRITERIA):
            raise InvalidSpec(f"a gate needs at least one of {', '.join(CRITERIA)}")
        return self

    def criteria(self) -> dict[str, float]:
        return {c: getattr(self, c) for c in CRITERIA if getattr(self, c) is not None}


def normalize(value: object) -> list[GateSpec]:
    """A recipe's or CLI's gate value (number, mapping or list of them) as GateSpecs."""
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if isinstance(item, GateSpec):
            out.append(item)
        elif isinstance(item, (int, float)) and not isinstance(item, bool):
            out.append(GateSpec(min_recovery=float(item)))
        elif isinstance(item, dict):
            out.append(GateSpec.model_validate(item))
        else:
            raise InvalidSpec(f"a gate is a number (minimum recovery) or a mapping of {', '.join(CRITERIA)}; got {item!r}")
    return out


def allowed_degradation(spec: GateSpec, baseline: float, higher_is_better: bool) -> float | None:
    """The tightest allowance the spec's criteria give; None if min_recovery is undefined."""
    limits = []
    if spec.min_recovery is not None:
        if higher_is_better:
            if baseline == 0:
                return None
            limits.append(baseline * (1 - spec.min_recovery))
        else:
            limits.append(baseline * (1 / spec.min_recovery - 1))
    if spec.max_drop is not None:
        limits.append(spec.max_drop)
    if spec.max_increase is not None:
        if higher_is_better:
            raise QserveError(
                f"max_increase applies to lower-is-better metrics (perplexity); {spec.metric} is a score: use max_drop"
            )
        limits.append(baseline * spec.max_increase)
    return min(limits)


class Policy(BaseModel):
    """What a servable gate record must have decided: gates per task, on at least min_items items."""

    model_config = ConfigDict(extra="forbid")
    gates: dict[str, Any] = Field(default_factory=dict, description="task -> gate(s), as in a recipe")
    min_items: int = Field(MIN_ITEMS, ge=1, description="the fewest items a passing gate may rest on")
    require_all_tasks: bool = Field(True, description="every task and metric of `gates` gated (false: at least one)")
    source: str = "the recipe"

    def specs(self) -> dict[str, list[GateSpec]]:
        return {task: normalize(value) for task, value in self.gates.items()}


def recipe_policy(recipe: dict[str, Any]) -> Policy:
    """The default policy: the recipe's declared gates, or the default gate on gsm8k (as `qserve eval` applies)."""
    gates = recipe.get("gates") or {"gsm8k": DEFAULT_MIN_RECOVERY}
    return Policy(gates=gates, source=f"recipe {recipe.get('name', '?')}")


def read_policy(path: Path) -> Policy:
    """An operator's policy file: YAML with `gates` (as in a recipe) and optionally `min_items`."""
    try:
        data = yaml.safe_load(path.read_text())
        policy = Policy.model_validate({**(data or {}), "source": str(path)})
        policy.specs()
    except OSError as exc:
        raise QserveError(f"cannot read the policy file {path}: {exc.strerror}") from None
    except (yaml.YAMLError, ValidationError, TypeError) as exc:
        raise QserveError(f"policy file {path} is invalid: {str(exc).splitlines()[0]}") from None
    return policy


def differences(record: dict[str, Any], policy: Policy) -> list[str]:
    """Where a gate record falls short of the policy; empty when it meets it. Every task and metric the
    policy names must have been gated and met (with require_all_tasks: false, at least one); a gate
    with no signal on a named task is a difference the operator must accept."""
    found, evaluated = [], []
    gates = record.get("gates") or []
    for task, specs in policy.specs().items():
        for spec in specs:
            named = f"{task}{'@' + spec.metric if spec.metric else ''}"
            matching = [g for g in gates if g.get("task") == task and _same_metric(g, spec)]
            mine = [g for g in matching if g.get("signal", True)]
            evaluated += mine
            if not mine and len(matching) > len(mine):
                found.append(f"{named} was gated without signal ({matching[0].get('reason')}): it decided nothing")
            elif not mine and policy.require_all_tasks:
                found.append(f"no gate on {named} (the policy requires {spec.criteria()})")
            found += [d for g in mine if (d := _shortfall(g, spec, policy))]
    if not evaluated and not found:
        found.append(f"no gate on any task the policy names ({', '.join(policy.gates)})")
    return found


def _same_metric(gate: dict[str, Any], spec: GateSpec) -> bool:
    """Exactly the metric the policy names; a policy gate without one means the task's headline metric
    (not whichever metric a record happens to hold, e.g. flexible-extract for strict-match)."""
    return gate.get("metric") == spec.metric if spec.metric else gate.get("headline") is True


def _shortfall(gate: dict[str, Any], spec: GateSpec, policy: Policy) -> str | None:
    name = f"{gate['task']} {gate['metric']}"
    if gate.get("status") != "pass":
        return f"{name} did not pass ({gate.get('status')})"
    items = gate.get("items") or 0
    if items < policy.min_items:
        return f"{name} passed on {items} items, below the policy's minimum of {policy.min_items}"
    required = allowed_degradation(spec, gate["baseline"], gate["higher_is_better"])
    allowed = _record_allowance(gate)
    if required is not None and (allowed is None or allowed > required * (1 + 1e-9)):
        return f"{name} was gated at {gate.get('criteria')}, looser than the policy's {spec.criteria()}"
    return None


def _record_allowance(gate: dict[str, Any]) -> float | None:
    """The allowance the record was decided with: the larger of the one it states and the one its criteria give."""
    try:
        from_criteria = allowed_degradation(GateSpec(**(gate.get("criteria") or {})), gate["baseline"], gate["higher_is_better"])
    except (ValidationError, QserveError, KeyError, TypeError):
        return None
    stated = gate.get("allowed_degradation")
    if from_criteria is None or not isinstance(stated, (int, float)):
        return None
    return max(from_criteria, stated)


def check(record: dict[str, Any], policy: Policy, accept: bool) -> list[str]:
    """Raise on a shortfall unless `accept`; returns the accepted differences (empty when none)."""
    found = differences(record, policy)
    if found and not accept:
        raise QserveError(
            f"the gate record does not meet the policy of {policy.source}: {'; '.join(found)} "
            "(re-run `qserve eval` with the policy's gates and --limit, or pass --accept-gate-difference)"
        )
    return found
