"""The device layer: which device vLLM uses, how qserve starts its engine there, and what runs.

Device detection, engine settings, the measured support matrix, user-flag checks, probes,
`qserve doctor` and vLLM's CLI shim. Imports only the base modules and qserve.checkpoint.
"""
