"""The quantization schemes qserve knows, which backend makes each, and what each needs to run in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qserve.errors import InvalidSpec


@dataclass(frozen=True)
class Scheme:
    name: str
    weight_bits: int
    activations: str  # "fp16" (weight-only), "int8", "fp8", "fp4"
    needs_calibration: bool  # static activation scales, measured on data
    group_quantized: bool  # weights carry a group size
    vllm_dtype: str  # activation dtype recorded for vLLM (the kernels' usual choice)
    summary: str
    # backend -> that library's own name for the scheme (compressed-tensors preset, Quark template
    # scheme; Quark spells the weight group size into the name)
    backends: dict[str, str] = field(default_factory=dict)
    # compressed-tensors dequantizes these weights into bfloat16 at every forward in transformers, so
    # float32 activations fail there ("expected m1 and m2 to have the same dtype, but got: float !=
    # c10::BFloat16"): transformers runs such a checkpoint in bfloat16 (the fallback, the parity check).
    bfloat16_in_transformers: bool = False


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme(
            name="FP8_DYNAMIC",
            weight_bits=8,
            activations="fp8",
            needs_calibration=False,
            group_quantized=False,
            vllm_dtype="bfloat16",
            summary="FP8 weights per channel, dynamic per-token FP8 activations",
            backends={"llmcompressor": "FP8_DYNAMIC"},
        ),
        Scheme(
            name="FP8",
            weight_bits=8,
            activations="fp8",
            needs_calibration=True,
            group_quantized=False,
            vllm_dtype="bfloat16",
            summary="FP8 weights per tensor, static per-tensor FP8 activations (scales calibrated)",
            backends={"llmcompressor": "FP8", "quark": "fp8"},
        ),
        Scheme(
            name="W8A8",
            weight_bits=8,
            activations="int8",
            needs_calibration=False,
            group_quantized=False,
            vllm_dtype="bfloat16",
            summary="INT8 weights per channel, dynamic per-token INT8 activations",
            backends={"llmcompressor": "W8A8"},
        ),
        Scheme(
            name="W4A16",
            weight_bits=4,
            activations="fp16",
            needs_calibration=False,
            group_quantized=True,
            vllm_dtype="float16",
            summary="INT4 weights in groups, 16-bit activations",
            backends={"llmcompressor": "W4A16", "quark": "int4_wo_{group_size}"},
        ),
        Scheme(
            name="MXFP4",
            weight_bits=4,
            activations="fp4",
            needs_calibration=False,
            group_quantized=False,
            vllm_dtype="bfloat16",
            summary="OCP MXFP4 weights and activations (FP4 E2M1, one E8M0 scale per 32 values)",
            backends={"llmcompressor": "MXFP4", "quark": "mxfp4"},
            bfloat16_in_transformers=True,
        ),
        Scheme(
            name="MXFP4A16",
            weight_bits=4,
            activations="fp16",
            needs_calibration=False,
            group_quantized=False,
            vllm_dtype="bfloat16",
            summary="OCP MXFP4 weights, 16-bit activations",
            backends={"llmcompressor": "MXFP4A16"},
            bfloat16_in_transformers=True,
        ),
        # The 2026 hardware formats (compressed-tensors presets; vLLM's GPU requirements are in
        # support/claims.py, from vLLM's source).
        Scheme(
            name="FP8_BLOCK",
            weight_bits=8,
            activations="fp8",
            needs_calibration=False,
            group_quantized=False,
            vllm_dtype="bfloat16",
            summary="FP8 weights in 128x128 blocks, dynamic FP8 activations per token group of 128 (DeepSeek-V3 style)",
            backends={"llmcompressor": "FP8_BLOCK"},
        ),
        Scheme(
            name="MXFP8",
            weight_bits=8,
            activations="fp8",
            needs_calibration=False,
            group_quantized=False,
            vllm_dtype="bfloat16",
            summary="OCP MXFP8 weights and activations (FP8 E4M3, one E8M0 scale per 32 values)",
            backends={"llmcompressor": "MXFP8"},
            bfloat16_in_transformers=True,
        ),
        Scheme(
            name="NVFP4",
            weight_bits=4,
            activations="fp4",
            needs_calibration=True,
            group_quantized=False,
            vllm_dtype="bfloat16",
            summary="NVFP4 weights and activations (FP4 E2M1, an FP8 scale per 16 values and a global scale; "
            "activation global scales calibrated)",
            backends={"llmcompressor": "NVFP4"},
            bfloat16_in_transformers=True,
        ),
        Scheme(
            name="NVFP4A16",
            weight_bits=4,
            activations="fp16",
            needs_calibration=False,
            group_quantized=False,
            vllm_dtype="bfloat16",
            summary="NVFP4 weights (FP4 E2M1, an FP8 scale per 16 values and a global scale), 16-bit activations",
            backends={"llmcompressor": "NVFP4A16"},
            bfloat16_in_transformers=True,
        ),
        Scheme(
            name="W4AFP8",
            weight_bits=4,
            activations="fp8",
            needs_calibration=False,
            group_quantized=True,
            vllm_dtype="bfloat16",
            summary="INT4 weights in groups, dynamic per-token FP8 activations",
            backends={"llmcompressor": "W4AFP8"},
        ),
        # Per-layer mixes (a recipe's `overrides`, what `qserve tune` writes): one compressed-tensors
        # checkpoint with a config group per scheme, loaded by vLLM with one `quantization` argument.
        # Only mixes vLLM was seen to run go here (support/claims.py). bfloat16: the INT8 layers'
        # AMX kernel takes no other dtype, and the INT4 layers' CPUWNA16 kernel takes it.
        Scheme(
            name="W8A8+W4A16",
            weight_bits=4,
            activations="int8",
            needs_calibration=False,
            group_quantized=True,
            vllm_dtype="bfloat16",
            summary="INT8 W8A8 layers and INT4 W4A16 layers (in groups) in one checkpoint",
            backends={"llmcompressor": "W8A8+W4A16"},
        ),
    )
}
MIX_SEPARATOR = "+"


def mix_name(schemes: list[str]) -> str:
    """The name of a per-layer mix of `schemes` (in SCHEMES' order, so the recipe's order does not matter)."""
    order = list(SCHEMES)
    unique = sorted(set(schemes), key=order.index)
    return MIX_SEPARATOR.join(unique)


def transformers_dtype(scheme: str, quantization: str | None, dtype: str = "float32") -> str:
    """The dtype transformers runs a checkpoint of `scheme` in when `dtype` is wanted: bfloat16 for the
    compressed-tensors schemes it dequantizes into bfloat16 (Scheme.bfloat16_in_transformers)."""
    parts = [SCHEMES[p] for p in parts_of(scheme) if p in SCHEMES]
    if quantization == "compressed-tensors" and any(p.bfloat16_in_transformers for p in parts):
        return "bfloat16"
    return dtype


def parts_of(name: str) -> list[str]:
    """The plain schemes a (possibly mixed) scheme is made of."""
    return name.split(MIX_SEPARATOR)


def get_scheme(name: str, backend: str | None = None) -> Scheme:
    """The scheme called `name` (case-insensitive), checked against `backend` when given."""
    scheme = SCHEMES.get(name.upper())
    if scheme is None:
        raise InvalidSpec(f"unknown scheme {name!r}; choose one of: {', '.join(SCHEMES)}")
    if backend is not None and backend not in scheme.backends:
        offered = [s.name for s in SCHEMES.values() if backend in s.backends]
        raise InvalidSpec(f"scheme {scheme.name} is not available with backend {backend}; it offers: {', '.join(offered)}")
    return scheme


QUARK_GROUP_SIZES = (32, 64, 128)


def scheme_of_checkpoint(quantization_config: dict[str, Any]) -> str | None:
    """Which qserve scheme an exported compressed-tensors config implements (None if none matches).

    Read from the checkpoint itself, so a plain llm-compressor recipe still gets matched vLLM args.
    """
    groups = list((quantization_config.get("config_groups") or {}).values())
    if not groups:
        return None
    found = [_scheme_of_group(g) for g in groups]
    if None in found:
        return None
    name = mix_name(found)
    return name if name in SCHEMES else None


def _scheme_of_group(group: dict[str, Any]) -> str | None:
    w, a = group.get("weights") or {}, group.get("input_activations")
    kind = (w.get("type"), w.get("num_bits"), a and a.get("type"), a and a.get("num_bits"))
    if kind == ("float", 8, "float", 8):
        return _fp8_scheme(w, a)
    if kind == ("int", 8, "int", 8):
        return "W8A8"
    if kind[:2] == ("int", 4):
        return {None: "W4A16", ("float", 8): "W4AFP8"}.get(kind[2:] if a else None)
    if kind[:2] == ("float", 4):  # OCP MX: one scale per 32 values; NVFP4: per 16, plus a global scale
        names = {32: ("MXFP4", "MXFP4A16"), 16: ("NVFP4", "NVFP4A16")}.get(w.get("group_size"))
        return names and names[0 if a else 1]
    return None


def _fp8_scheme(w: dict[str, Any], a: dict[str, Any]) -> str | None:
    if w.get("strategy") == "block":
        return "FP8_BLOCK"
    if w.get("strategy") == "group" and w.get("group_size") == 32:
        return "MXFP8"
    return "FP8_DYNAMIC" if a.get("dynamic") else "FP8"


def scheme_of_quark_checkpoint(quantization_config: dict[str, Any]) -> str | None:
    """Which qserve scheme an exported Quark config (`quant_method: quark`) implements (None if none)."""
    glob = quantization_config.get("global_quant_config") or {}
    w, a = glob.get("weight") or {}, glob.get("input_tensors")
    kind = (w.get("dtype"), a and a.get("dtype"))
    if kind == ("int4", None):
        return "W4A16"
    if kind == ("fp8_e4m3", "fp8_e4m3"):
        return "FP8" if not a.get("is_dynamic") else None
    if kind == ("fp4", "fp4") and w.get("group_size") == 32:
        return "MXFP4"
    return None
