"""The gate a checkpoint must meet before `qserve serve` or `qserve sign` accepts it: its policy.

A gate record says what was measured and decided; the policy says what was required. By default
it is the recipe's declared gates (written into the manifest), every task and metric of them, each
at MIN_ITEMS items or more; an operator may name a policy file instead. A record whose criteria are looser than the policy, or
whose n is below the minimum, is refused with one line naming the difference, unless the operator
accepts the difference explicitly; the acceptance is then written into the eval record and the
model card, so whoever reads the checkpoint sees it.

Spec arithmetic lives here (not in qserve.evaluate) so that serving never imports the evaluation stack;
records.differences holds a record's gates against a policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from qserve.errors import InvalidSpec, QserveError
from qserve.gate.spending import MIN_ITEMS, level, min_items  # noqa: F401  (the policy's defaults)

DEFAULT_MIN_RECOVERY = 0.95
CRITERIA = ("min_recovery", "max_drop", "max_increase")


class GateSpec(BaseModel):
    """One gate on one metric of a task. A bare number in a recipe means min_recovery."""

    model_config = ConfigDict(extra="forbid")
    metric: str | None = Field(None, description="lm-eval '<metric>,<filter>' key; default: the task's headline metric")
    min_recovery: float | None = Field(None, gt=0, description="quantized/baseline (baseline/quantized for losses), at most 1")
    max_drop: float | None = Field(None, ge=0, description="largest allowed degradation in the metric's own units")
    max_increase: float | None = Field(None, ge=0, description="lower-is-better metrics: largest relative increase (0.05 = 5%)")

    @model_validator(mode="after")
    def _has_criterion(self) -> GateSpec:
        if all(getattr(self, c) is None for c in CRITERIA):
            raise InvalidSpec(f"a gate needs at least one of {', '.join(CRITERIA)}")
        if self.min_recovery is not None and self.min_recovery > 1:
            # A negative allowance: the gate would ask the quantized model to beat the baseline.
            raise InvalidSpec(
                f"min_recovery {self.min_recovery:g} is above 1, which asks the quantized model to beat the baseline; give at most 1"
            )
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


# lm-eval metrics whose values are proportions (each item 0/1, or a probability): a mean of them can
# fall by less than 1, so a max_drop of 1 or more makes a gate that cannot fail.
PROPORTION_METRICS = frozenset(
    {"acc", "acc_norm", "acc_mutual_info", "exact_match", "mc1", "mc2", "f1", "em"}
    | {f"{unit}_level_{kind}_acc" for unit in ("prompt", "inst") for kind in ("strict", "loose")}
)


def check_allowance(task: str, spec: GateSpec, metric: str) -> None:
    """Refuse, before any work, a criterion the metric can never exceed (a gate that cannot fail)."""
    name = metric.partition(",")[0]
    if spec.max_drop is not None and spec.max_drop >= 1 and name in PROPORTION_METRICS:
        raise InvalidSpec(
            f"gate on {task}: max_drop={spec.max_drop:g} on {name}, a proportion between 0 and 1, can never fail; "
            "give a drop below 1 (0.02 is 2 points)"
        )


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


def default_gate() -> list[GateSpec]:
    """The gate on a task nobody gave one: min_recovery DEFAULT_MIN_RECOVERY on its headline metric."""
    return [GateSpec(min_recovery=DEFAULT_MIN_RECOVERY)]


def declared_gates(recipe: dict[str, Any]) -> dict[str, list[GateSpec]]:
    """The gates a recipe declares, from the recipe as a manifest records it, typed once."""
    return {task: normalize(value) for task, value in (recipe.get("gates") or {}).items()}


class Policy(BaseModel):
    """What a servable gate record must have decided: gates per task, on at least min_items items."""

    model_config = ConfigDict(extra="forbid")
    gates: dict[str, list[GateSpec]] = Field(default_factory=dict, description="task -> gate(s), as in a recipe")
    min_items: int = Field(MIN_ITEMS, ge=1, description="the fewest items a passing gate may rest on")
    require_all_tasks: bool = Field(True, description="every task and metric of `gates` gated (false: at least one)")
    source: str = "the recipe"

    @field_validator("gates", mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        """`gsm8k: 0.95`, one mapping or a list, as in a recipe."""
        return {task: normalize(v) for task, v in value.items()} if isinstance(value, dict) else value

    def specs(self) -> dict[str, list[GateSpec]]:
        return self.gates


def recipe_policy(recipe: dict[str, Any]) -> Policy:
    """The default policy: the recipe's declared gates, or the default gate on gsm8k (as `qserve eval` applies)."""
    return Policy(gates=declared_gates(recipe) or {"gsm8k": default_gate()}, source=f"recipe {recipe.get('name', '?')}")


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
