"""Directories a run makes for itself and removes when it ends: a quantize run's partial output beside
its target, `qserve serve`'s private snapshot of the checkpoint it serves.

Each is named `.<name>.<kind>-<pid>-<random>`, so the next run can tell what a killed run left (its
process has ended) from a concurrent run's work (its process still runs).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import tempfile
from pathlib import Path

from qserve.progress import info

KINDS = ("partial", "old", "snapshot")


def scratch_dir(out: Path, kind: str) -> Path:
    """A new, empty directory beside `out`, tagged with this process's id (mode 0700)."""
    assert kind in KINDS
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.{kind}-{os.getpid()}-", dir=out.parent))


def clean_stale(out: Path) -> None:
    """Remove what killed runs left beside `out`; a checkpoint a killed `--force` had moved aside
    (a filesystem without atomic exchange) is put back when nothing took its place."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.({'|'.join(KINDS)})-(\d+)-.*")
    for path in sorted(out.parent.glob(f".{out.name}.*")):
        match = pattern.fullmatch(path.name)
        if match is None or _alive(int(match[2])):
            continue
        if match[1] == "old" and not out.exists():
            path.rename(out)
            info(f"restored {out}: a killed run had moved it aside to {path.name}")
            continue
        shutil.rmtree(path, ignore_errors=True)
        info(f"removed {path}: left by run {match[2]}, which ended before it finished")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


_RENAME_EXCHANGE = 2  # linux/fs.h


def exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux renameat2 RENAME_EXCHANGE); False where the
    filesystem or kernel cannot, and nothing was changed."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))
