"""Where qserve keeps its state: the converted default model and the last checkpoint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from qserve.errors import QserveError


def cache_dir() -> Path:
    """QSERVE_CACHE_DIR, else $XDG_CACHE_HOME/qserve, else ~/.cache/qserve."""
    explicit = os.environ.get("QSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qserve"


def last_checkpoint_file() -> Path:
    return cache_dir() / "last_checkpoint"


def remember_checkpoint(path: Path) -> None:
    target = last_checkpoint_file()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(str(path.resolve()) + "\n")


def data_dir(explicit: str | Path | None = None) -> Path:
    """Root that relative data paths (calibration files, eval data) resolve against.

    --data-dir, else QSERVE_DATA_DIR, else the current directory.
    """
    chosen = explicit or os.environ.get("QSERVE_DATA_DIR") or "."
    return Path(chosen).expanduser().resolve()


def project_data(name: str) -> Path:
    """A data folder shipped with qserve (evals/, recipes/): inside the wheel or the repo."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_data" / name, here.parent / name):
        if candidate.is_dir():
            return candidate
    raise QserveError(f"qserve's {name}/ folder is missing from the installation")


def keep_log(log: Path, ckpt: Path, name: str) -> Path:
    """Move a log written before `ckpt` existed to `<checkpoint>/logs/<name>.log` (logs are not hashed)."""
    target = log_file(ckpt, name)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(log, target)
    return target


def log_file(ckpt: Path, name: str) -> Path:
    """`<checkpoint>/logs/<name>.log`; under the cache when the checkpoint cannot be written."""
    logs = ckpt.resolve() / "logs"
    if os.access(logs if logs.is_dir() else ckpt.resolve(), os.W_OK):
        return logs / f"{name}.log"
    return cache_dir() / "logs" / ckpt.resolve().name / f"{name}.log"
