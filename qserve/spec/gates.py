"""The gate spec: one gate on one metric of a task (GateSpec), its parsers (`shorthand` for a recipe's and
a policy file's YAML, `normalize` on top of it for policy files, `parse_cli_gates` for `--gate`), the
default gate, and the allowance arithmetic every decision uses. It lives below checkpoint/ so a manifest's recipe holds its gates typed, and the spec reaches
serve in the form it was parsed in; serving never imports the evaluation stack for it."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from qserve.errors import InvalidSpec, QserveError

DEFAULT_MIN_RECOVERY = 0.95
CRITERIA = ("min_recovery", "max_drop", "max_increase")
SETTINGS = ("cap", "score_range")  # not criteria: the range a bet is declared in


class GateSpec(BaseModel):
    """One gate on one metric of a task. A bare number in a recipe means min_recovery."""

    model_config = ConfigDict(extra="forbid")
    metric: str | None = Field(None, description="lm-eval '<metric>,<filter>' key; default: the task's headline metric")
    min_recovery: float | None = Field(None, gt=0, description="quantized/baseline (baseline/quantized for losses), at most 1")
    max_drop: float | None = Field(None, ge=0, description="largest allowed degradation in the metric's own units")
    max_increase: float | None = Field(None, ge=0, description="lower-is-better metrics: largest relative increase (0.05 = 5%)")
    # Not a criterion: the range a perplexity's bet is declared in (gate/betting.py DEFAULT_CAPS).
    cap: float | None = Field(
        None,
        gt=0,
        description="word_perplexity (byte_perplexity, bits_per_byte): the largest loss change per word (byte), in nats, "
        "any one document may show; perplexity (lambada's): per item",
    )
    # Not a criterion: the range a per-item score outside [0, 1] is bet in (gate/evidence.py).
    score_range: tuple[float, float] | None = Field(
        None,
        description="a per-item score outside [0, 1] (truthfulqa_gen's bleu_max in [0, 100]): the range every item's "
        "score lies in, declared before scoring; an item outside it fails the gate, named",
    )

    @model_validator(mode="after")
    def _has_criterion(self) -> GateSpec:
        if all(getattr(self, c) is None for c in CRITERIA):
            raise InvalidSpec(f"a gate needs at least one of {', '.join(CRITERIA)}")
        if self.min_recovery is not None and self.min_recovery > 1:
            # A negative allowance: the gate would ask the quantized model to beat the baseline.
            raise InvalidSpec(
                f"min_recovery {self.min_recovery:g} is above 1, which asks the quantized model to beat the baseline; give at most 1"
            )
        if self.score_range is not None and not (math.isfinite(self.score_range[0]) and math.isfinite(self.score_range[1])):
            raise InvalidSpec(f"score_range {list(self.score_range)} must be two finite numbers, the lowest first")
        if self.score_range is not None and not self.score_range[0] < self.score_range[1]:
            raise InvalidSpec(f"score_range {list(self.score_range)} must name the lowest score first, then a higher one")
        return self

    def criteria(self) -> dict[str, float]:
        return {c: getattr(self, c) for c in CRITERIA if getattr(self, c) is not None}


def shorthand(value: object) -> list[object]:
    """One task's gates as a recipe or a policy file writes them, as a list: a bare number is a
    minimum recovery, one mapping a one-gate list. Anything else is left for the schema to refuse, with
    its place in the file."""
    items = value if isinstance(value, list) else [value]
    return [{"min_recovery": x} if isinstance(x, (int, float)) and not isinstance(x, bool) else x for x in items]


def normalize(value: object) -> list[GateSpec]:
    """A policy file's gate value (number, mapping or list of them) as GateSpecs; another kind of value is
    one error line (a policy file has no schema location to point at)."""
    out = []
    for item in shorthand(value):
        if isinstance(item, GateSpec):
            out.append(item)
        elif isinstance(item, dict):
            out.append(GateSpec.model_validate(item))
        else:
            raise InvalidSpec(f"a gate is a number (minimum recovery) or a mapping of {', '.join(CRITERIA)}; got {item!r}")
    return out


def parse_cli_gates(values: list[str]) -> dict[str, list[GateSpec]]:
    """`TASK=0.95`, `TASK:max_drop=0.02`, `TASK@acc_norm:min_recovery=0.9`; several per task combine."""
    merged: dict[tuple[str, str | None], dict] = {}
    for item in values:
        head, sep, number = item.partition("=")
        task, _, criterion = head.partition(":")
        task, _, metric = task.partition("@")
        criterion = criterion.strip() or "min_recovery"
        try:  # a score_range is LO,HI; everything else one number
            value = tuple(float(x) for x in number.split(",")) if criterion == "score_range" else float(number)
        except ValueError:
            sep = ""
        if sep and criterion == "score_range" and len(value) != 2:
            raise QserveError(f"--gate {item!r}: score_range is two numbers, the lowest score and the highest, e.g. 0,100")
        if not sep or not task.strip() or criterion not in (*CRITERIA, *SETTINGS):
            raise QserveError(
                f"--gate {item!r}: expected TASK[@METRIC][:CRITERION]=VALUE with CRITERION one of {', '.join(CRITERIA)} "
                f"(or the setting {' or '.join(SETTINGS)}), e.g. gsm8k=0.9, gsm8k_ppl:max_increase=0.05 or "
                "truthfulqa_gen@bleu_max:score_range=0,100"
            )
        key = (task.strip(), _metric_key(metric.strip()) if metric.strip() else None)
        merged.setdefault(key, {})[criterion] = value
    out: dict[str, list[GateSpec]] = {}
    for (task, metric), crit in merged.items():
        try:
            out.setdefault(task, []).append(GateSpec(metric=metric, **crit))
        except ValidationError as exc:
            raise QserveError(f"--gate for {task}: {exc.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    return out


def _metric_key(metric: str) -> str:
    return metric if "," in metric else f"{metric},none"


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
    if spec.cap is not None:
        _check_cap(task, spec, name)
    if spec.score_range is not None:
        _check_score_range(task, spec, name)


# Perplexities, by what lm-eval divides their log-likelihoods by: a gate bets per that unit, within a
# cap on one document's loss change per unit (gate/betting.py). lm-eval's `perplexity` (lambada's) is
# exp(-the mean log-likelihood of each item's target): per item.
PERPLEXITY_UNITS = {"word_perplexity": "word", "byte_perplexity": "byte", "bits_per_byte": "byte", "perplexity": "item"}


def allowed_rises(spec: GateSpec, name: str) -> dict[str, float]:
    """A corpus perplexity's criteria that rest on no measured baseline, as allowed relative rises of its
    perplexity: min_recovery r allows 1/r - 1, max_increase a allows a, and on bits_per_byte (log2 of
    byte perplexity) max_drop b bits allows 2^b - 1. Criteria left out are in the baseline's own units
    (max_drop in perplexity points; bits_per_byte's min_recovery and max_increase, shares of its bits)."""
    if name == "bits_per_byte":
        return {} if spec.max_drop is None else {"max_drop": 2**spec.max_drop - 1}
    rises = {"min_recovery": None if spec.min_recovery is None else 1 / spec.min_recovery - 1, "max_increase": spec.max_increase}
    return {c: rise for c, rise in rises.items() if rise is not None}


def _check_cap(task: str, spec: GateSpec, name: str) -> None:
    """A cap is a perplexity's, and must leave room above the allowed rise, or no bet could ever fail."""
    if name not in PERPLEXITY_UNITS:
        raise InvalidSpec(
            f"gate on {task}: cap bounds a perplexity's per-document loss change ({', '.join(PERPLEXITY_UNITS)}), not {name}"
        )
    if (rises := allowed_rises(spec, name)) and spec.cap <= math.log1p(top := max(rises.values())):
        raise InvalidSpec(
            f"gate on {task}: cap {spec.cap:g} nats per {PERPLEXITY_UNITS[name]} is at or below the allowed rise's "
            f"log(1 + {top:.4g}) = {math.log1p(top):.4g}; give a cap above it"
        )


def _check_score_range(task: str, spec: GateSpec, name: str) -> None:
    """A score range is a per-item score's, and must leave a drop the scores can exceed, or no bet could ever fail."""
    if name in PERPLEXITY_UNITS:
        raise InvalidSpec(f"gate on {task}: score_range is for per-item scores; {name} is bet on within its cap")
    lo, hi = spec.score_range  # check_allowance calls this only with one declared
    if spec.max_drop is not None and spec.max_drop >= hi - lo:
        raise InvalidSpec(
            f"gate on {task}: max_drop={spec.max_drop:g} on {name}, whose items score in [{lo:g}, {hi:g}], can never fail; "
            f"give a drop below {hi - lo:g}"
        )
    if (spec.min_recovery is not None or spec.max_increase is not None) and lo < 0:
        raise InvalidSpec(
            f"gate on {task}: a recovery or a relative increase of {name} needs scores of one sign; "
            f"its score_range [{lo:g}, {hi:g}] takes max_drop"
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
