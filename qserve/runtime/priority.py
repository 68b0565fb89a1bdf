"""Idle priority, for work that should run only on what the command beside it leaves: Linux's
SCHED_IDLE (a thread in it runs on a core nothing else wants, and yields it as soon as something
does), and the way back for a process that needs its priority again later.
"""

from __future__ import annotations

import os
from pathlib import Path

AVAILABLE = hasattr(os, "SCHED_IDLE")


def go_idle() -> None:
    """This thread, and the threads it starts from now on, at idle priority."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def idle_until_needed() -> int | None:
    """Go idle, when this process may come back: Linux lets a process leave SCHED_IDLE only within
    its RLIMIT_NICE (0 for most users) or with CAP_SYS_NICE (sched(7)), so it is tried first.
    Returns the policy to come back to (`leave_idle`), or None when it may not come back: then
    this thread is idle for good and the caller should end."""
    policy = os.sched_getscheduler(0)
    go_idle()
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except PermissionError:
        return None
    go_idle()
    return policy


def leave_idle(policy: int) -> None:
    """Every thread of this process back to `policy`: a thread started while idle inherited it."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setscheduler(int(task.name), policy, os.sched_param(0))
        except ProcessLookupError:
            pass  # the thread ended while we looked
