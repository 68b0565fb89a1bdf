"""`qserve run`'s server interpreter, started before the gate is decided (serve.server.warm_server):
idle while it waits, normal once it serves, never told what to serve unless it was started for that
plan, and gone with qserve."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, copy_checkpoint, free_port

SERVING = "qserve: vLLM imported at idle priority while the gate ran; starting the server with qserve's command line"


def _policies(pid: int) -> set[int]:
    """The scheduling policy of every thread of `pid`."""
    policies = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            policies.add(os.sched_getscheduler(int(task.name)))
        except ProcessLookupError:
            pass  # a thread that ended while we looked
    return policies


def _wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)


def test_a_warm_server_waits_idle_and_serves_at_normal_priority(passed_eval, tmp_path: Path) -> None:
    """Every thread of the waiting interpreter is SCHED_IDLE; once `running` gives it the plan's command
    line, the same process serves, and it and its engine core (forked after) have no idle thread left."""
    from qserve.runtime.process import group_members
    from qserve.serve.plan import Endpoint, load_servable, plan
    from qserve.serve.server import running, warm_server

    ckpt = copy_checkpoint(passed_eval[0], tmp_path / "out-w8a8-int8")
    endpoint = Endpoint(port=free_port())
    with warm_server(ckpt, endpoint) as warm:
        pid = warm.proc.pid
        _wait_for(lambda: len(os.listdir(f"/proc/{pid}/task")) > 1)
        assert _policies(pid) == {os.SCHED_IDLE}  # its main thread and the one that reads stdin
        opened, device = load_servable(ckpt)
        manifest = opened.manifest
        with running(plan(ckpt, manifest, device, endpoint), warm=warm) as group:  # returns once it answered
            assert group.proc.pid == pid
            members = group_members(pid)
            assert len(members) == 2  # the API server and its engine core
            assert set().union(*(_policies(m) for m in members)) == {os.SCHED_OTHER}
    assert SERVING in (ckpt / "logs" / "serve.log").read_text()


def test_a_warm_server_is_not_told_another_plans_command_line(passed_eval, tmp_path: Path) -> None:
    """A plan whose environment differs from the one it was started with: it is ended, not used."""
    from qserve.serve.plan import Endpoint
    from qserve.serve.server import warm_server

    ckpt = copy_checkpoint(passed_eval[0], tmp_path / "out-w8a8-int8")
    with warm_server(ckpt, Endpoint(port=free_port())) as warm:
        other = dataclasses.replace(warm.plan, env=warm.plan.env | {"OMP_NUM_THREADS": "1"})
        assert warm.take(other, other.command) is None
        assert warm.proc.returncode == 0
    log = (ckpt / "logs" / "serve.log").read_text()
    assert "qserve: no command line came (qserve ended, or the gate did not pass); nothing served from this interpreter" in log
    assert SERVING not in log


def test_a_warm_server_ends_with_a_killed_qserve(passed_eval, tmp_path: Path) -> None:
    """qserve killed by SIGKILL while the gate runs (no handler, no `finally`): end-of-file on the
    interpreter's stdin ends it at once, even in the middle of its imports."""
    from qserve.runtime.process import group_members

    ckpt = copy_checkpoint(passed_eval[0], tmp_path / "out-w8a8-int8")
    code = (
        "import os, signal\n"
        "from pathlib import Path\n"
        "from qserve.serve.plan import Endpoint\n"
        "from qserve.serve.server import warm_server\n"
        f"with warm_server(Path({str(ckpt)!r}), Endpoint(port={free_port()})) as warm:\n"
        "    print(warm.proc.pid, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == -9, proc.stderr
    pid = int(proc.stdout)
    _wait_for(lambda: not group_members(pid), timeout=10)
    assert group_members(pid) == []


def test_a_user_who_may_not_leave_idle_priority_gets_no_warm_server() -> None:
    """Linux lets a process leave SCHED_IDLE only within RLIMIT_NICE or with CAP_SYS_NICE: as most
    users' processes (RLIMIT_NICE 0, CAP_SYS_NICE dropped from this root's bounding set), the interpreter
    ends at once (and `serve` starts one the usual way) rather than serve at idle priority."""
    import resource

    command = ["setpriv", "--bounding-set=-sys_nice", sys.executable, "-m", "qserve.engines.vllm_cli", "--await-command"]
    proc = subprocess.run(
        command,
        input="",
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NICE, (0, 0)),
    )
    assert (proc.returncode, proc.stdout) == (
        0,
        "qserve: this user may not bring a process back from idle priority (RLIMIT_NICE, CAP_SYS_NICE); "
        "nothing served from this interpreter\n",
    ), proc.stderr


def test_a_held_log_opens_with_qserves_lines_whatever_the_server_wrote_before(tmp_path: Path) -> None:
    """The warm server's interpreter writes (vLLM's import-time lines) before the gate's header is
    known: its output waits until the header is written, so the log's first lines are qserve's."""
    from qserve.serve.server import _log_sink

    log, wrote = tmp_path / "serve.log", tmp_path / "wrote"
    script = f"echo early; touch {wrote}; read x; echo late"
    sink = _log_sink(log, verbose=False, held=True)
    proc = subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE, stdout=sink.stdout, stderr=subprocess.STDOUT)
    sink.start(proc)
    _wait_for(wrote.exists, timeout=10)
    time.sleep(0.2)  # the copier has read "early" by now, or reads it later: the order holds either way
    sink.write_header(["gate PASS (look 1)", "override: --policy loose.yaml"])
    proc.stdin.close()
    proc.wait(timeout=10)
    sink.__exit__(None, None, None)
    assert log.read_text().splitlines() == [
        "qserve: gate PASS (look 1)",
        "qserve: override: --policy loose.yaml",
        "early",
        "late",
    ]
