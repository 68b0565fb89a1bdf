"""qserve's own terminal lines: steps with elapsed time, and counted progress with an ETA.

Everything goes to stderr (stdout stays for results). While `capture.library_output` is active,
stderr is the log file, so these lines go to the terminal it saved (`use_terminal`). On a terminal,
counted work (layers calibrated, lm-eval requests) is a rich progress bar with an ETA; elsewhere (CI,
a pipe) the step's heartbeat line carries the latest count instead, so logs stay line-based.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

_terminal: TextIO | None = None  # None: the current sys.stderr
_lock = threading.Lock()
_bars: dict = {"progress": None, "tasks": {}, "latest": None, "depth": 0}


def use_terminal(stream: TextIO | None) -> TextIO | None:
    """Write qserve's lines to `stream` (None: sys.stderr); returns the previous choice."""
    global _terminal
    previous, _terminal = _terminal, stream
    return previous


def terminal_in_use() -> TextIO | None:
    """The stream qserve's lines go to (None: sys.stderr)."""
    return _terminal


def _out() -> TextIO:
    return _terminal or sys.stderr


def info(msg: str) -> None:
    with _lock:
        progress = _bars["progress"]
        if progress is not None:
            progress.console.print(msg, markup=False, highlight=False)
        else:
            print(msg, file=_out(), flush=True)


def echo(text: str) -> None:
    """Library output shown live (--verbose): whole lines, never inside one of qserve's."""
    with _lock:
        if _bars["progress"] is not None:
            _bars["progress"].console.out(text, end="", highlight=False)
            return
        out = _out()
        out.write(text)
        out.flush()


def fmt_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    return f"{minutes}m{sec:02d}s"


def count(what: str, done: int, total: int) -> None:
    """Report `done` of `total` for a countable piece of work inside the current step."""
    with _lock:
        _bars["latest"] = (what, done, total)
        progress = _bars["progress"]
        if progress is None:
            return
        task = _bars["tasks"].get(what)
        if task is None:
            task = _bars["tasks"][what] = progress.add_task(what, total=total)
        progress.update(task, completed=done, total=total)


@contextmanager
def step(name: str, heartbeat: float = 30.0) -> Iterator[dict]:
    """Announce a step, show progress while it runs, and its elapsed time at the end.

    Yields a dict whose "seconds" key holds the duration once the step ends.
    """
    info(f"> {name} ...")
    start = time.monotonic()
    done = threading.Event()
    _start_bars()

    def beat() -> None:
        while not done.wait(heartbeat):
            latest = _bars["latest"]
            counted = f" ({latest[0]} {latest[1]}/{latest[2]})" if latest else ""
            if _bars["progress"] is None:
                info(f"  ... {name}: {fmt_seconds(time.monotonic() - start)} elapsed{counted}")

    ticker = threading.Thread(target=beat, daemon=True)
    ticker.start()
    timing: dict = {}
    try:
        yield timing
    except BaseException:
        _stop_bars()
        info(f"x {name} failed after {fmt_seconds(time.monotonic() - start)}")
        raise
    finally:
        done.set()
        timing["seconds"] = round(time.monotonic() - start, 2)
    _stop_bars()
    info(f"ok {name} ({fmt_seconds(timing['seconds'])})")


def step_line(line: str) -> tuple[str, str] | None:
    """("start", name) for `step`'s opening line, ("ok", name) for its closing one, None for any other
    line: how a caller reading qserve's output (the demo benchmark) finds the steps."""
    if line.startswith("> ") and line.endswith(" ..."):
        return "start", line[2:-4]
    closing = re.fullmatch(r"ok (.+) \((\d+\.\ds|\d+m\d\ds)\)", line)
    return ("ok", closing.group(1)) if closing else None


def _start_bars() -> None:
    """A transient rich progress display for this step's counts, only on an interactive terminal."""
    with _lock:
        _bars["latest"], _bars["depth"] = None, _bars["depth"] + 1
        if _bars["depth"] > 1 or not _out().isatty():
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(
            TextColumn("  {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(file=_out()),
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,  # library output belongs to the log
        )
        progress.start()
        _bars["progress"], _bars["tasks"] = progress, {}


def _stop_bars() -> None:
    """Close the display when the outermost step ends (steps nest: eval's lm-eval inside `run`)."""
    with _lock:
        _bars["depth"] = max(0, _bars["depth"] - 1)
        if _bars["depth"]:
            return
        progress, _bars["progress"] = _bars["progress"], None
    if progress is not None:
        progress.stop()
