"""qserve's records beside a checkpoint: atomic JSON/text writes, the eval record, the last output."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from qserve import paths
from qserve.checkpoint.manifest import CARD_NAME, EVAL_NAME, manifest_digest, read_manifest, verify_files
from qserve.errors import QserveError
from qserve.gate import policy as gate_policy
from qserve.gate.decisions import Gate, Status
from qserve.progress import info


def write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def write_text(path: Path, text: str) -> None:
    """Write through a temporary file so a crash never leaves half a record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # per process: concurrent writers never share one
    tmp.write_text(text)
    os.replace(tmp, path)


EVAL_SCHEMA_VERSION = 1


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Check(BaseModel):
    """A check beside the gate (engine parity, the KV cache's scales): its status and why; parity adds
    its measurements."""

    model_config = ConfigDict(extra="allow")
    status: Literal["pass", "fail", "skipped"]
    reason: str = ""


class Look(_Part):
    # None for evals that decide nothing (tune's search): they are no look at the weights
    number: int | None
    level: float
    earlier: list[dict[str, Any]]
    counted: bool
    weights: str | None = None
    history: list[dict[str, Any]] = []


class SupportClaim(_Part):
    runs: bool
    evidence: str
    needs: str | None = None
    serves: bool = False
    serve_evidence: str | None = None
    failure: str | None = None


class DeviceRecord(_Part):
    kind: str
    detail: str
    parallel: list[Any] = []


class EngineArgs(_Part):
    quantized: dict[str, Any]  # vllm.LLM's (or, emulated, lm-eval HFLM's) arguments
    baseline: dict[str, Any]


class BaselineModel(_Part):
    id: str
    path: str
    sha256: str


class BaselineCache(_Part):
    hits: list[str]
    misses: list[str]
    refresh: bool


class Waiver(_Part):
    accepted_by: str
    override: str = "--accept-gate-difference"
    policy: str | None = None
    differences: list[str]


class EvalRecord(BaseModel):
    """The schema of qserve_eval.json (what `qserve eval` decided), checked when written and read.

    serve, sign, inspect and the policy read the first four fields; the rest describe the run.
    Records written before `schema_version` existed are version 1.
    """

    model_config = ConfigDict(extra="forbid")
    manifest_sha256: str
    decided_at: str
    verdict: Status
    gates: list[Gate]
    schema_version: int = EVAL_SCHEMA_VERSION
    purpose: Literal["gate", "tune search"] = "gate"
    checkpoint: str | None = None
    parity: Check | None = None
    kv_cache: Check | None = None
    emulated: bool = False  # true: scores come from transformers, not vLLM
    engine: Literal["vllm", "transformers"] | None = None
    scoring: str | None = None  # qserve's lm-eval class by name and source hash; None: lm-eval's own
    vllm_support: SupportClaim | None = None
    decode: dict[str, float] | None = None
    scheme: str | None = None
    recipe: str | None = None
    tasks: list[str] | None = None
    limit: int | None = None
    offset: int = 0
    n_samples: dict[str, dict[str, int] | None] | None = None
    device: DeviceRecord | None = None
    engine_args: EngineArgs | None = None
    baseline_model: BaselineModel | None = None
    baseline_cache: BaselineCache | None = None
    versions: dict[str, str] | None = None
    timings: dict[str, float] | None = None
    look: Look | None = None
    request: dict[str, Any] | None = None  # what was asked, as reusable_eval compares it (a fingerprint)
    waivers: list[Waiver] | None = None  # gate differences an operator accepted (--accept-gate-difference)


def _checked(record: dict[str, Any], path: Path) -> dict[str, Any]:
    try:
        EvalRecord.model_validate(record)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "record"
        raise QserveError(f"{path} is not a qserve eval record ({where}: {first['msg']}); run `qserve eval` again") from None
    if record.get("schema_version", 1) > EVAL_SCHEMA_VERSION:
        raise QserveError(f"{path} was written by a newer qserve (schema {record['schema_version']}); upgrade qserve")
    return record


def write_eval(ckpt: Path, record: dict[str, Any]) -> None:
    """Write the eval record, checked against its schema first (a wrong record is a qserve bug, not a file)."""
    write_json(ckpt / EVAL_NAME, _checked({"schema_version": EVAL_SCHEMA_VERSION} | record, ckpt / EVAL_NAME))


def read_eval(ckpt: Path) -> dict[str, Any] | None:
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
    if result.get("manifest_sha256") != manifest_digest(ckpt):
        raise QserveError(
            f"the gate result in {ckpt} was decided for different checkpoint contents; run `qserve eval {ckpt}` again"
        )
    if result.get("purpose") == "tune search":
        raise QserveError(
            f"{ckpt}'s gate record is from a `qserve tune` search, which kept the best of several candidates on the same "
            f"items; its gate is the tune's confirmation on held-out items, or `qserve eval {ckpt}`"
        )
    if result.get("verdict") != "pass":
        raise QserveError(
            f"{ckpt} did not pass its accuracy gate (verdict: {result.get('verdict')}); see `qserve eval {ckpt}` (or pass --skip-gate)"
        )
    recipe = gate_policy.recipe_policy(read_manifest(ckpt).recipe)
    policy = gate_policy.read_policy(policy_file) if policy_file else recipe
    overrides = []
    accepted = gate_policy.check(result, policy, accept_difference)
    if accepted:
        overrides.append(_record_waiver(ckpt, result, by, "--accept-gate-difference", policy.source, accepted))
    below_recipe = gate_policy.differences(result, recipe) if policy_file else []
    if below_recipe:
        overrides.append(_record_waiver(ckpt, result, by, f"--policy {policy_file}", recipe.source, below_recipe))
    elif policy_file:
        overrides.append(f"--policy {policy_file} in place of the policy of {recipe.source} (the record meets both)")
    for line in overrides:
        info(f"warning: {line}")
    return GateCheck(str(result.get("decided_at")), (result.get("look") or {}).get("number"), overrides)


def _record_waiver(ckpt: Path, record: dict[str, Any], by: str, override: str, policy: str, differences: list[str]) -> str:
    """The operator served or signed a gate below a policy: say so in the record and the card, once."""
    from qserve.checkpoint.card import model_card

    line = f"{override}: below the policy of {policy}: {'; '.join(differences)}"
    waiver = {"accepted_by": by, "override": override, "policy": policy, "differences": differences}
    waivers = record.setdefault("waivers", [])
    if any(
        w.get("override", "--accept-gate-difference") == override and w["differences"] == differences and w["policy"] == policy
        for w in waivers
    ):
        return line  # already recorded (and perhaps signed): rewriting would break the signature
    waivers.append(waiver)
    write_eval(ckpt, record)
    write_text(ckpt / CARD_NAME, model_card(ckpt, read_manifest(ckpt), record))
    return line


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
