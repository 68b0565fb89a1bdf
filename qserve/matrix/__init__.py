"""The architecture x scheme matrix: tiny random-initialised models of the architectures users bring,
each quantized, loaded in vLLM beside transformers, and served (`qserve matrix`)."""
