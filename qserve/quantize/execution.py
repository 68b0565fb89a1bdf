"""How a recipe runs on this machine: in memory, shard by shard (model-free), or data-parallel
under torchrun; and the memory this process may use, which `auto` decides on."""

from __future__ import annotations

import json
import resource
from dataclasses import dataclass
from pathlib import Path

from qserve.errors import QserveError
from qserve.spec.recipe import Recipe

# Loading a model and writing its compressed copy holds about twice its weights, plus the libraries.
IN_MEMORY_FACTOR = 2.0
LIBRARY_HEADROOM = 2 << 30


@dataclass(frozen=True)
class Execution:
    path: str  # "in_memory", "model_free", "offload" or "distributed"
    reason: str
    nproc: int = 1

    def record(self) -> dict:
        return {"path": self.path, "reason": self.reason, "nproc": self.nproc}


def choose(recipe: Recipe, model_path: Path, nproc: int = 1, nnodes: int = 1) -> Execution:
    """The recipe's `execution`, or for `auto` the path that fits this process's memory."""
    if nproc * nnodes > 1:
        check_parallel(recipe, nproc * nnodes)
        return Execution("distributed", f"--nproc {nproc}: data-parallel calibration under torchrun", nproc)
    if recipe.execution != "auto":
        return Execution(recipe.execution, "the recipe's execution")
    weights, held, limit = weight_bytes(model_path), held_bytes(recipe, model_path), memory_limit_bytes()
    needed = IN_MEMORY_FACTOR * held + LIBRARY_HEADROOM
    widened = f" ({held / 2**30:.1f} GiB in float32 to calibrate)" if held != weights else ""
    sizes = f"{weights / 2**30:.1f} GiB of weights{widened}, {limit / 2**30:.1f} GiB of memory available"
    if needed <= limit:
        return Execution("in_memory", f"auto: fits ({sizes})")
    if recipe.model_free_obstacle() is None:
        return Execution("model_free", f"auto: too large to load ({sizes}); shard by shard")
    if recipe.backend != "llmcompressor":
        raise QserveError(f"the model needs about {needed / 2**30:.1f} GiB to quantize ({sizes}); Quark loads it whole")
    return Execution("offload", f"auto: too large to load ({sizes}); weights beyond memory offloaded to disk")


def calibration_dtype(model_dtype: str) -> str:
    """The dtype a model held in `model_dtype` calibrates in, in memory: float32 for a bfloat16 model
    on a CPU without a bfloat16 matmul kernel (device/detect.py has the figures; float32 holds every
    bfloat16 value exactly, and the checkpoint is written back in bfloat16), else its own."""
    import torch

    from qserve.device.detect import cpu_compute_dtype

    return model_dtype if torch.cuda.is_available() else cpu_compute_dtype(model_dtype)


def recipe_calibration_dtype(recipe: Recipe, model_path: Path) -> str | None:
    """The dtype llm-compressor's in-memory run of `recipe` calibrates the model at `model_path` in;
    None when nothing calibrates (Quark, a data-free recipe)."""
    if recipe.backend != "llmcompressor" or recipe.calibration is None:
        return None
    return calibration_dtype(config_dtype(model_path))


def held_bytes(recipe: Recipe, model_path: Path) -> int:
    """The model's weights as quantizing `recipe` holds them in memory: twice their size on disk when
    llm-compressor calibrates bfloat16 weights in float32."""
    widens = recipe_calibration_dtype(recipe, model_path) not in (None, config_dtype(model_path))
    return weight_bytes(model_path) * (2 if widens else 1)


def config_dtype(model_path: Path) -> str:
    """The dtype a checkpoint's config.json gives its weights (transformers wrote `torch_dtype`, now `dtype`)."""
    # Read here: architecture.model_config's module imports the backend, which imports this one.
    path = Path(model_path) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config = config.get("text_config", config) | config
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def offload_budget() -> int:
    """CPU memory the offloaded weights may take: what is available minus the libraries' share."""
    return max(memory_limit_bytes() - LIBRARY_HEADROOM, 256 << 20)


def check_parallel(recipe: Recipe, processes: int) -> None:
    """What data-parallel calibration over `processes` cannot run, known from the recipe alone (so
    refused before the model is converted or read)."""
    if processes <= 1:
        return
    if recipe.backend != "llmcompressor":
        raise QserveError("--nproc runs llm-compressor's data-parallel calibration; it needs backend: llmcompressor")
    if recipe.calibration is None:
        raise QserveError(f"--nproc splits the calibration data between processes, and recipe {recipe.name} is data-free")
    if recipe.execution == "model_free":
        raise QserveError("--nproc and execution: model_free do not combine (model-free runs without data)")


def weight_bytes(model_path: Path) -> int:
    """Bytes of the model's safetensors weights (what loading it costs, before activations)."""
    files = list(Path(model_path).glob("*.safetensors"))
    return sum(f.stat().st_size for f in files)


def memory_limit_bytes() -> int:
    """The least of: available RAM, this process's address-space limit, its cgroup's memory limit."""
    limits = [_mem_available()]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(soft)
    limits += [v for v in (_cgroup_limit(),) if v]
    return min(limits)


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise QserveError("cannot read MemAvailable from /proc/meminfo")


def _cgroup_limit() -> int | None:
    """cgroup v2 memory.max or v1 memory.limit_in_bytes of this process's own cgroup, if set."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if controllers == "":
            candidate = Path("/sys/fs/cgroup") / rel.lstrip("/") / "memory.max"
        elif "memory" in controllers.split(","):
            candidate = Path("/sys/fs/cgroup/memory") / rel.lstrip("/") / "memory.limit_in_bytes"
        else:
            continue
        try:
            value = candidate.read_text().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < 1 << 60:
            return int(value)
    return None


def shard_count(model_path: Path) -> int:
    index = Path(model_path) / "model.safetensors.index.json"
    if index.is_file():
        return len(set(json.loads(index.read_text())["weight_map"].values()))
    return len(list(Path(model_path).glob("*.safetensors")))


def peak_rss_mib() -> float:
    """This process's own peak resident memory. VmHWM, not ru_maxrss: on Linux a child's ru_maxrss
    starts at its parent's peak (a qserve run from a large test process reported the parent's)."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
