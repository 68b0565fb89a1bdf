"""`qserve serve`: vLLM's OpenAI-compatible server with the checkpoint's matched arguments."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from qserve import engine, support
from qserve.errors import QserveError
from qserve.evaluation import read_eval
from qserve.manifest import Manifest, manifest_digest, read_manifest, verify_files
from qserve.paths import log_file
from qserve.process import ProcessGroup
from qserve.progress import info, step

READY_TIMEOUT = 900.0


@dataclass(frozen=True)
class ServePlan:
    command: list[str]
    env: dict[str, str]
    url: str
    model_name: str
    log: Path
    api_key: str | None = None


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
    options += [(f, v) for f, v in extras if f not in support.MATCHED_FLAGS]
    cmd = [sys.executable, "-m", "qserve.vllm_cli", "serve", str(ckpt.resolve())]
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
    ready_timeout: float = READY_TIMEOUT,
    verbose: bool = False,
) -> NoReturn:
    """Start the server, wait until it answers a generation request, and run until it exits or we are signalled.

    Never returns: a signal raises Stopped (after the server's process group is gone), and a
    server that exits by itself is a QserveError naming its log.
    """
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
    with running(p, ready_timeout=ready_timeout, verbose=verbose) as server:
        print(f"serving {p.model_name} at {p.url}/v1", flush=True)
        print(_curl(p, api_key), flush=True)
        code = server.wait()  # raises Stopped on SIGINT/SIGTERM, after the group is gone
    raise QserveError(f"vLLM server exited with code {code}; its log: {p.log}")


@contextmanager
def running(
    p: ServePlan, command: list[str] | None = None, ready_timeout: float = READY_TIMEOUT, verbose: bool = False
) -> Iterator[ProcessGroup]:
    """Start the server (`command`, default the plan's), wait until it answers, stop its whole group on exit.

    vLLM's output goes to the plan's log file (and to stderr as well with `verbose`).
    """
    host, _, port = p.url.removeprefix("http://").rpartition(":")
    ensure_port_free(host.strip("[]"), int(port))
    p.log.parent.mkdir(parents=True, exist_ok=True)
    with _log_sink(p.log, verbose) as sink:
        server = ProcessGroup(command or p.command, env=p.env, stdout=sink.stdout)
        sink.start(server.proc)
        try:
            with step(f"starting vLLM server for {p.model_name} on {p.url} (log: {p.log})"):
                _wait_ready(server, p, ready_timeout)
            yield server
        finally:
            server.close()


def _wait_ready(server: ProcessGroup, p: ServePlan, timeout: float) -> None:
    """Ready means able to answer: /health first, then one short generation request.

    The request also takes the engine's first-request warm-up off the user's first request.
    """
    deadline = time.monotonic() + timeout
    _poll(server, p, deadline, timeout, lambda: _healthy(p.url))
    answer: dict[str, BaseException | None] = {}
    worker = threading.Thread(target=_first_answer, args=(p, answer), daemon=True)
    worker.start()
    _poll(server, p, deadline, timeout, lambda: not worker.is_alive())
    if answer.get("error") is not None:
        server.stop()
        raise QserveError(f"vLLM server started but failed its first generation request ({answer['error']}); its log: {p.log}")


def _poll(server: ProcessGroup, p: ServePlan, deadline: float, timeout: float, done) -> None:
    while not done():
        server.check_stop()
        if server.proc.poll() is not None:
            raise QserveError(
                f"vLLM server exited with code {server.proc.returncode} before it was ready ({_last_line(p.log)}); its log: {p.log}"
            )
        if time.monotonic() > deadline:
            server.stop()
            raise QserveError(f"vLLM server was not ready within {timeout:.0f}s (--ready-timeout) and was stopped; its log: {p.log}")
        time.sleep(0.5)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _first_answer(p: ServePlan, out: dict[str, BaseException | None]) -> None:
    """One greedy completion of a few tokens; any failure is recorded as a short reason."""
    body = json.dumps({"model": p.model_name, "prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    if p.api_key:
        headers["Authorization"] = f"Bearer {p.api_key}"
    request = urllib.request.Request(f"{p.url}/v1/completions", body, headers)
    try:
        with urllib.request.urlopen(request, timeout=READY_TIMEOUT) as resp:
            json.load(resp)["choices"][0]["text"]
        out["error"] = None
    except urllib.error.HTTPError as exc:
        out["error"] = QserveError(f"HTTP {exc.code}: {_error_message(exc)}")
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as exc:
        out["error"] = exc


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read())["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError, OSError):
        return exc.reason


def _last_line(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    errors = [ln for ln in lines if "Error" in ln]
    return (errors or lines or ["no output"])[-1][:300]


class _log_sink:
    """Where the server's output goes: the log file, or (verbose) a pipe copied to the file and stderr."""

    def __init__(self, log: Path, verbose: bool) -> None:
        self.file = log.open("wb")  # the log of this run
        self.verbose = verbose
        self.stdout = subprocess.PIPE if verbose else self.file
        self._copier: threading.Thread | None = None

    def __enter__(self) -> _log_sink:
        return self

    def start(self, proc: subprocess.Popen) -> None:
        if self.verbose:
            self._copier = threading.Thread(target=self._copy, args=(proc.stdout,), daemon=True)
            self._copier.start()

    def _copy(self, pipe) -> None:
        for line in iter(pipe.readline, b""):
            self.file.write(line)
            self.file.flush()
            sys.stderr.buffer.write(line)
            sys.stderr.flush()

    def __exit__(self, *exc) -> None:
        if self._copier is not None:
            self._copier.join(timeout=5)
        self.file.close()


def _curl(p: ServePlan, api_key: str | None) -> str:
    auth = ' -H "Authorization: Bearer $QSERVE_API_KEY"' if api_key else ""
    body = f'{{"model": "{p.model_name}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'
    return f"curl {p.url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"
