"""Every SHA-256 qserve computes over files: a checkpoint's (its manifest records them, serve and
sign check them), a source model's (quantize and the baseline cache key on it), JSON keys.

Stdlib only, so quantize, eval, serve and sign all use this one module without importing each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from qserve.checkpoint.layout import MANIFEST_NAME, RECORD_DIRS, RECORD_NAMES
from qserve.errors import QserveError


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def hashed_paths(directory: Path) -> list[Path]:
    """Every file in `directory` except qserve's own records (RECORD_NAMES at the top, RECORD_DIRS)."""
    return [p for p in sorted(directory.rglob("*")) if p.is_file() and not is_record(p.relative_to(directory))]


def is_record(rel: Path) -> bool:
    """Whether a checkpoint's file (relative path) is one of qserve's own records, which no hash covers."""
    # paths.write_text writes "<record>.<pid>.tmp" first; one left by a crash is still a record's
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


def manifest_digest(directory: Path) -> str:
    """Identity of a checkpoint: the manifest file's bytes, file hashes included. Gate decisions bind to it."""
    return sha256_file(directory / MANIFEST_NAME)


def sha256_json(obj: Any) -> str:
    """A stable digest of a JSON-able value (keys sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def model_digest(model_dir: Path) -> str:
    """SHA-256 over a model's files, read in full every time: a size and mtime can be kept while
    the content changes, and a ctime moves only at the clock's coarse tick, so no memo stands in for
    the bytes."""
    return sha256_json({str(p.relative_to(model_dir)): sha256_file(p) for p in hashed_paths(model_dir)})
