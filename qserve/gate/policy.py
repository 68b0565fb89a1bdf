"""The gate a checkpoint must meet before `qserve serve` or `qserve sign` accepts it: its policy.

A gate record says what was measured and decided; the policy says what was required. By default
it is the recipe's declared gates (written into the manifest), every task and metric of them, each
at MIN_ITEMS items or more; an operator may name a policy file instead. A record whose criteria are looser than the policy, or
whose n is below the minimum, is refused with one line naming the difference, unless the operator
accepts the difference explicitly; the acceptance is then written into the eval record and the
model card, so whoever reads the checkpoint sees it.

The spec itself and its arithmetic are qserve.spec.gates; records.differences holds a record's gates against a policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from qserve.errors import QserveError
from qserve.gate.spending import MIN_ITEMS
from qserve.spec.gates import GateSpec, default_gate, normalize

if TYPE_CHECKING:
    from qserve.spec.recipe import Recipe


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


def recipe_policy(recipe: Recipe) -> Policy:
    """The default policy: the recipe's declared gates, or the default gate on gsm8k (as `qserve eval` applies)."""
    return Policy(gates=dict(recipe.gates) or {"gsm8k": default_gate()}, source=f"recipe {recipe.name}")


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
