"""qserve's records beside a checkpoint: atomic JSON/text writes, the eval record, the last output."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from qserve import paths
from qserve.checkpoint.manifest import EVAL_NAME, manifest_digest
from qserve.errors import QserveError
from qserve.progress import info


def write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def write_text(path: Path, text: str) -> None:
    """Write through a temporary file so a crash never leaves half a record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # per process: concurrent writers never share one
    tmp.write_text(text)
    os.replace(tmp, path)


def read_eval(ckpt: Path) -> dict[str, Any] | None:
    """The checkpoint's `qserve eval` record, None when it was never evaluated."""
    path = ckpt / EVAL_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise QserveError(f"{path} is corrupt; run `qserve eval` again") from None


def check_gate(ckpt: Path) -> str:
    """Raise unless this exact checkpoint passed `qserve eval`; returns when it was decided."""
    result = read_eval(ckpt)
    if result is None:
        raise QserveError(f"{ckpt} has no accuracy gate result; run `qserve eval {ckpt}` first (or pass --skip-gate)")
    if result.get("manifest_sha256") != manifest_digest(ckpt):
        raise QserveError(
            f"the gate result in {ckpt} was decided for different checkpoint contents; run `qserve eval {ckpt}` again"
        )
    if result.get("verdict") != "pass":
        raise QserveError(
            f"{ckpt} did not pass its accuracy gate (verdict: {result.get('verdict')}); see `qserve eval {ckpt}` (or pass --skip-gate)"
        )
    return str(result.get("decided_at"))


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
