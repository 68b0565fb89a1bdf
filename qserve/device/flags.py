"""Users' vLLM flags against the checkpoint: a flag that contradicts what the checkpoint needs is an
error before any engine starts, never an override (`qserve eval --kv-cache-dtype`, `serve -- ...`)."""

from __future__ import annotations

import json
from pathlib import Path

from qserve.checkpoint.manifest import Manifest
from qserve.errors import QserveError


def required_kv_cache_dtype(ckpt: Path) -> str | None:
    """The kv_cache_dtype the checkpoint's own config demands: fp8 when it carries k/v scales.

    None without a config.json (the manifest's file hashes catch a missing one elsewhere).
    """
    path = ckpt / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text()).get("quantization_config") or {}
    has_scales = bool(config.get("kv_cache_scheme") or config.get("kv_cache_quant_config"))
    return "fp8" if has_scales else "auto"


# vLLM flags whose value the checkpoint decides, and the manifest field each must equal.
MATCHED_FLAGS = {"--quantization": "quantization", "-q": "quantization", "--kv-cache-dtype": "kv_cache_dtype", "--dtype": "dtype"}


def check_user_args(ckpt: Path, manifest: Manifest, requested: dict[str, str | None]) -> None:
    """A user flag (MATCHED_FLAGS -> value) that contradicts the checkpoint is an error before any engine starts.

    Also catches a manifest whose recorded kv_cache_dtype disagrees with the checkpoint's own config.
    """
    needed_kv = required_kv_cache_dtype(ckpt)
    if needed_kv is not None and manifest.vllm_args.kv_cache_dtype != needed_kv:
        raise QserveError(
            f"{ckpt}: the manifest records kv_cache_dtype {manifest.vllm_args.kv_cache_dtype}, but the checkpoint's config needs {needed_kv}; quantize it again"
        )
    for flag, value in requested.items():
        needed = getattr(manifest.vllm_args, MATCHED_FLAGS[flag])
        if value is not None and value != needed:
            raise QserveError(
                f"{flag} {value} contradicts the checkpoint, which needs {flag} {needed} (recorded in its manifest); drop the flag"
            )
