"""Where qserve keeps its state (the converted default model, the last checkpoint) and how it writes
files whole."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from qserve.errors import QserveError


def write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def write_text(path: Path, text: str) -> None:
    """Write through a temporary file so a crash never leaves half a record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # per process: concurrent writers never share one
    tmp.write_text(text)
    os.replace(tmp, path)


def cache_dir() -> Path:
    """QSERVE_CACHE_DIR, else $XDG_CACHE_HOME/qserve, else ~/.cache/qserve."""
    explicit = os.environ.get("QSERVE_CACHE_DIR")
    if explicit:
        path = Path(explicit).expanduser()
        if path.exists() and not path.is_dir():
            raise QserveError(f"QSERVE_CACHE_DIR={explicit} is not a directory; point it at a directory qserve may create or use")
        return path
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


def pending_log(name: str, pid: int) -> Path:
    """The log of process `pid`'s `name` step (e.g. quantize) while its checkpoint does not exist yet."""
    return cache_dir() / "logs" / f"{name}-{pid}.log"


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


def open_log(path: Path) -> int:
    """A descriptor for this run's log at `path`: write-only, emptied, mode 0600, never through a
    symbolic or hard link (a link planted at logs/ would have qserve truncate the file it names)."""
    if path.parent.is_symlink():
        raise QserveError(f"{path.parent} is a symbolic link; qserve writes logs only into a real directory: remove it")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise QserveError(f"log file {path} is a symbolic link; qserve does not write through links: remove it") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise QserveError(f"log file {path} is not a plain file of its own (a hard link or a device); remove it")
    os.fchmod(fd, 0o600)
    os.ftruncate(fd, 0)
    return fd
