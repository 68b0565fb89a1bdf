"""qserve: quantize an LLM, gate its accuracy, and serve it on vLLM with matched arguments."""

__version__ = "0.1.0"
