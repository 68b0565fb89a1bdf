"""`qserve inspect`: what a checkpoint is, how big, how vLLM must load it, and its gate status."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qserve.checkpoint.manifest import manifest_digest, read_manifest, verify_files
from qserve.checkpoint.tensors import parameter_count, quantized_layer_bytes, weight_bytes
from qserve.errors import QserveError
from qserve.gate.card import vllm_serve_command
from qserve.gate.records import read_eval


def inspect_checkpoint(checkpoint: str | Path) -> dict[str, Any]:
    ckpt = Path(checkpoint)
    manifest = read_manifest(ckpt)
    try:
        verify_files(ckpt, manifest)
        integrity = "ok"
    except QserveError as exc:
        integrity = str(exc)
    src = _baseline_dir(manifest)
    size = weight_bytes(ckpt)
    base_size = weight_bytes(src) if src else None
    base_params = parameter_count(src) if src else None
    bf16 = 2 * base_params if base_params else None
    result = read_eval(ckpt)
    gate: dict[str, Any] = {"status": "not evaluated"}
    if result is not None:
        current = result.manifest_sha256 == manifest_digest(ckpt)
        gate = {
            "status": result.verdict if current else "stale (checkpoint changed since the gate)",
            "decided_at": result.decided_at,
            "tasks": result.tasks,
            "limit": result.limit,
            "parity": result.parity.status if result.parity else None,
            "emulated": result.emulated,
        }
    return {
        "checkpoint": str(ckpt.resolve()),
        "scheme": manifest.scheme,
        "recipe": manifest.recipe.name,
        "source_model": manifest.source_model["id"],
        "created_at": manifest.created_at,
        "size_bytes": size,
        "baseline_size_bytes": base_size,
        "bf16_size_bytes": bf16,
        "size_vs_baseline": round(size / base_size, 4) if base_size else None,
        "size_vs_bf16": round(size / bf16, 4) if bf16 else None,
        "quantized_layers": quantized_layer_bytes(ckpt),
        "vllm_args": manifest.vllm_args.model_dump(),
        "vllm_serve": vllm_serve_command(ckpt, manifest),
        "integrity": integrity,
        "gate": gate,
    }


def _baseline_dir(manifest) -> Path | None:
    """The source model on this machine, if it is here (never downloaded just to inspect)."""
    src = Path(manifest.source_model["path"])
    if src.is_dir():
        return src
    if manifest.source_model.get("source") == "embedded":
        from qserve.models.sources import embedded_model_dir

        return embedded_model_dir()
    return None


def format_inspection(info: dict[str, Any]) -> str:
    def mib(n: int | None) -> str:
        return "unknown" if n is None else f"{n / 2**20:.1f} MiB"

    g, q = info["gate"], info["quantized_layers"]
    lines = [
        f"checkpoint:   {info['checkpoint']}",
        f"scheme:       {info['scheme']} (recipe {info['recipe']}, from {info['source_model']}, made {info['created_at']})",
        f"size:         {mib(info['size_bytes'])}; baseline on disk {mib(info['baseline_size_bytes'])}"
        + (f" ({info['size_vs_baseline']:.2f}x)" if info["size_vs_baseline"] else "")
        + (f"; vs bf16 {mib(info['bf16_size_bytes'])} ({info['size_vs_bf16']:.2f}x)" if info["size_vs_bf16"] else ""),
        f"quantized:    {q['layers']} layers, {q['ratio']:.3f}x their bf16 bytes (weights, scales, zero points)",
        f"vLLM args:    {' '.join(f'{k}={v}' for k, v in info['vllm_args'].items())}",
        f"serve:        {' '.join(info['vllm_serve'])}",
        f"integrity:    {info['integrity']}",
        f"gate:         {g['status']}"
        + (
            f" (decided {g['decided_at']}, tasks {', '.join(g['tasks'] or [])}, parity {g['parity']})"
            if g.get("decided_at")
            else ""
        ),
    ]
    return "\n".join(lines)
