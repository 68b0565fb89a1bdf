"""The quantization schemes qserve knows, and what each needs to run in vLLM."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scheme:
    name: str  # compressed-tensors preset name
    weight_bits: int
    activations: str  # "fp16" (weight-only), "int8", "fp8"
    needs_calibration: bool  # true when the algorithm or static scales use data
    group_quantized: bool  # weights carry a group size
    vllm_dtype: str  # activation dtype recorded for vLLM (the kernels' usual choice)
    summary: str


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("FP8_DYNAMIC", 8, "fp8", False, False, "bfloat16", "FP8 weights per channel, dynamic per-token FP8 activations"),
        Scheme("W8A8", 8, "int8", True, False, "bfloat16", "INT8 weights per channel, dynamic per-token INT8 activations"),
        Scheme("W4A16", 4, "fp16", True, True, "float16", "INT4 weights in groups, 16-bit activations"),
    )
}


def get_scheme(name: str) -> Scheme:
    try:
        return SCHEMES[name.upper()]
    except KeyError:
        raise KeyError(f"unknown scheme {name!r}; choose one of: {', '.join(SCHEMES)}") from None
