"""A private copy of a checkpoint to serve from, so that what qserve checked is what vLLM loads.

vLLM reads the weights tens of seconds after qserve has checked them. Served from the checkpoint
itself, a file replaced in between would be served unchecked. qserve instead copies the checkpoint
(all but its logs) into a directory of its own (mode 0700, under qserve's cache), checks the copy,
and has vLLM load the copy, which is removed when serving ends (or by the next run, if qserve was
killed). The copy costs disk and a read of the checkpoint; the kernel clones the data instead
where the filesystem can (copy_file_range).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qserve.checkpoint.manifest import refuse_special_files
from qserve.paths import cache_dir
from qserve.runtime.scratch import clean_stale, scratch_dir


@contextmanager
def private_copy(ckpt: Path) -> Iterator[Path]:
    """The checkpoint's files, copied into a new private directory that lives as long as the block."""
    ckpt = ckpt.resolve()
    refuse_special_files(ckpt)
    target = cache_dir() / "serving" / ckpt.name
    clean_stale(target)
    copy = scratch_dir(target, "snapshot")
    try:
        shutil.copytree(ckpt, copy, symlinks=True, dirs_exist_ok=True, ignore=lambda d, _: ["logs"] if Path(d) == ckpt else [])
        yield copy
    finally:
        shutil.rmtree(copy, ignore_errors=True)
