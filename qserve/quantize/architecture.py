"""What the model's own config says a recipe must respect, checked before any calibration: the dtype
vLLM will accept for this architecture, and the smoothing mappings (SmoothQuant, AWQ) resolved on the
model's skeleton by llm-compressor itself, so a pair that cannot work is refused with the library's
message instead of failing mid-run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qserve.errors import QserveError
from qserve.progress import info
from qserve.spec.recipe import Recipe
from qserve.support.claims import float16_refusal


def model_config(model_path: Path) -> dict[str, Any]:
    return json.loads((Path(model_path) / "config.json").read_text())


def serving_dtype(model_path: Path, recipe: Recipe, scheme_dtype: str) -> str:
    """The dtype vLLM will run the checkpoint in: the recipe's, else the scheme's usual one, except
    that float16 becomes bfloat16 for an architecture vLLM refuses float16 for (its own table)."""
    if recipe.dtype is not None:
        return recipe.dtype
    reason = float16_refusal(_model_type(model_path)) if scheme_dtype == "float16" else None
    if reason:
        info(f"note: dtype bfloat16, not float16: vLLM refuses float16 for {_model_type(model_path)} ({reason})")
        return "bfloat16"
    return scheme_dtype


def check_dtype(model_path: Path, recipe: Recipe) -> None:
    """A recipe that asks for float16 on an architecture vLLM refuses it for: refused before the work."""
    model_type = _model_type(model_path)
    reason = float16_refusal(model_type) if recipe.dtype == "float16" else None
    if reason:
        raise QserveError(
            f"vLLM refuses dtype float16 for {model_type} models ({reason}); set `dtype: bfloat16` in the recipe or remove it"
        )


def _model_type(model_path: Path) -> str:
    config = model_config(model_path)
    return (config.get("text_config") or {}).get("model_type") or config.get("model_type", "")


def check_mappings(model_path: Path, recipe: Recipe, trust_remote_code: bool = False) -> None:
    """Resolve the recipe's SmoothQuant and AWQ mappings on the model's skeleton (meta device, MoE
    experts linearized, the recipe's quantization targets applied), as llm-compressor will at
    calibration; refuse a mapping it cannot match, and an AWQ that would smooth nothing."""
    if recipe.modifiers is not None or (recipe.smoothquant is None and recipe.algorithm != "awq"):
        return
    from compressed_tensors.quantization import apply_quantization_config

    from qserve.quantize.backends.llmcompressor import build_modifiers, first_line

    model = _skeleton(model_path, trust_remote_code)
    arch = type(model).__name__
    modifiers = build_modifiers(recipe, model)
    # AWQ smooths only the layers the quantization targets; the last modifier is the quantizing one.
    apply_quantization_config(model, modifiers[-1].resolve_quantization_config())
    for modifier in modifiers:
        name = type(modifier).__name__.removesuffix("Modifier")
        if name not in ("SmoothQuant", "AWQ"):
            continue
        try:
            resolved = _resolve(modifier, model)
        except Exception as exc:  # the library's ValueError / RuntimeError on mappings it cannot match
            raise QserveError(
                f"{name} cannot run on {arch}: llm-compressor could not match its smoothing mappings to the "
                f"model's layers ({first_line(exc)}); choose a recipe without {name.lower()}"
            ) from None
        if not resolved:
            raise QserveError(
                f"{name} would smooth nothing on {arch}: none of its mappings matches the layers the recipe quantizes"
            )


def _resolve(modifier: Any, model: Any) -> list[Any]:
    """The modifier's mappings resolved on `model` by llm-compressor's own code (raises as it would)."""
    if type(modifier).__name__ == "SmoothQuantModifier":
        modifier.ignore = list(modifier.ignore or [])
        modifier.mappings = modifier._infer_mappings_from_model(model)
        return modifier._resolve_mappings(model)
    from llmcompressor.modifiers.transform.awq.dynamic_mappings import get_layer_mappings_from_model

    modifier.mappings = modifier.mappings or get_layer_mappings_from_model(model)
    modifier._set_resolved_mappings(model)
    return modifier._resolved_mappings


def _skeleton(model_path: Path, trust_remote_code: bool) -> Any:
    """The model on the meta device (no weights allocated), MoE experts swapped for llm-compressor's
    own linearized experts class as oneshot does (built empty: its copy-in needs real tensors)."""
    import torch
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
    from llmcompressor.modeling.moe.linearize import get_non_linearized_moes
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        for name, module in get_non_linearized_moes(model):
            linear = LinearExperts2D.get_linear_experts_cls(module.__class__)
            model.set_submodule(name, linear(getattr(module, "config", model.config)))
    return model


def with_routers_ignored(model_path: Path, recipe: Recipe, trust_remote_code: bool = False) -> Recipe:
    """The recipe with every MoE router that is a Linear layer (so "Linear" targets would quantize it)
    added to its ignore list, as one pattern per position in the layer; the manifest records the result."""
    import re

    from qserve.quantize.experts import ROUTER_NAME_ENDS, moe_summary

    if recipe.modifiers is not None or recipe.scheme is None or moe_summary(model_path, trust_remote_code) is None:
        return recipe
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(ROUTER_NAME_ENDS)]
    patterns = list(dict.fromkeys("re:" + re.sub(r"\\.\d+\\.", r"\\.\\d+\\.", re.escape(n)) + "$" for n in names))
    added = [p for p in patterns if p not in recipe.ignore]
    if not added:
        return recipe
    info(f"note: {len(names)} MoE router Linear layer(s) stay unquantized (ignore {', '.join(added)})")
    return recipe.model_copy(update={"ignore": [*recipe.ignore, *added]})
