"""A private copy of a checkpoint to serve from, so that what qserve checked is what vLLM loads.

vLLM reads the weights tens of seconds after qserve has checked them. Served from the checkpoint
itself, a file replaced in between would be served unchecked. qserve instead copies the checkpoint
(all but its logs) into a directory of its own (mode 0700, under qserve's cache), hashing each file
as it writes it, and has vLLM load the copy, which is removed when serving ends (or by the next run,
if qserve was killed). The copy costs its size in disk, checked first, and one read of the checkpoint.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qserve.checkpoint.hashing import is_record, refuse_special_files
from qserve.errors import QserveError
from qserve.paths import cache_dir
from qserve.runtime.scratch import clean_stale, scratch_dir

CHUNK = 1 << 22
HEADROOM = 64 << 20  # beyond the files: the directory entries and whatever the server writes beside them


@contextmanager
def private_copy(ckpt: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """The checkpoint's files copied into a new private directory that lives as long as the block, and
    the SHA-256 of each copied file (records excluded), computed from the bytes written."""
    ckpt = ckpt.resolve()
    refuse_special_files(ckpt)
    files = [p for p in sorted(ckpt.rglob("*")) if p.is_file() and p.relative_to(ckpt).parts[0] != "logs"]
    target = cache_dir() / "serving" / ckpt.name
    target.parent.mkdir(parents=True, exist_ok=True)
    _check_space(ckpt, target.parent, sum(p.stat().st_size for p in files) + HEADROOM)
    clean_stale(target)
    copy = scratch_dir(target, "snapshot")
    try:
        hashes = {}
        for src in files:
            rel = src.relative_to(ckpt)
            digest = _copy_hashing(src, copy / rel)
            if not is_record(rel):
                hashes[str(rel)] = digest
        yield copy, hashes
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def _copy_hashing(src: Path, dst: Path) -> str:
    dst.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    with src.open("rb") as fin, dst.open("wb") as fout:
        for chunk in iter(lambda: fin.read(CHUNK), b""):
            h.update(chunk)
            fout.write(chunk)
    shutil.copystat(src, dst)
    return h.hexdigest()


def _check_space(ckpt: Path, where: Path, needed: int) -> None:
    free = shutil.disk_usage(where).free
    if free < needed:
        raise QserveError(
            f"serving {ckpt} needs a private copy of {needed / 2**30:.2f} GiB and {where} has {free / 2**30:.2f} GiB free; "
            "free space there or point QSERVE_CACHE_DIR at a larger disk"
        )
