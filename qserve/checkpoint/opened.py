"""A checkpoint opened once per command: its manifest read and every file hashed against it, then
passed from step to step (`qserve run`: eval, then serve) instead of being read and hashed again."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qserve.checkpoint.manifest import Manifest, manifest_digest, read_manifest, verify_files


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    manifest: Manifest
    digest: str  # the manifest file's SHA-256, file hashes included: what gate decisions bind to
    # The source model's directory and digest when this command read them (quantize, or the reuse
    # check): the eval's baseline cache key takes them instead of reading the model again.
    source: tuple[Path, str] | None = None


def open_checkpoint(checkpoint: str | Path | Checkpoint) -> Checkpoint:
    """`checkpoint` as it is given, or opened: its files verified against its manifest (one read of each)."""
    if isinstance(checkpoint, Checkpoint):
        return checkpoint
    path = Path(checkpoint)
    manifest = read_manifest(path)
    verify_files(path, manifest)
    return Checkpoint(path, manifest, manifest_digest(path))
