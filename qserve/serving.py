"""`qserve serve`: vLLM's OpenAI-compatible server with the checkpoint's matched arguments."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from qserve import engine, support
from qserve.errors import QserveError
from qserve.evaluation import read_eval
from qserve.manifest import Manifest, manifest_digest, read_manifest, verify_files
from qserve.progress import info, step

READY_TIMEOUT = 900.0


@dataclass(frozen=True)
class ServePlan:
    command: list[str]
    env: dict[str, str]
    url: str
    model_name: str


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
    device: engine.Device,
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
    env = dict(os.environ)
    if device.kind == "cpu":
        # The same engine settings the gate was decided with (see engine.engine_kwargs).
        defaults.update({"--kv-cache-memory-bytes": str(engine.CPU_KV_CACHE_BYTES), "--enforce-eager": None})
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if args.trust_remote_code:
        defaults["--trust-remote-code"] = None
    if api_key:
        env["VLLM_API_KEY"] = api_key  # via the environment, so the key stays out of `ps`
    user = {flag for flag, _ in extras}
    options = [(f, v) for f, v in matched.items() if v is not None] + [("--host", host), ("--port", str(port))]
    options += [(f, v) for f, v in defaults.items() if f not in user]
    options += [(f, v) for f, v in extras if f not in support.MATCHED_FLAGS]
    cmd = [sys.executable, "-m", "qserve.vllm_cli", "serve", str(ckpt.resolve())]
    for flag, value in options:
        cmd += [flag] if value is None else [flag, value]
    name = dict(extras).get("--served-model-name") or defaults["--served-model-name"]
    return ServePlan(cmd, env, f"http://{host}:{port}", str(name))


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
    support.check_user_args(ckpt, manifest, {f: v or "" for f, v in extras if f in support.MATCHED_FLAGS})


def ensure_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise QserveError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port") from None


def serve(
    checkpoint: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    skip_gate: bool = False,
    api_key: str | None = None,
    extra_args: list[str] | None = None,
) -> int:
    """Start the server, wait until it answers, and run until it exits or we are signalled."""
    ckpt = Path(checkpoint)
    manifest = read_manifest(ckpt)
    verify_files(ckpt, manifest)
    device = engine.detect_device()
    engine.check_supported(manifest, device)
    if skip_gate:
        info("warning: --skip-gate: serving a checkpoint without a passing accuracy gate")
    else:
        info(f"accuracy gate passed (decided {check_gate(ckpt)})")
    p = plan(ckpt, manifest, device, host, port, api_key, extra_args)
    with running(p) as server:
        print(f"serving {p.model_name} at {p.url}/v1", flush=True)
        print(_curl(p, api_key), flush=True)
        code = server.proc.wait()
        return 0 if server.requested else code  # a stop we asked for is a clean exit


@contextmanager
def running(p: ServePlan, command: list[str] | None = None) -> Iterator[_StopOnSignal]:
    """Start the server (`command`, default the plan's), wait until it answers, stop it on exit."""
    host, _, port = p.url.removeprefix("http://").rpartition(":")
    ensure_port_free(host.strip("[]"), int(port))
    # vLLM's logs and access log go to stderr: stdout carries only the endpoint and curl lines.
    proc = subprocess.Popen(command or p.command, env=p.env, start_new_session=True, stdout=sys.stderr)
    server = _StopOnSignal(proc)
    try:
        with step(f"starting vLLM server for {p.model_name} on {p.url}"):
            _wait_ready(proc, p.url, server)
        yield server
    finally:
        server.close()


def _wait_ready(proc: subprocess.Popen, url: str, server: _StopOnSignal) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if server.requested:
                raise KeyboardInterrupt
            raise QserveError(f"vLLM server exited with code {proc.returncode} before it was ready (its log is above)")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise QserveError(f"vLLM server did not become ready within {READY_TIMEOUT:.0f}s")


class _StopOnSignal:
    """SIGINT/SIGTERM ask the vLLM child to stop, once (a second Ctrl-C must not turn a clean
    shutdown into a kill); close() reaps the child and restores the handlers, unless a signal
    asked us to stop: the caller is then on its way out, and repeats stay ignored."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.requested = False
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame) -> None:
        if not self.requested and self.proc.poll() is None:
            self.requested = True
            self.proc.send_signal(signal.SIGTERM)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for sig, handler in self._old.items():
            # After a signalled stop, ignore repeats: SIG_IGN survives interpreter shutdown,
            # which resets Python-level handlers to the default (a late Ctrl-C would kill us).
            signal.signal(sig, signal.SIG_IGN if self.requested else handler)


def _curl(p: ServePlan, api_key: str | None) -> str:
    auth = ' -H "Authorization: Bearer $QSERVE_API_KEY"' if api_key else ""
    body = f'{{"model": "{p.model_name}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'
    return f"curl {p.url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"
