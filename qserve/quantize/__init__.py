"""Quantize: recipes (pydantic models over YAML), calibration data, the llm-compressor and AMD
Quark backends, and the pipeline that writes a checkpoint with its manifest (`pipeline.quantize`).
A recipe's schema, its gates included, is qserve.spec's."""
