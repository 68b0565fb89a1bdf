"""Python's cyclic garbage collector around the libraries' long calls and heavy imports (gc's public
freeze and disable, nothing patched)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """The objects alive now (imported modules, a loaded model) move to Python's permanent generation
    for the block, so each full `gc.collect()` the libraries run inside it (AutoRound and Quark after
    every block they quantize, vLLM at each engine start and stop) scans only what the block creates.
    Garbage already there is collected first, not kept frozen; the block's end unfreezes."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic collection in the block: for importing the heavy libraries, which create almost no
    garbage yet grow the heap so fast that Python runs a full collection each time it grows by a
    quarter, each one longer than the last."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
