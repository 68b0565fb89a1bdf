"""AMD Quark backend: LLMTemplate config -> ModelQuantizer -> export_safetensors (quant_method "quark").

CPU settings found here (README, "Quark on CPU"): the model is quantized in float32, because
Quark's MXFP4 fake-quantization picks a CUDA-only kernel for half-precision tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qserve.errors import QserveError
from qserve.runtime.heap import collection_paused, frozen_heap
from qserve.schemes.backends import BACKENDS
from qserve.schemes.catalog import SCHEMES, scheme_of_quark_checkpoint
from qserve.spec.recipe import Recipe


def template_name(model_path: Path, trust_remote_code: bool = False) -> str:
    """Quark's LLMTemplate for the model's architecture (its config's model_type)."""
    from quark.torch import LLMTemplate
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).model_type
    available = LLMTemplate.list_available()
    if model_type not in available:
        raise QserveError(f"Quark has no LLMTemplate for model type {model_type!r}; it knows: {', '.join(available)}")
    return model_type


def build_config(recipe: Recipe, model_type: str) -> Any:
    from quark.torch import LLMTemplate

    # Quark names carry the group size (int4_wo_64); 128 is the compressed-tensors preset's too.
    name = SCHEMES[recipe.scheme].backends["quark"].format(group_size=recipe.group_size or 128)
    return LLMTemplate.get(model_type).get_config(
        scheme=name,
        kv_cache_scheme=recipe.kv_cache.dtype if recipe.kv_cache else None,
        exclude_layers=list(recipe.ignore),
    )


def quantize(
    model_path: Path, recipe: Recipe, texts: list[str] | None, out_dir: Path, trust_remote_code: bool = False
) -> tuple[str, None]:
    """Quantize with Quark in float32 and export safetensors to out_dir; returns the scheme (and no
    expert counts: qserve calibrates mixtures of experts through llm-compressor only)."""
    with collection_paused():
        import torch
        from quark.torch import ModelQuantizer, export_safetensors
        from transformers import AutoModelForCausalLM, AutoTokenizer

    config = build_config(recipe, template_name(model_path, trust_remote_code))
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, trust_remote_code=trust_remote_code)
    model.eval()
    seq_len = recipe.seq_len
    # One sample per batch: Quark iterates the dataloader and calls the model on each item.
    batches = [tokenizer(t, return_tensors="pt", truncation=True, max_length=seq_len)["input_ids"] for t in texts or []]
    quantizer = ModelQuantizer(config)
    with torch.no_grad(), frozen_heap():
        model = quantizer.quantize_model(model, batches or None)
        model = quantizer.freeze(model)
        export_safetensors(model, out_dir)
    tokenizer.save_pretrained(out_dir)
    return exported_scheme(out_dir, recipe), None


def exported_scheme(out_dir: Path, recipe: Recipe) -> str:
    """The scheme read back from Quark's export; it must be the one the recipe asked for."""
    config = json.loads((out_dir / "config.json").read_text()).get("quantization_config", {})
    method = config.get("quant_method")
    if method != BACKENDS["quark"].vllm_quantization:
        raise QserveError(f"Quark exported quant_method {method!r}, not 'quark'; vLLM's Quark loader would not recognise it")
    found = scheme_of_quark_checkpoint(config)
    if found != recipe.scheme:
        raise QserveError(f"Quark wrote a {found or 'unrecognised'} checkpoint, but the recipe asked for {recipe.scheme}")
    return found
