"""Checkpoints on disk: the manifest (what produced it, how vLLM must load it, file hashes),
safetensors headers, hashing and signatures. Below the gate: it reads no record."""
