"""Quantize: recipes (pydantic models over YAML), calibration data, the llm-compressor and AMD
Quark backends, and the pipeline that writes a checkpoint with its manifest (`pipeline.quantize`).

A recipe's gates are parsed with qserve.evaluate.gates' schema; nothing else above the device
layer is imported.
"""
