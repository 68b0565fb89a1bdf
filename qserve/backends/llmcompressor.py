"""llm-compressor backend: recipe -> modifiers -> oneshot -> compressed-tensors checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qserve.recipe import Recipe

QUANTIZATION_METHOD = "compressed-tensors"  # vLLM's name for checkpoints this backend writes


def build_modifiers(recipe: Recipe) -> list[Any]:
    """The llm-compressor modifiers a qserve recipe stands for."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    scheme = preset_name_to_scheme(recipe.scheme, ["Linear"])
    if recipe.group_size is not None:
        scheme.weights.group_size = recipe.group_size
    modifiers: list[Any] = []
    if recipe.smoothquant is not None:
        modifiers.append(SmoothQuantModifier(smoothing_strength=recipe.smoothquant))
    quant_cls = GPTQModifier if recipe.algorithm == "gptq" else QuantizationModifier
    modifiers.append(quant_cls(config_groups={"group_0": scheme}, ignore=list(recipe.ignore)))
    return modifiers


def quantize(model_path: Path, recipe: Recipe, texts: list[str] | None, out_dir: Path, trust_remote_code: bool = False) -> None:
    """Run oneshot on the model and save the compressed checkpoint (weights + tokenizer) to out_dir."""
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qserve.calibration import tokenized_dataset

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto", trust_remote_code=trust_remote_code)
    kwargs: dict[str, Any] = {}
    if texts:
        seq_len = recipe.calibration.seq_len if recipe.calibration else 256
        kwargs.update(
            dataset=tokenized_dataset(texts, tokenizer, seq_len),
            num_calibration_samples=len(texts),
            max_seq_length=seq_len,
            # qserve already drew a seeded sample; keep its order so reruns are reproducible.
            shuffle_calibration_samples=False,
            # Layer by layer: calibration memory stays bounded by one decoder layer.
            pipeline="sequential",
        )
    oneshot(model=model, recipe=build_modifiers(recipe), **kwargs)
    model.save_pretrained(out_dir, save_compressed=True)
    tokenizer.save_pretrained(out_dir)
