"""Checkpoints: what every part reads and writes.

The manifest (what produced a checkpoint, how vLLM must load it, file hashes), qserve's records
beside it (eval result, model card), the scheme vocabulary, source-model resolution, and
safetensors inspection. Imports only qserve's base modules (errors, paths, progress).
"""
