"""Stop means stop: a vLLM process group that ignores SIGTERM is killed within the grace period.

The stand-in server is a real child process group run through qserve's own `server.running()`
and CLI error handling (the driver below): its leader and a grandchild ignore SIGTERM, as a stuck
vLLM engine does. A signal to qserve must end it all within the grace period, with exit 130 or 143.
The stand-in's grace is GRACE (3 s) rather than qserve's default GRACE_SECONDS (15 s): the same
code path, waited through seven times, at a fifth of the wait; the real server's tests keep the default.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import QSERVE, REPO, free_port, needs_vllm

from qserve.runtime.process import GRACE_SECONDS, group_members

GRACE = 3.0  # the stand-in server's grace period (seconds)

# A server that ignores SIGTERM and spawns a grandchild that does too. MODE: "never" (never
# healthy), "ok" (answers /health and completions), "fail" (completions answer HTTP 500).
CHILD = r"""
import http.server, json, os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
mode, port, pids = sys.argv[1], int(sys.argv[2]), sys.argv[3]
grandchild = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
open(pids, "w").write(f"{os.getpid()} {grandchild.pid}")
print("stand-in server starting", flush=True)
if mode == "never":
    time.sleep(600)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def do_POST(self):
        code = 500 if mode == "fail" else 200
        body = {"error": {"message": "boom: no kernel"}} if mode == "fail" else {"choices": [{"text": " hi"}]}
        data = json.dumps(body).encode()
        self.send_response(code); self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""

# Runs the stand-in through server.running() behind the CLI's error handling, as `qserve serve` does.
DRIVER = r"""
import sys
from pathlib import Path
import typer
from qserve import cli
from qserve.serve.plan import ServePlan
from qserve.serve.server import running
mode, port, pids, log, timeout, grace = sys.argv[1:7]
plan = ServePlan([sys.executable, "-c", sys.argv[7], mode, port, pids], None, f"http://127.0.0.1:{port}", "stand-in", Path(log))

@cli._user_errors
def main():
    with running(plan, ready_timeout=float(timeout), grace=float(grace)) as server:
        print("ready", flush=True)
        server.wait()

try:
    main()
except typer.Exit as exc:
    sys.exit(exc.exit_code)
"""


def _start(tmp_path: Path, mode: str, ready_timeout: float = 300) -> tuple[subprocess.Popen, Path, Path]:
    pids, log = tmp_path / "pids", tmp_path / "logs" / "serve.log"
    args = [mode, str(free_port()), str(pids), str(log), str(ready_timeout), str(GRACE), CHILD]
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    deadline = time.monotonic() + 60
    while not pids.is_file() or not pids.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else "slow"
        time.sleep(0.1)
    return proc, pids, log


def _stop(proc: subprocess.Popen, sig: int) -> tuple[int, float, str]:
    start = time.monotonic()
    proc.send_signal(sig)
    code = proc.wait(timeout=GRACE_SECONDS + 30)  # bounds the real server's stop too
    return code, time.monotonic() - start, proc.stderr.read()


def _wait_ignoring_sigterm(pid: int) -> None:
    """Until the process's ignored-signal mask (/proc/PID/status, SigIgn) holds SIGTERM."""
    bit, deadline = 1 << (signal.SIGTERM - 1), time.monotonic() + 60
    while True:
        status = Path(f"/proc/{pid}/status").read_text()
        if int(status.split("SigIgn:")[1].split()[0], 16) & bit:
            return
        assert time.monotonic() < deadline, "the grandchild never ignored SIGTERM"
        time.sleep(0.05)


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting for init to reap it (an orphaned grandchild is init's to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _assert_group_gone(pids: Path) -> None:
    leader, grandchild = map(int, pids.read_text().split())
    assert group_members(leader) == []  # the leader was the group's id: nothing is left in it
    assert not Path(f"/proc/{leader}").exists()  # qserve reaped its own child
    assert _dead(grandchild)


@pytest.mark.parametrize(("sig", "code", "name"), [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")])
def test_signal_during_start_up_kills_a_group_that_ignores_sigterm(tmp_path: Path, sig: int, code: int, name: str) -> None:
    proc, pids, _ = _start(tmp_path, "never")
    _wait_ignoring_sigterm(int(pids.read_text().split()[1]))  # the grandchild is up and ignores SIGTERM
    exit_code, seconds, stderr = _stop(proc, sig)
    assert exit_code == code
    assert stderr.strip().splitlines()[-1] == f"stopped by {name}"
    assert GRACE - 1 < seconds < GRACE + 10  # it waited the grace, then killed
    _assert_group_gone(pids)


def test_sigterm_after_ready_kills_the_group_and_exits_143(tmp_path: Path) -> None:
    proc, pids, log = _start(tmp_path, "ok")
    assert proc.stdout.readline() == "ready\n"  # health answered and the first completion came back
    exit_code, seconds, stderr = _stop(proc, signal.SIGTERM)
    assert (exit_code, stderr.strip().splitlines()[-1]) == (143, "stopped by SIGTERM")
    assert seconds < GRACE + 10
    _assert_group_gone(pids)
    assert "stand-in server starting" in log.read_text()  # the child's output went to the log file


def test_sigkill_of_qserve_after_ready_still_ends_the_group(tmp_path: Path) -> None:
    """No handler runs on SIGKILL: the guard sees qserve's end of the lifeline close and stops the group
    (leader and grandchild ignore SIGTERM, so this takes the grace period, then SIGKILL)."""
    proc, pids, _ = _start(tmp_path, "ok")
    assert proc.stdout.readline() == "ready\n"
    leader, grandchild = map(int, pids.read_text().split())
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + GRACE + 10
    while group_members(leader) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group_members(leader) == [] and _dead(grandchild)
    assert time.monotonic() > deadline - 10 - 1  # not before the grace: SIGTERM was tried first


def test_ready_timeout_kills_the_group_with_one_error_line(tmp_path: Path) -> None:
    proc, pids, log = _start(tmp_path, "never", ready_timeout=3)
    proc.wait(timeout=GRACE + 60)
    stderr = proc.stderr.read()
    assert proc.returncode == 1
    assert stderr.strip().splitlines()[-1] == (
        f"error: vLLM server was not ready within 3s (--ready-timeout) and was stopped; its log: {log}"
    )
    _assert_group_gone(pids)


def test_failed_first_generation_is_an_error_and_stops_the_server(tmp_path: Path) -> None:
    proc, pids, log = _start(tmp_path, "fail")
    proc.wait(timeout=GRACE + 60)
    stderr = proc.stderr.read()
    assert proc.returncode == 1 and proc.stdout.read() == ""  # never printed as ready
    assert stderr.strip().splitlines()[-1] == (
        f"error: vLLM server started but failed its first generation request (HTTP 500: boom: no kernel); its log: {log}"
    )
    _assert_group_gone(pids)


@pytest.mark.slow
@needs_vllm("w4a16-gptq", serve=True)
def test_real_server_stopped_during_start_up_exits_within_the_bound(checkpoints) -> None:
    """The real `qserve serve` with vLLM, SIGTERM once vLLM's API server has started its engine (start-up
    under way, not yet ready): exit 143, no vLLM process left."""
    ckpt = checkpoints["w4a16-gptq"]
    proc = subprocess.Popen(
        [*QSERVE, "serve", ckpt, "--skip-gate", "--port", str(free_port())],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    server, guard = _when(lambda: _children(proc.pid))
    _when(lambda: len(group_members(server)) >= 2 or None)  # vLLM's engine process is starting
    assert proc.poll() is None  # vLLM's API server, still starting
    exit_code, seconds, stderr = _stop(proc, signal.SIGTERM)
    assert (exit_code, stderr.strip().splitlines()[-1]) == (143, "stopped by SIGTERM")
    assert seconds < GRACE_SECONDS + 10
    assert group_members(server) == [] and _dead(guard)


def _when(look, seconds: float = 120):
    """What `look` returns once it is neither None nor an AssertionError, polled every 0.2 s."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            found = look()
            if found is not None:
                return found
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        assert time.monotonic() < deadline, f"not seen within {seconds} s"
        time.sleep(0.2)


def _children(pid: int) -> tuple[int, int]:
    """qserve's two children: vLLM's API server (the group's leader) and the group's guard."""
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    cmdlines = {c: Path(f"/proc/{c}/cmdline").read_bytes() for c in children}
    server = [c for c, line in cmdlines.items() if b"qserve.engines.vllm_cli" in line]
    guard = [c for c, line in cmdlines.items() if b"from qserve.runtime.process import guard" in line]
    assert len(children) == 2 and len(server) == len(guard) == 1, cmdlines
    return server[0], guard[0]


def test_probe_runs_in_its_own_group_and_reports_a_crash(tmp_path: Path) -> None:
    """doctor --probe runs in its own process group too; an unreadable checkpoint is a verdict, not a hang."""
    from qserve.support.probe import probe

    (tmp_path / "qserve_manifest.json").write_text(json.dumps({"not": "a manifest"}))
    from qserve.errors import QserveError

    with pytest.raises(QserveError, match=r"^the vLLM probe crashed \(exit 1\): "):
        probe([tmp_path], timeout=120)


# An in-process "engine" through the CLI's own error handling: it works until signalled, then its
# shutdown never ends (a stuck native engine). MODE "hang": the shutdown hangs; "clean": it returns.
IN_PROCESS = r"""
import sys, time
from qserve.cli import _user_errors
from qserve.runtime.process import bounded_in_process_stop

@_user_errors
def work(mode):
    with bounded_in_process_stop(grace=2):
        try:
            print("engine started", flush=True)
            time.sleep(600)
        finally:
            while mode == "hang":
                time.sleep(0.1)

try:
    work(sys.argv[1])
except SystemExit:
    raise
except BaseException as exc:  # typer.Exit outside an app: its code is the process's
    sys.exit(getattr(exc, "exit_code", 99))
"""


@pytest.mark.parametrize(
    ("mode", "sig", "code", "last_line"),
    [
        ("clean", signal.SIGINT, 130, "stopped by SIGINT"),
        ("clean", signal.SIGTERM, 143, "stopped by SIGTERM"),
        ("hang", signal.SIGTERM, 143, "stopped by SIGTERM: the engine did not stop within 2 s"),
        ("hang", signal.SIGINT, 130, "stopped by SIGINT: the engine did not stop within 2 s"),
    ],
)
def test_in_process_engine_stops_within_the_grace(mode: str, sig: int, code: int, last_line: str) -> None:
    """`qserve eval` and `compare` run vLLM inside their own process: a stuck shutdown cannot hold them."""
    proc = subprocess.Popen([sys.executable, "-c", IN_PROCESS, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "engine started\n"
    start = time.monotonic()
    proc.send_signal(sig)
    time.sleep(0.3)
    proc.send_signal(sig)  # a second signal does not cut the shutdown short, nor crash it
    assert proc.wait(timeout=30) == code
    seconds = time.monotonic() - start
    assert proc.stderr.read().strip().splitlines()[-1] == last_line
    assert seconds < (5 if mode == "hang" else 1.5)
