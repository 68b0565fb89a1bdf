"""qserve's records beside a checkpoint: the eval record read and written
(its schema: schema.py), the gate check against a policy, signing, the last output."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from qserve import paths
from qserve.checkpoint.manifest import EVAL_NAME, manifest_digest, read_manifest, verify_files
from qserve.errors import QserveError
from qserve.gate.card import write_card
from qserve.gate.decisions import Gate, Status
from qserve.gate.policy import Policy, read_policy, recipe_policy
from qserve.gate.schema import EVAL_SCHEMA_VERSION, EvalRecord, Waiver
from qserve.paths import write_json
from qserve.progress import info
from qserve.spec.gates import GateSpec, allowed_degradation


def _checked(record: dict[str, Any], path: Path) -> EvalRecord:
    if record.get("schema_version", 1) > EVAL_SCHEMA_VERSION:
        raise QserveError(f"{path} was written by a newer qserve (schema {record['schema_version']}); upgrade qserve")
    try:
        return EvalRecord.model_validate(record)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "record"
        raise QserveError(f"{path} is not a qserve eval record ({where}: {first['msg']}); run `qserve eval` again") from None


def write_eval(ckpt: Path, record: EvalRecord) -> None:
    """Write the eval record: the fields it was given, as JSON (a record read back equals it)."""
    write_json(ckpt / EVAL_NAME, {"schema_version": EVAL_SCHEMA_VERSION} | record.model_dump(exclude_unset=True))


def read_eval(ckpt: Path) -> EvalRecord | None:
    """The checkpoint's `qserve eval` record (checked against its schema), None when it was never evaluated."""
    path = ckpt / EVAL_NAME
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise QserveError(f"{path} is corrupt; run `qserve eval` again") from None
    if not isinstance(record, dict):
        raise QserveError(f"{path} is corrupt; run `qserve eval` again")
    return _checked(record, path)


@dataclass(frozen=True)
class GateCheck:
    """What serve and sign found in a passing gate record: when it was decided, which look at the
    weights it was, and the overrides the operator used (for the serve log's first lines)."""

    decided_at: str
    look: int | None
    overrides: list[str]


def check_gate(ckpt: Path, policy_file: Path | None = None, accept_difference: bool = False, by: str = "serve") -> GateCheck:
    """Raise unless this exact checkpoint passed `qserve eval` with gates that meet its policy (the
    recipe's gates, or `policy_file`). A difference the operator accepts, and a policy file under
    which the record falls short of the recipe's own, are written into the eval record and the model
    card (once)."""
    result = read_eval(ckpt)
    if result is None:
        raise QserveError(f"{ckpt} has no accuracy gate result; run `qserve eval {ckpt}` first (or pass --skip-gate)")
    if result.manifest_sha256 != manifest_digest(ckpt):
        raise QserveError(
            f"the gate result in {ckpt} was decided for different checkpoint contents; run `qserve eval {ckpt}` again"
        )
    if result.purpose == "tune search":
        raise QserveError(
            f"{ckpt}'s gate record is from a `qserve tune` search, which kept the best of several candidates on the same "
            f"items; its gate is the tune's confirmation on held-out items, or `qserve eval {ckpt}`"
        )
    if result.verdict != Status.PASS:
        raise QserveError(
            f"{ckpt} did not pass its accuracy gate (verdict: {result.verdict}); see `qserve eval {ckpt}` (or pass --skip-gate)"
        )
    recipe = recipe_policy(read_manifest(ckpt).recipe)
    policy = read_policy(policy_file) if policy_file else recipe
    overrides = []
    accepted = check(result.gates, policy, accept_difference) + _options_differ(ckpt, result, recipe.source, accept_difference)
    if accepted:
        overrides.append(_record_waiver(ckpt, result, by, "--accept-gate-difference", policy.source, accepted))
    below_recipe = differences(result.gates, recipe) if policy_file else []
    if below_recipe:
        overrides.append(_record_waiver(ckpt, result, by, f"--policy {policy_file}", recipe.source, below_recipe))
    elif policy_file:
        overrides.append(f"--policy {policy_file} in place of the policy of {recipe.source} (the record meets both)")
    for line in overrides:
        info(f"warning: {line}")
    return GateCheck(result.decided_at, result.look.number if result.look else None, overrides)


def _options_differ(ckpt: Path, record: EvalRecord, source: str, accept_difference: bool) -> list[str]:
    """lm-eval options the recipe names that the record was made without: refused unless accepted."""
    from qserve.spec.lm_eval_args import lm_eval_differences

    named = lm_eval_differences(read_manifest(ckpt).recipe.lm_eval, record.request)
    if named and not accept_difference:
        raise QserveError(
            f"the gate record was made with other lm-eval options than {source} names: {'; '.join(named)} "
            f"(run `qserve eval {ckpt}` without overriding them, or pass --accept-gate-difference)"
        )
    return named


def _record_waiver(ckpt: Path, record: EvalRecord, by: str, override: str, policy: str, differences: list[str]) -> str:
    """The operator served or signed a gate below a policy: say so in the record and the card, once."""
    line = f"{override}: below the policy of {policy}: {'; '.join(differences)}"
    waiver = Waiver(accepted_by=by, override=override, policy=policy, differences=differences)
    waivers = record.waivers or []
    if any((w.override, w.differences, w.policy) == (override, differences, policy) for w in waivers):
        return line  # already recorded (and perhaps signed): rewriting would break the signature
    record.waivers = [*waivers, waiver]
    write_eval(ckpt, record)
    write_card(ckpt, read_manifest(ckpt), record)
    return line


def differences(gates: Sequence[Gate], policy: Policy) -> list[str]:
    """Where a gate record's gates fall short of the policy; empty when they meet it. Every task and
    metric the policy names must have been gated and met (with require_all_tasks: false, at least one);
    a gate with no signal on a named task is a difference the operator must accept."""
    found, evaluated = [], []
    for task, specs in policy.specs().items():
        for spec in specs:
            named = f"{task}{'@' + spec.metric if spec.metric else ''}"
            matching = [g for g in gates if g.task == task and _same_metric(g, spec)]
            mine = [g for g in matching if g.signal]
            evaluated += mine
            if not mine and len(matching) > len(mine):
                found.append(f"{named} was gated without signal ({matching[0].reason}): it decided nothing")
            elif not mine and policy.require_all_tasks:
                found.append(f"no gate on {named} (the policy requires {spec.criteria()})")
            found += [d for g in mine if (d := _shortfall(g, spec, policy))]
    if not evaluated and not found:
        found.append(f"no gate on any task the policy names ({', '.join(policy.gates)})")
    return found


def _same_metric(gate: Gate, spec: GateSpec) -> bool:
    """Exactly the metric the policy names; a policy gate without one means the task's headline metric
    (not whichever metric a record happens to hold, e.g. flexible-extract for strict-match)."""
    return gate.metric == spec.metric if spec.metric else gate.headline


def _shortfall(gate: Gate, spec: GateSpec, policy: Policy) -> str | None:
    name = f"{gate.task} {gate.metric}"
    if gate.status != "pass":
        return f"{name} did not pass ({gate.status})"
    items = gate.items or 0
    if items < policy.min_items:
        return f"{name} passed on {items} items, below the policy's minimum of {policy.min_items}"
    required = allowed_degradation(spec, gate.baseline, gate.higher_is_better)
    allowed = _record_allowance(gate)
    if required is not None and (allowed is None or allowed > required * (1 + 1e-9)):
        return f"{name} was gated at {gate.criteria}, looser than the policy's {spec.criteria()}"
    return None


def _record_allowance(gate: Gate) -> float | None:
    """The allowance the record was decided with: the larger of the one it states and the one its criteria give."""
    try:
        from_criteria = allowed_degradation(GateSpec(**gate.criteria), gate.baseline, gate.higher_is_better)
    except (ValidationError, QserveError, TypeError):
        return None
    if from_criteria is None or gate.allowed_degradation is None:
        return None
    return max(from_criteria, gate.allowed_degradation)


def check(gates: Sequence[Gate], policy: Policy, accept: bool) -> list[str]:
    """Raise on a shortfall unless `accept`; returns the accepted differences (empty when none)."""
    found = differences(gates, policy)
    if found and not accept:
        raise QserveError(
            f"the gate record does not meet the policy of {policy.source}: {'; '.join(found)} "
            "(re-run `qserve eval` with the policy's gates and --limit, or pass --accept-gate-difference)"
        )
    return found


def resolve_checkpoint(checkpoint: str | Path | None) -> Path:
    """The given checkpoint, else the most recent output of `qserve quantize`."""
    if checkpoint is not None:
        return Path(checkpoint)
    marker = paths.last_checkpoint_file()
    if not marker.is_file():
        raise QserveError("no checkpoint given and no previous `qserve quantize` output found; pass CHECKPOINT")
    last = Path(marker.read_text().strip())
    if not last.is_dir():
        raise QserveError(f"the last `qserve quantize` output {last} no longer exists; pass CHECKPOINT")
    info(f"using the most recent checkpoint: {last}")
    return last


def sign(
    ckpt: Path, private_key: Path, password: str | None = None, policy: Path | None = None, accept_gate_difference: bool = False
) -> Path:
    """Sign a checkpoint whose files match its manifest and whose gate passed and meets its policy;
    returns the signature path."""
    from qserve.checkpoint.signing import write_signature

    verify_files(ckpt, read_manifest(ckpt))
    check_gate(ckpt, policy, accept_gate_difference, by="sign")
    return write_signature(ckpt, private_key, password)
