"""Evaluate and gate: lm-eval on the checkpoint and its cached baseline, engine parity,
noise-aware gate decisions and reports (`evaluation.evaluate`).

Imports the base modules, qserve.checkpoint and qserve.device; never qserve.quantize or
qserve.serve.
"""
