"""`qserve serve`: run vLLM's OpenAI server from a plan, until it answers, and stop it in bounded time."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
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

from qserve.checkpoint import signing
from qserve.checkpoint.manifest import check_hashes, read_manifest
from qserve.checkpoint.opened import Checkpoint
from qserve.checkpoint.snapshot import private_copy
from qserve.device import detect
from qserve.engines import vllm_cli
from qserve.errors import QserveError
from qserve.gate.records import check_gate
from qserve.paths import open_log
from qserve.progress import info, step
from qserve.runtime.process import GRACE_SECONDS, ProcessGroup
from qserve.serve.plan import SERVER_INTERPRETER, Endpoint, ServePlan, load_servable, plan

READY_TIMEOUT = 900.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ensure_port_free(host: str, port: int) -> None:
    """Refuse a port another process listens on. SO_REUSEADDR as uvicorn sets it: connections of a
    server that just stopped (TIME_WAIT) do not keep vLLM from listening, so they do not refuse it."""
    host = host.strip("[]")  # an IPv6 address as a URL writes it
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise QserveError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port") from None


def serve(
    checkpoint: str | Path | Checkpoint,
    endpoint: Endpoint | None = None,
    checks: Checks | None = None,
    extra_args: list[str] | None = None,
    ready_timeout: float = READY_TIMEOUT,
    verbose: bool = False,
    warm: WarmServer | None = None,
) -> NoReturn:
    """Start the server, wait until it answers a generation request, and run until it exits or we are signalled.

    `extra_args`: vLLM options after `--`, from the allowlist (engines/passthrough.py). `warm`: an
    interpreter `warm_server` started for this checkpoint, given its command line after the checks.
    Never returns: a signal raises Stopped (after the server's process group is gone), and a server
    that exits by itself is a QserveError naming its log.
    """
    endpoint, checks = endpoint or Endpoint(), checks or Checks()
    opened, device = load_servable(checkpoint)
    ckpt, manifest = opened.path, opened.manifest
    notes = checks.run(ckpt, announce=True)
    _warn_about_access(endpoint)
    with private_copy(opened.path) as (copy, hashes):
        checks.run_on_copy(copy, hashes, opened)
        p = plan(ckpt, manifest, device, endpoint, extra_args, loaded_from=copy)
        with running(p, ready_timeout=ready_timeout, verbose=verbose, warm=warm, header=notes) as server:
            print(f"serving {p.model_name} at {p.url}/v1", flush=True)
            print(_curl(p, endpoint.key_source if endpoint.api_key else None), flush=True)
            code = server.wait()  # raises Stopped on SIGINT/SIGTERM, after the group is gone
    raise QserveError(f"vLLM server exited with code {code}; its log: {p.log}")


@dataclass
class WarmServer:
    """vLLM's API server interpreter, started before the gate is decided so that its imports (seconds
    of one core) run on what the gate leaves idle (engines/vllm_cli.py, `await_command`). It
    learns what to serve only in `running`, after every check `serve` makes, and only for the plan
    it was started for; until then it serves nothing and ends with qserve (its stdin is qserve's)."""

    proc: subprocess.Popen
    plan: ServePlan
    sink: _log_sink

    def take(self, p: ServePlan, command: list[str]) -> WarmServer | None:
        """Itself, given `command`'s arguments, if it still waits and was started for `p`'s
        environment, log and interpreter; else None, and it is ended."""
        prefix = len(SERVER_INTERPRETER)
        if (
            self.proc.poll() is None
            and (self.plan.env, self.plan.log) == (p.env, p.log)
            and command[:prefix] == SERVER_INTERPRETER
        ):
            self.proc.stdin.write((json.dumps(command[prefix:]) + "\n").encode())
            self.proc.stdin.close()  # closed: taken, and `close` leaves it to the server's group
            return self
        self.close()
        return None

    def close(self) -> None:
        """End it unless it was taken: end-of-file on its stdin ends it at once."""
        if self.proc.stdin.closed:
            return
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.sink.__exit__(None, None, None)


WARM_COMMAND = [*SERVER_INTERPRETER, vllm_cli.AWAIT_COMMAND]


@contextmanager
def warm_server(
    ckpt: Path, endpoint: Endpoint, extra_args: list[str] | None = None, verbose: bool = False
) -> Iterator[WarmServer | None]:
    """For `qserve run`: within the block, a server interpreter for `ckpt` importing vLLM at idle
    priority (None where Linux's SCHED_IDLE is not there, or the plan cannot be made yet: `serve`
    then starts one the usual way). Ended on leaving the block unless it was served.

    Measured: docs/serving.md, "`qserve run` starts the server's interpreter while the gate runs".
    """
    warm = _start_warm(ckpt, endpoint, extra_args, verbose)
    try:
        yield warm
    finally:
        if warm is not None:
            warm.close()


def _start_warm(ckpt: Path, endpoint: Endpoint, extra_args: list[str] | None, verbose: bool) -> WarmServer | None:
    from qserve.runtime import priority

    if not priority.AVAILABLE:
        return None
    try:
        p = plan(ckpt, read_manifest(ckpt), detect.detect_device(), endpoint, extra_args)
    except QserveError:
        return None  # serve says why, after the gate
    sink = _log_sink(p.log, verbose, held=True)
    pipes = {"stdin": subprocess.PIPE, "stdout": sink.stdout, "stderr": subprocess.STDOUT}
    proc = subprocess.Popen(WARM_COMMAND, env=p.env, start_new_session=True, **pipes)
    sink.start(proc)
    return WarmServer(proc, p, sink)


@dataclass(frozen=True)
class Checks:
    """What a checkpoint must show before it is served: its signature (with a key) and its gate."""

    skip_gate: bool = False
    verify_key: Path | None = None
    policy: Path | None = None
    accept_gate_difference: bool = False

    def run(self, ckpt: Path, announce: bool = False) -> list[str]:
        """Raise unless the checkpoint may be served; returns what the serve log opens with: the gate
        that passed, its look, and every override of it."""
        notes, overrides = [], []
        if self.verify_key is not None:
            signing.verify(ckpt, self.verify_key)
            notes.append(f"signature by {self.verify_key} covers every file")
        if self.skip_gate:
            notes.append("warning: --skip-gate: serving a checkpoint without a passing accuracy gate")
        else:
            gate = check_gate(ckpt, self.policy, self.accept_gate_difference)  # says its overrides itself
            look = f", look {gate.look} at these weights" if gate.look else ""
            notes.append(f"accuracy gate passed (decided {gate.decided_at}{look})")
            overrides = [f"warning: {o}" for o in gate.overrides]
        for note in notes if announce else []:
            info(note)
        return notes + overrides

    def run_on_copy(self, copy: Path, hashes: dict[str, str], opened: Checkpoint) -> None:
        """The checks again, on the private copy vLLM will load (its files' hashes taken as they were
        written): a file replaced in the checkpoint after it was opened is caught here, and one
        replaced later never reaches vLLM."""
        try:
            if read_manifest(copy) != opened.manifest:
                raise QserveError("its manifest differs from the one checked")
            check_hashes(copy, hashes, opened.manifest)
            self.run(copy)
        except QserveError as exc:
            raise QserveError(f"{opened.path} changed while qserve checked it ({exc}); nothing was served") from None


@contextmanager
def running(
    p: ServePlan,
    command: list[str] | None = None,
    ready_timeout: float = READY_TIMEOUT,
    verbose: bool = False,
    grace: float = GRACE_SECONDS,
    warm: WarmServer | None = None,
    header: list[str] | None = None,
) -> Iterator[ProcessGroup]:
    """Start the server (`command`, default the plan's), wait until it answers, stop its whole group on
    exit (SIGTERM, then SIGKILL for what is left `grace` seconds later). `warm`: an interpreter
    waiting for this command line (`warm_server`); used when it was started for this plan.

    vLLM's output goes to the plan's log file (and to stderr as well with `verbose`).
    """
    host, _, port = p.url.partition("://")[2].rpartition(":")
    ensure_port_free(host, int(port))
    command = command or p.command
    taken = warm.take(p, command) if warm else None
    with taken.sink if taken else _log_sink(p.log, verbose) as sink:
        sink.write_header(header or [])
        server = ProcessGroup(command, env=p.env, stdout=sink.stdout, grace=grace, started=taken and taken.proc)
        if taken is None:
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
            raise QserveError(
                f"vLLM server was not ready within {timeout:.0f}s (--ready-timeout) and was stopped; its log: {p.log}"
            )
        time.sleep(0.5)


def _probe_tls(url: str) -> ssl.SSLContext | None:
    """qserve's own readiness requests to its own server over TLS: the certificate is the operator's
    (often for a public name, or self-signed), and the request goes to the address qserve just bound."""
    return ssl._create_unverified_context() if url.startswith("https://") else None  # noqa: S323


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2, context=_probe_tls(url)) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _first_answer(p: ServePlan, out: dict[str, BaseException | None]) -> None:
    """One greedy completion of two tokens (a prefill and a decode step, so both paths' kernels have
    run); any failure is recorded as a short reason. Short: on a slow kernel every token counts."""
    body = json.dumps({"model": p.model_name, "prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    if p.api_key:
        headers["Authorization"] = f"Bearer {p.api_key}"
    request = urllib.request.Request(f"{p.url}/v1/completions", body, headers)
    try:
        with urllib.request.urlopen(request, timeout=READY_TIMEOUT, context=_probe_tls(p.url)) as resp:
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
    """Where the server's output goes: the log file, or (verbose) a pipe copied to the file and stderr.

    `held`: for a server started before its header is known (the warm server), its output waits in
    memory until `write_header`, so that the log always opens with qserve's own lines."""

    def __init__(self, log: Path, verbose: bool, held: bool = False) -> None:
        self.file = os.fdopen(open_log(log), "wb")  # the log of this run
        self.verbose = verbose
        self.stdout = subprocess.PIPE if verbose or held else self.file
        self._copier: threading.Thread | None = None
        self._lock = threading.Lock()
        self._waiting: list[bytes] | None = [] if held else None

    def __enter__(self) -> _log_sink:
        return self

    def write_header(self, lines: list[str]) -> None:
        """qserve's own lines before vLLM's: what passed the gate, and every override of it."""
        with self._lock:
            self.file.write("".join(f"qserve: {line}\n" for line in lines).encode())
            self._release()

    def _release(self) -> None:
        self.file.writelines(self._waiting or [])
        self.file.flush()
        self._waiting = None

    def start(self, proc: subprocess.Popen) -> None:
        if proc.stdout is not None:
            self._copier = threading.Thread(target=self._copy, args=(proc.stdout,), daemon=True)
            self._copier.start()

    def _copy(self, pipe) -> None:
        for line in iter(pipe.readline, b""):
            with self._lock:
                if self._waiting is not None:
                    self._waiting.append(line)
                else:
                    self.file.write(line)
                    self.file.flush()
            if self.verbose:
                sys.stderr.buffer.write(line)
                sys.stderr.flush()

    def __exit__(self, *exc) -> None:
        if self._copier is not None:
            self._copier.join(timeout=5)
        with self._lock:
            self._release()  # a server never taken: its lines, with no header to wait for
        self.file.close()


def _warn_about_access(endpoint: Endpoint) -> None:
    host = endpoint.host
    if endpoint.api_key:
        info(f"requests need the API key from {endpoint.key_source} on every route but /health, /ping, /version and /metrics")
    elif not _loopback(host):
        info(
            f"warning: {host} is reachable from other machines and no API key is set: anyone who can reach it can use the model (--api-key)"
        )


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable


def _curl(p: ServePlan, key_source: str | None) -> str:
    """A request that works against this server; the key is named by where it came from, never printed."""
    variable = {"QSERVE_API_KEY": "$QSERVE_API_KEY", "VLLM_API_KEY": "$VLLM_API_KEY"}.get(key_source or "", "<your --api-key>")
    if key_source and key_source.startswith("--api-key-file "):
        variable = f"$(head -n1 {key_source.removeprefix('--api-key-file ')})"
    auth = f' -H "Authorization: Bearer {variable}"' if key_source else ""
    body = f'{{"model": "{p.model_name}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'
    return f"curl {p.url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"
