"""FP8 KV cache: did the checkpoint's calibrated k/v scales reach the engine?"""

from __future__ import annotations

from typing import Any


def kv_scales(lm: Any) -> list[tuple[str, float, float]]:
    """(layer, k_scale, v_scale) of every attention layer as loaded in the engine's model, over all its
    workers: tensor-parallel ranks repeat a layer (the first is kept), pipeline stages split the layers."""
    merged: dict[str, tuple[str, float, float]] = {}
    for worker in lm.model.apply_model(layer_scales):
        for row in worker:
            merged.setdefault(row[0], row)
    return list(merged.values())


def layer_scales(model: Any) -> list[tuple[str, float, float]]:
    """One worker's attention layers. At module level: vLLM's multiprocess and Ray executors send the
    function to their workers by pickle, which refuses a nested one."""
    return [(n, float(m._k_scale), float(m._v_scale)) for n, m in model.named_modules() if hasattr(m, "_k_scale")]


def engine_cache_dtype(lm: Any) -> str:
    """The KV-cache dtype the engine runs, as vLLM resolved it: its "auto" takes the checkpoint
    config's kv_cache_scheme, and an engine override wins over both."""
    return str(lm.model.llm_engine.vllm_config.cache_config.cache_dtype)


def check_kv_cache(scales: list[tuple[str, float, float]], kv_cache_dtype: str, engine_dtype: str) -> dict[str, Any]:
    """The engine's KV cache is the one the checkpoint asks for, and a quantized one got its scales.
    A KV cache the manifest does not name is a failure of its own: it moves log-probabilities by less
    than the parity tolerance for activation-quantized schemes, so parity cannot be relied on to see it."""
    if _fp8_alias(engine_dtype) != _fp8_alias(kv_cache_dtype):
        return {
            "status": "fail",
            "kv_cache_dtype": kv_cache_dtype,
            "engine_kv_cache_dtype": engine_dtype,
            "reason": f"vLLM runs a {engine_dtype} KV cache where the checkpoint asks for {kv_cache_dtype}: "
            "the gate would measure another engine than the one it names",
        }
    return check_kv_scales(scales, kv_cache_dtype) | {"engine_kv_cache_dtype": engine_dtype}


def _fp8_alias(dtype: str) -> str:
    return "fp8_e4m3" if dtype == "fp8" else dtype  # vLLM's "fp8" is e4m3


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
