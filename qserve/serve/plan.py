"""What `qserve serve` runs: the gate check, and the `vllm serve` command line with matched arguments."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from qserve.checkpoint.manifest import Manifest, manifest_digest, read_manifest, verify_files
from qserve.checkpoint.records import read_eval
from qserve.device import detect, engine, flags, support
from qserve.errors import QserveError
from qserve.paths import log_file


@dataclass(frozen=True)
class ServePlan:
    command: list[str]
    env: dict[str, str]
    url: str
    model_name: str
    log: Path
    api_key: str | None = None


def load_servable(ckpt: Path) -> tuple[Manifest, detect.Device]:
    """The checkpoint's manifest and this device, after the checks every served path makes:
    files match the manifest, and vLLM's API server was seen to run the scheme here."""
    manifest = read_manifest(ckpt)
    verify_files(ckpt, manifest)
    device = detect.detect_device()
    support.check_runnable(manifest, device.kind, device.detail)
    return manifest, device


def check_gate(ckpt: Path) -> str:
    """Raise unless this exact checkpoint passed `qserve eval`; returns when it was decided."""
    result = read_eval(ckpt)
    if result is None:
        raise QserveError(f"{ckpt} has no accuracy gate result; run `qserve eval {ckpt}` first (or pass --skip-gate)")
    if result.get("manifest_sha256") != manifest_digest(ckpt):
        raise QserveError(
            f"the gate result in {ckpt} was decided for different checkpoint contents; run `qserve eval {ckpt}` again"
        )
    if result.get("verdict") != "pass":
        raise QserveError(
            f"{ckpt} did not pass its accuracy gate (verdict: {result.get('verdict')}); see `qserve eval {ckpt}` (or pass --skip-gate)"
        )
    return str(result.get("decided_at"))


# Flags qserve sets from its own options.
OWNED_FLAGS = {"--host": "--host", "--port": "--port", "--api-key": "--api-key (or QSERVE_API_KEY)"}


def plan(
    ckpt: Path,
    manifest: Manifest,
    device: detect.Device,
    host: str,
    port: int,
    api_key: str | None = None,
    extra_args: list[str] | None = None,
) -> ServePlan:
    """The `vllm serve` command line: matched arguments, device defaults, then the user's extras."""
    args = manifest.vllm_args
    extras = parse_extra_args(extra_args or [])
    _check_extras(extras, ckpt, manifest)
    matched = {"--quantization": args.quantization, "--kv-cache-dtype": args.kv_cache_dtype, "--dtype": args.dtype}
    defaults: dict[str, str | None] = {"--served-model-name": ckpt.resolve().name, "--max-model-len": str(engine.MAX_MODEL_LEN)}
    # vLLM's API server always runs its engine core in a process of its own; a parent that ran an
    # in-process engine (configure_cpu_env) must not change how the served engine is set up.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    user = {flag for flag, _ in extras}
    if device.kind == "cpu":
        # The same engine settings the gate was decided with (see engine.engine_kwargs). Not the
        # executor: vLLM-CPU forces its multiprocess executor whenever the engine core runs in its
        # own process, as it always does under the API server (vllm/platforms/cpu.py, "OMP requires
        # the MP executor"), so serve has its own column in the support matrix.
        defaults.update({"--kv-cache-memory-bytes": str(engine.CPU_KV_CACHE_BYTES), "--enforce-eager": None})
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if args.trust_remote_code:
        defaults["--trust-remote-code"] = None
    if api_key:
        env["VLLM_API_KEY"] = api_key  # via the environment, so the key stays out of `ps`
    options = [(f, v) for f, v in matched.items() if v is not None] + [("--host", host), ("--port", str(port))]
    options += [(f, v) for f, v in defaults.items() if f not in user]
    options += [(f, v) for f, v in extras if f not in flags.MATCHED_FLAGS]
    cmd = [sys.executable, "-m", "qserve.device.vllm_cli", "serve", str(ckpt.resolve())]
    for flag, value in options:
        cmd += [flag] if value is None else [flag, value]
    name = dict(extras).get("--served-model-name") or defaults["--served-model-name"]
    return ServePlan(cmd, env, f"http://{host}:{port}", str(name), log_file(ckpt, "serve"), api_key)


def parse_extra_args(tokens: list[str]) -> list[tuple[str, str | None]]:
    """`--flag value`, `--flag=value` and bare `--flag` into (flag, value) pairs."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("-"):
            raise QserveError(f"unexpected vLLM argument {token!r}: pass vLLM options as `-- --flag value`")
        flag, eq, value = token.partition("=")
        if not eq and i + 1 < len(tokens) and not _looks_like_flag(tokens[i + 1]):
            value, i = tokens[i + 1], i + 1
        pairs.append((flag, value if (eq or value) else None))
        i += 1
    return pairs


def _looks_like_flag(token: str) -> bool:
    return token.startswith("-") and not token[1:2].isdigit()


def _check_extras(extras: list[tuple[str, str | None]], ckpt: Path, manifest: Manifest) -> None:
    for flag, _ in extras:
        if flag in OWNED_FLAGS:
            raise QserveError(f"pass {flag} as qserve's own {OWNED_FLAGS[flag]} option, not after `--`")
    flags.check_user_args(ckpt, manifest, {f: v or "" for f, v in extras if f in flags.MATCHED_FLAGS})
