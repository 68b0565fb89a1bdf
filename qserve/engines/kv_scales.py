"""FP8 KV cache: did the checkpoint's calibrated k/v scales reach the engine?"""

from __future__ import annotations

from typing import Any


def kv_scales(lm: Any) -> list[tuple[str, float, float]]:
    """(layer, k_scale, v_scale) of every attention layer as loaded in the engine's model."""

    def read(model: Any) -> list[tuple[str, float, float]]:
        return [(n, float(m._k_scale), float(m._v_scale)) for n, m in model.named_modules() if hasattr(m, "_k_scale")]

    return lm.model.apply_model(read)[0]


def check_kv_scales(scales: list[tuple[str, float, float]], kv_cache_dtype: str) -> dict[str, Any]:
    """For a quantized KV cache: did the checkpoint's calibrated k/v scales reach vLLM (not all 1.0)?"""
    if kv_cache_dtype == "auto":
        return {"status": "skipped", "reason": "kv_cache_dtype auto (no quantized KV cache)"}
    ks, vs = [k for _, k, _ in scales], [v for _, _, v in scales]
    arrived = bool(scales) and any(x != 1.0 for x in ks + vs)
    return {
        "status": "pass" if arrived else "fail",
        "kv_cache_dtype": kv_cache_dtype,
        "layers": len(scales),
        "k_scale": [min(ks, default=0.0), max(ks, default=0.0)],
        "v_scale": [min(vs, default=0.0), max(vs, default=0.0)],
        "reason": "calibrated scales loaded"
        if arrived
        else "every k/v scale is 1.0: the checkpoint's calibrated scales did not reach vLLM",
    }
