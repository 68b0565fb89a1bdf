"""Serve: vLLM's OpenAI server with the checkpoint's matched arguments, behind the gate record
(`server.serve`), and its load benchmark (`bench`).

Imports the base modules, qserve.checkpoint and qserve.device; never the evaluation stack.
"""
