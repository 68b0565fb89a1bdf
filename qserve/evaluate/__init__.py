"""Evaluate: lm-eval on the checkpoint and its cached baseline in vLLM, engine parity, the baseline's
sanity check and the reports (`evaluation.evaluate`); the gate itself is qserve.gate."""
