"""`qserve tune`: the smallest per-layer mix of schemes that passes the gate, decided in vLLM."""
