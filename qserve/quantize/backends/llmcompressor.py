"""llm-compressor backend: recipe -> modifiers -> oneshot -> compressed-tensors checkpoint."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from qserve.errors import QserveError
from qserve.runtime.heap import collection_paused, frozen_heap
from qserve.schemes.catalog import SCHEMES, scheme_of_checkpoint
from qserve.spec.recipe import Recipe


def build_modifiers(recipe: Recipe, model: Any = None, batch_gptq: bool = False) -> Any:
    """The llm-compressor modifiers a qserve recipe stands for (a plain recipe's own, as YAML);
    `model` (loaded) is needed by a sparsity recipe only. `batch_gptq`: GPTQ quantizes same-shape
    layers together (gptq_batch_size) unless the recipe's algorithm_options say otherwise."""
    if recipe.modifiers is not None:
        return _checked_plain_recipe(recipe.modifiers)
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.modifiers.transform import AWQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    quant: dict[str, Any] = {"config_groups": config_groups(recipe), "ignore": list(recipe.ignore)}
    if recipe.kv_cache is not None:
        # Static per-tensor FP8 k/v scales, observed on the calibration data: vLLM's k_scale/v_scale.
        quant["kv_cache_scheme"] = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    options = dict(recipe.algorithm_options)
    if batch_gptq and recipe.algorithm == "gptq":
        options.setdefault("batched_quantization", gptq_batch_size(model))
    modifiers: list[Any] = []
    try:
        if recipe.smoothquant is not None:
            mappings = SMOOTHQUANT_MAPPINGS.get(type(model).__name__) if model is not None else None
            modifiers.append(
                SmoothQuantModifier(smoothing_strength=recipe.smoothquant, **({"mappings": mappings} if mappings else {}))
            )
        if recipe.sparsity is not None:
            modifiers.append(_sparsegpt(recipe, model))
        if recipe.algorithm == "awq":
            # Current llm-compressor: AWQ only smooths; a quantization modifier after it quantizes.
            mappings = awq_mappings(type(model).__name__) if model is not None else None
            modifiers.append(AWQModifier(**({"mappings": mappings} if mappings else {}), **options))
            options = {}
        modifiers.append(_quantizing_modifier(recipe.algorithm)(**quant, **options))
    except (TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise QserveError(f"algorithm_options for {recipe.algorithm}: {first_line(exc)}") from None
    return modifiers


# Architectures llm-compressor's AWQ registry lacks whose layers have the structure of one it has.
# OLMo 2 normalizes after attention and after the MLP, with no norm before either, like OLMo 3 (whose
# entry smooths only v_proj -> o_proj and up_proj -> down_proj, the pairs with no norm between them).
# Mixtral's decoder layer is Qwen3-MoE's (mlp.gate router, mlp.experts): without the MoE entry the
# default mappings smooth post_attention_layernorm without balancing the router, which reads the same
# activations, so routing would change.
AWQ_SAME_LAYERS_AS = {"Olmo2ForCausalLM": "Olmo3ForCausalLM", "MixtralForCausalLM": "Qwen3MoeForCausalLM"}


# SmoothQuant mappings where llm-compressor's registry gives the default ones to a model they do not fit.
# Gemma 2 and 3 norm each sublayer's output too ("sandwich" norms): post_attention_layernorm scales
# attention's output into the residual, and the MLP reads pre_feedforward_layernorm, so the default
# pair (post_attention_layernorm -> gate/up) would change the model. (Their norms scale by 1 + weight;
# llm-compressor's oneshot folds a scale into them as (1 + w) / s - 1 itself: modeling/offset_norm.py.)
_SANDWICH = [
    (["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"], "re:.*input_layernorm$"),
    (["re:.*gate_proj$", "re:.*up_proj$"], "re:.*pre_feedforward_layernorm$"),
]
SMOOTHQUANT_MAPPINGS = {"Gemma2ForCausalLM": _SANDWICH, "Gemma3ForCausalLM": _SANDWICH}


def awq_mappings(arch: str) -> Any:
    """qserve's AWQ mappings for an architecture llm-compressor's registry lacks; None: the registry's own."""
    if arch not in AWQ_SAME_LAYERS_AS:
        return None
    from llmcompressor.modifiers.transform.awq.mappings import AWQ_MAPPING_REGISTRY

    return AWQ_MAPPING_REGISTRY[AWQ_SAME_LAYERS_AS[arch]]


def _quantizing_modifier(algorithm: str) -> type:
    """The llm-compressor modifier that quantizes with `algorithm` (AWQ smooths first, then rtn)."""
    if algorithm == "gptq":
        from llmcompressor.modifiers.gptq import GPTQModifier

        return GPTQModifier
    if algorithm == "autoround":
        from llmcompressor.modifiers.autoround import AutoRoundModifier

        return AutoRoundModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return QuantizationModifier


def gptq_batch_size(model: Any) -> int:
    """How many same-shape layers (q and o, k and v, gate and up; a MoE layer's experts) GPTQ
    quantizes at once: as many as fit, together, in a quarter of the model's weights held in float32,
    GPTQ's precision (so a bfloat16 model gets the batches its float32 copy would).

    llm-compressor's default ("auto") sizes batches from free CUDA memory and quantizes one layer at
    a time on a CPU. Batching does not change a bit (tests/test_quantize.py checks it against unbatched
    llm-compressor on every run); it shortens GPTQ's per-column loop for W4A16 by about a third and
    leaves W8A8's unchanged. The size is a function of the model alone, so the recipe.yaml it is
    recorded in is the same on every run."""
    import torch

    shapes = Counter(tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear))
    repeated = [shape for shape, n in shapes.items() if n > 1]  # a one-off shape (lm_head) has no partner
    if not repeated:
        return 1
    # A layer's float32 working set: its weight three times (module, stacked copy, error) and its
    # Hessian three times (stacked, and both gathers of activation ordering).
    each = max(4 * (3 * out * inp + 3 * inp * inp) for out, inp in repeated)
    budget = sum(p.numel() for p in model.parameters())  # a quarter of 4 bytes a weight: 1 byte each
    return max(1, budget // each)


def _sparsegpt(recipe: Recipe, model: Any) -> Any:
    """SparseGPT to N:M (2:4: half the weights, two in each run of four along the input dim) on the
    Linears inside the decoder layers. Targeting "Linear" itself would make each Linear its own
    "layer", named with a trailing dot ("lm_head."), which an ignore entry "lm_head" does not match:
    tried, it pruned SmolLM2's lm_head and so its tied embeddings."""
    from llmcompressor.modifiers.pruning.sparsegpt import SparseGPTModifier
    from llmcompressor.utils.pytorch.module import infer_sequential_targets

    from qserve.quantize.sparsity import n_of_m

    n, m = n_of_m(recipe.sparsity)
    layers = infer_sequential_targets(model)
    return SparseGPTModifier(sparsity=1 - n / m, mask_structure=recipe.sparsity, targets=layers, ignore=list(recipe.ignore))


def config_groups(recipe: Recipe) -> dict[str, Any]:
    """compressed-tensors config groups: the recipe's scheme on every Linear, and one group per
    override; a layer named by an override's regex takes that group (a name match beats the class
    match, in compressed-tensors and in vLLM alike)."""
    from compressed_tensors.quantization import preset_name_to_scheme

    def group(scheme: str, group_size: int | None, targets: list[str]) -> Any:
        preset = preset_name_to_scheme(SCHEMES[scheme].backends["llmcompressor"], targets)
        if group_size is not None:
            preset.weights.group_size = group_size
        return preset

    groups = {"group_0": group(recipe.scheme, recipe.group_size, ["Linear"])}
    for i, o in enumerate(recipe.overrides, start=1):
        groups[f"group_{i}"] = group(o.scheme, o.group_size, list(o.targets))
    return groups


def first_line(exc: Exception) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return " ".join(lines[:3]) if lines else type(exc).__name__


def _checked_plain_recipe(modifiers: dict[str, Any]) -> str:
    """Validate an llm-compressor recipe with llm-compressor itself; return it as YAML for oneshot."""
    import yaml

    text = yaml.safe_dump(modifiers, sort_keys=False)
    if not _instantiate(text):
        # llm-compressor reads modifiers only inside a stage; at the top level it finds none, silently.
        raise QserveError(
            "llm-compressor found no modifiers in the recipe's `modifiers:`; put them inside a stage, e.g. "
            "modifiers: {quant_stage: {quant_modifiers: {QuantizationModifier: {...}}}}"
        )
    return text


def _instantiate(text: str) -> list[Any]:
    from llmcompressor.recipe import Recipe as LlmcRecipe

    try:
        return list(LlmcRecipe.create_instance(text).modifiers)
    except Exception as exc:  # llm-compressor raises ValueError, KeyError, pydantic errors
        raise QserveError(f"llm-compressor rejected the recipe's modifiers: {first_line(exc)}") from None


def modifiers_need_data(modifiers: dict[str, Any]) -> bool:
    """Whether llm-compressor modifiers calibrate: anything but plain quantization with only
    weight-only or dynamic activations and no KV-cache scales (as llm-compressor resolves them)."""
    import yaml
    from llmcompressor.modifiers.quantization import QuantizationModifier

    for modifier in _instantiate(yaml.safe_dump(modifiers, sort_keys=False)):
        if type(modifier) is not QuantizationModifier:
            return True  # GPTQ, AWQ, SmoothQuant, ...: data-driven by design
        config = modifier.resolve_quantization_config()
        if config.kv_cache_scheme is not None:
            return True
        acts = [g.input_activations for g in config.config_groups.values() if g.input_activations is not None]
        if any(not a.dynamic for a in acts):
            return True
    return False


def quantize(
    model_path: Path, recipe: Recipe, texts: list[str] | None, out_dir: Path, trust_remote_code: bool = False
) -> tuple[str, dict[str, Any] | None]:
    """Run oneshot on the model, save the compressed checkpoint to out_dir; returns the scheme it
    holds and, for a calibrated mixture of experts, the tokens each expert saw."""
    experts = run_oneshot(model_path, recipe, texts, out_dir, trust_remote_code)
    return exported_scheme(out_dir, recipe), experts


def run_oneshot(
    model_path: Path,
    recipe: Recipe,
    texts: list[str] | None,
    out_dir: Path,
    trust_remote_code: bool,
    distributed: bool = False,
    offload: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """oneshot and save; returns the experts' token counts (experts.ExpertTokenCounter) when a
    mixture of experts calibrated. `distributed`: one rank of several (texts: its share); the model
    is loaded through compressed-tensors' offloading, which keeps one copy of the weights shared by
    the ranks, and saving is collective (every rank calls it, rank 0 writes). `offload`:
    {max_memory, offload_folder} for one process whose model does not fit in memory."""
    with collection_paused():
        from llmcompressor import oneshot
        from transformers import AutoTokenizer

    from qserve.quantize import experts

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    model = _load_model(model_path, trust_remote_code, distributed, offload)
    source_dtype = model.dtype
    _hold(model, _calibrating_dtype(model, texts, offloaded=distributed or offload is not None))
    kwargs = _calibration_kwargs(recipe, texts, tokenizer)
    counter = experts.ExpertTokenCounter(model) if texts else None
    _no_pinned_memory_without_accelerator()
    try:
        with frozen_heap():
            # Not offloaded: there memory is what is short, and a batch holds its layers' weights at once.
            modifiers = build_modifiers(recipe, model, batch_gptq=offload is None)
            oneshot(model=model, recipe=modifiers, **kwargs)
    finally:
        if counter:
            counter.remove()
    record = counter.record(recipe.calibration.all_experts) if counter and counter.layers else None
    if record and not distributed:  # ranks' counts are checked once added up (distributed.launch)
        experts.check_every_expert_calibrated(record)
    # Offloaded: transformers gathers each output shard in memory before writing it, and
    # llm-compressor's default shard (20 GB) is the whole model; keep each within the budget.
    shard = {"max_shard_size": offload["max_memory"]["cpu"]} if offload else {}
    _hold(model, source_dtype)  # the checkpoint keeps the source's dtype
    model.save_pretrained(out_dir, save_compressed=True, **shard)
    if not distributed or _rank() == 0:
        tokenizer.save_pretrained(out_dir)
    return record


def _hold(model: Any, dtype: Any) -> None:
    """Hold `model`'s weights in `dtype`, and say so in its config: llm-compressor builds a mixture of
    experts' linearized experts in the config's dtype."""
    if model.dtype == dtype:
        return
    model.to(dtype)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.dtype = dtype


def _calibrating_dtype(model: Any, texts: list[str] | None, offloaded: bool) -> Any:
    """The torch dtype `model` calibrates on `texts` in (execution.calibration_dtype); without texts
    nothing runs forward, and offloaded weights are loaded as they are needed, in their own dtype."""
    import torch

    from qserve.quantize.execution import calibration_dtype

    if offloaded or not texts:
        return model.dtype
    return getattr(torch, calibration_dtype(str(model.dtype).removeprefix("torch.")))


def _calibration_kwargs(recipe: Recipe, texts: list[str] | None, tokenizer: Any) -> dict[str, Any]:
    if not texts:
        return {}
    from qserve.quantize.calibration import tokenized_dataset

    return {
        "dataset": tokenized_dataset(texts, tokenizer, recipe.seq_len),
        "num_calibration_samples": len(texts),
        "max_seq_length": recipe.seq_len,
        # qserve already drew a seeded sample; keep its order so reruns are reproducible.
        "shuffle_calibration_samples": False,
        # Layer by layer: calibration memory stays bounded by one decoder layer.
        "pipeline": "sequential",
        "moe_calibrate_all_experts": recipe.calibration.all_experts,
    }


def _load_model(model_path: Path, trust_remote_code: bool, distributed: bool, offload: dict[str, Any] | None) -> Any:
    from transformers import AutoModelForCausalLM

    if not distributed and offload is None:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype="auto", trust_remote_code=trust_remote_code)
    from compressed_tensors.offload import load_offloaded_model

    # Distributed: without it each rank quantizes a private copy, and llm-compressor (which skips
    # broadcasting CPU-resident weights, expecting them shared) never sees the other ranks' updates.
    # "auto_offload": CPU first, then disk; never an accelerator query, which fails on a CPU machine.
    with load_offloaded_model():
        return AutoModelForCausalLM.from_pretrained(
            model_path, dtype="auto", device_map="auto_offload", trust_remote_code=trust_remote_code, **(offload or {})
        )


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def quantize_model_free(model_path: Path, recipe: Recipe, out_dir: Path) -> str:
    """llm-compressor's model_free_ptq: one safetensors shard at a time, no model definition loaded."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    from llmcompressor.entrypoints.model_free import model_free_ptq

    # Without a model definition, "Linear" matches every 2-D weight: name the others (embeddings).
    ignore = list(recipe.ignore) + non_linear_weights(model_path)
    config = QuantizationConfig(
        config_groups=config_groups(recipe), ignore=ignore, quantization_status=QuantizationStatus.INITIALIZED
    )
    model_free_ptq(model_path, out_dir, config=config, max_workers=1, device="cpu")
    return exported_scheme(out_dir, recipe)


def non_linear_weights(model_path: Path) -> list[str]:
    """Modules with a weight that are not Linear layers, from the model's config on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return [
        name
        for name, module in model.named_modules()
        if not isinstance(module, torch.nn.Linear)
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.dim() == 2
    ]


def _no_pinned_memory_without_accelerator() -> None:
    """llm-compressor 0.14's AWQ pins cached activations for faster GPU copies; pinning needs an
    accelerator, so on a CPU-only machine it raises. Pinning buys nothing there: skip it."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not torch.accelerator.is_available():
        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None


def exported_scheme(out_dir: Path, recipe: Recipe) -> str:
    """The scheme the written checkpoint implements; it must be the one the recipe asked for."""
    config = json.loads((out_dir / "config.json").read_text()).get("quantization_config") or {}
    found = scheme_of_checkpoint(config)
    if found is None:
        raise QserveError(
            f"the recipe produced a quantization qserve cannot match to vLLM arguments; supported schemes: {', '.join(SCHEMES)}"
        )
    if recipe.scheme is not None and found != recipe.target_scheme:
        raise QserveError(f"llm-compressor wrote a {found} checkpoint, but the recipe asked for {recipe.target_scheme}")
    return found
