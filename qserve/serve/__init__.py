"""Serve: vLLM's OpenAI server with the checkpoint's matched arguments, behind the gate record
(`server.serve`). Never imports the evaluation stack."""
