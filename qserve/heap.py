"""Python's cyclic garbage collector around the libraries' long calls and heavy imports."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


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
