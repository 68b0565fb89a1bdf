"""The engines qserve runs models in (vLLM, transformers) and the arguments they take."""
