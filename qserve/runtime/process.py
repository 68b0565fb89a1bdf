"""Child process groups that qserve owns (vLLM servers, probes): a stop ends them in bounded time.

A child runs in its own session, so its process group holds the vLLM API server and the
engine-core and worker processes it spawns. SIGINT or SIGTERM to qserve sends SIGTERM to that
group; whatever is still alive `GRACE_SECONDS` later is killed with SIGKILL and reaped, and
qserve exits 130 (SIGINT) or 143 (SIGTERM). A child that ignores SIGTERM cannot hold qserve.

A qserve that cannot run its handlers (SIGKILL, a crash, the OOM killer) still takes the group
with it: each group has a guard, a small process in a session of its own that holds one end of a
pipe whose other end only qserve holds. When qserve ends, however it ends, the kernel closes its
end; the guard reads end-of-file and stops the group exactly as a signal would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from qserve.errors import Stopped

GRACE_SECONDS = 15.0
_POLL = 0.2


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group `pgid`, read from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


class ProcessGroup:
    """Start `command` in a new session; SIGINT/SIGTERM to qserve stop the whole group within the grace.

    Polling loops call `check_stop()` (raises Stopped once a stop was requested and the group is
    gone); `wait()` waits for the child or a stop; `close()` stops the group if it still runs and
    restores the signal handlers.
    """

    def __init__(
        self,
        command: list[str],
        env: dict[str, str] | None = None,
        stdout: IO[Any] | int | None = None,
        stderr: IO[Any] | int | None = subprocess.STDOUT,
        grace: float = GRACE_SECONDS,
        started: subprocess.Popen | None = None,
    ) -> None:
        self.grace = grace
        self.signum: int | None = None
        # `started`: a child already running in a session of its own, taken over instead of `command`
        self.proc = started or subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
        self._guard, self._lifeline = _start_guard(self.proc.pid, grace)
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: Any) -> None:
        # Only the first signal counts: a second Ctrl-C must not turn a clean stop into a crash.
        if self.signum is None:
            self.signum = signum
            self._send(signal.SIGTERM)

    def _send(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass  # the whole group has already gone

    def running(self) -> bool:
        self.proc.poll()  # reap the leader, so it does not count as alive
        return bool(group_members(self.proc.pid))

    def stop(self) -> None:
        """SIGTERM the group, give it the grace period, then SIGKILL whatever is left; reap the child."""
        self._send(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while self.running() and time.monotonic() < deadline:
            time.sleep(_POLL)
        if self.running():
            self._send(signal.SIGKILL)
        self.proc.wait()
        while group_members(self.proc.pid) and time.monotonic() < deadline + 5:
            time.sleep(_POLL)  # SIGKILL is not instant for a process in the kernel

    def check_stop(self) -> None:
        if self.signum is not None:
            self.stop()
            raise Stopped(self.signum)

    def wait(self, timeout: float | None = None) -> int | None:
        """The child's exit code (None after `timeout` seconds); raises Stopped when a signal asked qserve to stop."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            self.check_stop()
            code = self.proc.poll()
            if code is not None:
                return code
            time.sleep(_POLL)
        return None

    def close(self) -> None:
        if self.running():
            self.stop()
        self.proc.wait()
        os.close(self._lifeline)  # the guard finds the group gone and exits
        self._guard.wait()
        for sig, handler in self._old.items():
            # After a signalled stop, ignore repeats: SIG_IGN survives interpreter shutdown,
            # which resets Python-level handlers to the default (a late Ctrl-C would kill us).
            signal.signal(sig, signal.SIG_IGN if self.signum is not None else handler)


def _start_guard(pgid: int, grace: float) -> tuple[subprocess.Popen, int]:
    """The guard of group `pgid` and qserve's end of its lifeline (a pipe no other process holds:
    os.pipe's descriptors are not inherited by children started later)."""
    read_end, lifeline = os.pipe()
    code = f"from qserve.runtime.process import guard; guard({pgid}, {grace!r})"
    guard_proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    os.close(read_end)
    return guard_proc, lifeline


def guard(pgid: int, grace: float) -> None:
    """Wait for end-of-file on stdin (qserve has ended or closed the group), then stop group `pgid`:
    SIGTERM, the grace period, SIGKILL for what is left."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its session has no terminal; be sure anyway
    while os.read(0, 4096):
        pass
    deadline = time.monotonic() + grace
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not group_members(pgid):
            return
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return  # gone between the look and the signal
        while sig == signal.SIGTERM and group_members(pgid) and time.monotonic() < deadline:
            time.sleep(_POLL)


class bounded_in_process_stop:
    """For work that runs a vLLM engine inside this process (`qserve eval`, `qserve compare`).

    SIGINT or SIGTERM raises Stopped at the next Python instruction, so the engine is shut down
    and the CLI exits 130 or 143. An engine stuck in a native call or in its own shutdown cannot
    hold qserve: `grace` seconds after the signal a watchdog ends the process with the same code.
    The in-process engine has no worker processes on CPU (executor "uni"), so nothing is orphaned.
    """

    def __init__(self, grace: float = GRACE_SECONDS) -> None:
        self.grace = grace
        self.signum: int | None = None

    def __enter__(self) -> bounded_in_process_stop:
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, signal.SIG_IGN if self.signum is not None else handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            return  # one stop per run: a second Ctrl-C does not cut the shutdown short
        self.signum = signum
        import threading

        threading.Thread(target=self._watchdog, daemon=True).start()
        raise Stopped(signum)

    def _watchdog(self) -> None:
        time.sleep(self.grace)
        os.write(2, f"stopped by {signal.Signals(self.signum).name}: the engine did not stop within {self.grace:g} s\n".encode())
        os._exit(128 + self.signum)
