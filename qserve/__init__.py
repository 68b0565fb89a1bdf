"""qserve: quantize an LLM, gate its accuracy, and serve it on vLLM with matched arguments."""

import os as _os

__version__ = "0.1.0"

# The environment qserve was started with, before any library in this process changed it (vLLM sets
# VLLM_* variables for its in-process engines): what a served vLLM may inherit is read from here.
STARTUP_ENVIRONMENT: dict[str, str] = dict(_os.environ)
