"""Which device vLLM uses here and what it offers (CPU flags, GPU capability); stdlib only."""
