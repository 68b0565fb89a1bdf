"""`qserve reproduce`: re-run a checkpoint's recipe on its recorded model and calibration data and
compare every file; where a weight file differs, the largest difference of each tensor."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

from qserve import paths
from qserve.checkpoint.manifest import Manifest, library_versions, read_manifest, verify_files
from qserve.progress import info


def reproduce(checkpoint: str | Path, data_dir: str | Path | None = None, keep: Path | None = None) -> dict[str, Any]:
    """Quantize again exactly as the manifest records and compare the files byte for byte.

    The re-run is written to a scratch directory (to `keep` if given, else deleted afterwards).
    """
    from qserve.quantize.pipeline import QuantizeOptions, quantize

    ckpt = Path(checkpoint)
    manifest = read_manifest(ckpt)
    verify_files(ckpt, manifest)  # compare against what the manifest vouches for
    scratch = Path(tempfile.mkdtemp(prefix="reproduce-", dir=_scratch_root()))
    try:
        recipe = scratch / "recipe.yaml"
        execution = manifest.execution or {}
        recorded = manifest.recipe.model_dump(mode="json") | (
            {"execution": execution["path"]} if execution.get("path") in ("in_memory", "model_free") else {}
        )
        recipe.write_text(yaml.safe_dump(recorded, sort_keys=False))
        out = keep or scratch / ckpt.resolve().name
        info(f"re-running {ckpt}'s recipe into {out}")
        options = QuantizeOptions(
            model=_recorded_model(manifest),
            output=out,
            data_dir=data_dir,
            force=keep is not None and keep.exists(),
            trust_remote_code=manifest.vllm_args.trust_remote_code,
            remember=False,
            nproc=execution.get("nproc", 1),
        )
        again = quantize(recipe, options).manifest
        return compare(ckpt, manifest, out, again)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def compare(ckpt: Path, manifest: Manifest, out: Path, again: Manifest) -> dict[str, Any]:
    """Files by hash; differing safetensors by tensor; and what the run depended on, where it changed."""
    names = sorted(set(manifest.files) | set(again.files))
    files = {n: _file_status(manifest.files.get(n), again.files.get(n)) for n in names}
    tensors = {
        n: tensor_differences(ckpt / n, out / n)
        for n, status in files.items()
        if status == "differs" and n.endswith(".safetensors")
    }
    recorded = (manifest.calibration or {}).get("content_sha256")
    now = (again.calibration or {}).get("content_sha256")
    return {
        "checkpoint": str(ckpt),
        "bit_exact": all(s == "same" for s in files.values()),
        "files": files,
        "tensors": tensors,
        "calibration_data_same": recorded == now,
        "changed_environment": _changed(manifest.environment or {}, again.environment or {}),
        "changed_versions": _changed(manifest.versions, library_versions()),
    }


def tensor_differences(old: Path, new: Path) -> dict[str, float | str]:
    """Max |a - b| for every tensor that differs (in its stored units: integer codes, scales, ...)."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(old), load_file(new)
    out: dict[str, float | str] = {}
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            out[name] = "only in the re-run" if name in b else "missing in the re-run"
        elif a[name].shape != b[name].shape or a[name].dtype != b[name].dtype:
            out[name] = f"{a[name].dtype}{list(a[name].shape)} vs {b[name].dtype}{list(b[name].shape)}"
        elif not torch.equal(a[name], b[name]):
            out[name] = float((a[name].double() - b[name].double()).abs().max())
    return out


def format_reproduction(result: dict[str, Any]) -> str:
    files = result["files"]
    if result["bit_exact"]:
        return f"{result['checkpoint']}: bit-exact ({len(files)} files re-created with identical SHA-256)"
    lines = [f"{result['checkpoint']}: DIFFERS ({sum(s != 'same' for s in files.values())} of {len(files)} files)"]
    for name, status in files.items():
        if status != "same":
            lines.append(f"  {name}: {status}")
        for tensor, diff in (result["tensors"].get(name) or {}).items():
            lines.append(f"    {tensor}: " + (f"max |diff| {diff:.6g}" if isinstance(diff, float) else diff))
    if not result["calibration_data_same"]:
        lines.append("  the calibration texts differ from the recorded ones (data files changed?)")
    for key, (then, now) in (result["changed_environment"] | result["changed_versions"]).items():
        lines.append(f"  {key}: recorded {then}, now {now}")
    return "\n".join(lines)


def _file_status(recorded: str | None, now: str | None) -> str:
    if recorded is None:
        return "only in the re-run"
    if now is None:
        return "missing in the re-run"
    return "same" if recorded == now else "differs"


def _changed(then: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {k: (then.get(k), now.get(k)) for k in sorted(set(then) | set(now)) if then.get(k) != now.get(k)}


def _recorded_model(manifest: Manifest) -> str | None:
    """The embedded model by name (its converted copy lives in the cache); anything else by path."""
    source = manifest.source_model
    return None if source.get("source") == "embedded" else source.get("path") or source.get("id")


def _scratch_root() -> Path:
    root = paths.cache_dir() / "reproduce"
    root.mkdir(parents=True, exist_ok=True)
    return root
