"""Source models as users hold them: Hugging Face directories, hub ids, GGUF files."""
