"""glibc's malloc (mallopt(3)): the heap kept around vLLM-CPU's engines, and freed weights handed back
during offloaded quantization. Nothing changes where the user tuned malloc (MALLOC_* variables or
glibc.malloc tunables): their settings win."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Setting any mallopt parameter ends glibc's dynamic mmap threshold for the process (it rises to the
# largest block freed, up to 32 MiB, with twice that as trim threshold); after a block the thresholds
# are left where that rule takes them at most, not at their 128 KiB start.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
MMAP_MAX_AFTER, MMAP_THRESHOLD_AFTER, TRIM_THRESHOLD_AFTER = 65536, 32 << 20, 64 << 20
KEPT_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes a C int
RETURNED_THRESHOLD = 1 << 20


@contextmanager
def allocations_kept() -> Iterator[None]:
    """Freed memory stays in the heap for the block, for the next allocation to reuse: every allocation
    comes from the heap (M_MMAP_MAX 0) and the heap is not trimmed. Without it glibc maps each block
    above its threshold afresh and unmaps it when freed, so each vLLM-CPU step writes its large tensors
    into pages the kernel must fault in and zero again. At the end large allocations are mapped again
    and malloc_trim gives the freed pages back."""
    libc = _glibc_to_tune()
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD)
    try:
        yield
    finally:
        _thresholds_after(libc)
        libc.malloc_trim(0)


@contextmanager
def freed_blocks_returned() -> Iterator[None]:
    """Each freed block of 1 MiB or more goes back to the system at once in the block. By default glibc
    raises its mmap threshold to each large block freed, after which such blocks come from the heap,
    which seldom shrinks: offloaded quantization, which onloads and frees every weight in turn, would
    grow by about the weights' size."""
    libc = _glibc_to_tune()
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, RETURNED_THRESHOLD)
    try:
        yield
    finally:
        _thresholds_after(libc)


def _thresholds_after(libc: Any) -> None:
    libc.mallopt(M_MMAP_MAX, MMAP_MAX_AFTER)
    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_AFTER)
    libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_AFTER)


def _glibc_to_tune() -> Any:
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):  # not a GNU system
        glibc = ""
    user_tuned = any(k.startswith("MALLOC_") for k in os.environ) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")
    if not glibc.startswith("glibc") or user_tuned:
        return None
    return ctypes.CDLL(None)
