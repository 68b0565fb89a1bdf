"""Library output into a log file, qserve's own steps on the terminal.

llm-compressor (loguru), vLLM (logging, C++ and child processes), transformers, lm-eval and tqdm
all write to file descriptors 1 and 2. While `library_output` is active those descriptors point at
the log file, so everything they print, Python or native, child processes included, is kept and
nothing reaches the terminal; qserve's own lines (`progress.info`) go to the saved terminal.
tqdm bars in that stream are read back as counts (layers calibrated i/N, requests i/N) and shown as
qserve's progress.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from qserve import progress
from qserve.errors import QserveError, Stopped
from qserve.paths import open_log

# "(12/30): Calibrating:  40%|████      | 13/32 [..." or "Processed prompts:  45%|...| 9/20 [..."
TQDM = re.compile(r"(?P<desc>[^\r\n|]*?):\s+\d+%\|[^|\r\n]*\|\s*(?P<n>\d+)/(?P<total>\d+)")
LAYER = re.compile(r"^\((?P<i>\d+)/(?P<n>\d+)\):\s*(?P<what>.*)$")


@contextmanager
def library_output(log_path: Path, verbose: bool = False) -> Iterator[Path]:
    """Point fds 1 and 2 at `log_path` (this run's log, replaced) for the duration; with `verbose`
    the log is also copied to the terminal as it grows.

    The descriptors point at the file itself, so a native crash (an abort in a kernel) loses
    nothing. An exception that is not the user's (a library's own error) is logged with its
    traceback and becomes one QserveError line naming the log; any failure prints the log's path.
    """
    # vLLM logs to stdout by default, through a handler bound at import: after this block stdout is
    # the result's again, so vLLM (and children, who inherit it) must log to stderr.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    sys.stdout.flush()
    sys.stderr.flush()
    # The earlier run's log is set aside and put back if this run writes nothing: a mistake found
    # before any library spoke (a task name's typo) deletes no log. This run still writes the log's
    # own path, so a native crash leaves its output where the user looks.
    if log_path.is_symlink():
        raise QserveError(f"log file {log_path} is a symbolic link; qserve does not write through links: remove it")
    earlier = log_path.with_name(f".{log_path.name}.previous")
    if log_path.is_file():
        os.replace(log_path, earlier)
    saved_out, saved_err = os.dup(1), os.dup(2)
    # Nested in another command's log (compare's steps each keep their own): qserve's lines still go
    # to the terminal the outer block saved, not into the outer log.
    outer = progress.terminal_in_use()
    terminal = os.fdopen(os.dup(outer.fileno() if outer is not None else saved_err), "w", buffering=1)
    fd = open_log(log_path)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    done = threading.Event()
    # Opened here, not in the thread: a run that fails at once removes its empty log before a thread
    # might have opened it.
    reader = os.fdopen(os.open(log_path, os.O_RDONLY | os.O_NOFOLLOW), "rb")
    follower = threading.Thread(target=_follow, args=(reader, done, verbose), daemon=True)
    follower.start()
    previous = progress.use_terminal(terminal)
    failed = True
    try:
        yield log_path
        failed = False
    except (QserveError, KeyboardInterrupt, SystemExit, Stopped):
        if log_path.stat().st_size:
            progress.info(f"log: {log_path}")
        raise
    except Exception as exc:  # a library's own failure: the traceback goes to the log, one line to the user
        traceback.print_exc()
        raise QserveError(f"{type(exc).__name__}: {_first_line(exc)} (traceback in {log_path})") from None
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        done.set()
        follower.join(timeout=5)
        progress.use_terminal(previous)
        terminal.close()
        _settle(log_path, earlier, failed)


def _settle(log_path: Path, earlier: Path, failed: bool) -> None:
    """Keep this run's log if it succeeded or holds anything; else the earlier one goes back (or none is left)."""
    if not failed or log_path.stat().st_size:
        earlier.unlink(missing_ok=True)
    elif earlier.is_file():
        os.replace(earlier, log_path)
    else:
        log_path.unlink()


def _first_line(exc: BaseException) -> str:
    """The message's first line; for a pydantic ValidationError (vLLM's config checks) the first
    line only counts the errors, so its first error's own message."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError) and exc.errors():
        return str(exc.errors()[0]["msg"]).splitlines()[0][:300]
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else "no message"


def _follow(reader: BinaryIO, done: threading.Event, echo: bool) -> None:
    """Read the log as it grows: copy whole lines to the terminal when verbose (never half a line
    between two of qserve's), else report tqdm counts."""
    pending = b""
    with reader as log:
        while True:
            finished = done.is_set()  # read once more after the end: nothing written last is missed
            pending += log.read()
            cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1 if not finished else len(pending)
            text, pending = pending[:cut].decode(errors="replace"), pending[cut:]
            if text and echo:
                progress.echo(text)
            elif text:
                _report_counts(text)
            elif finished:
                return
            else:
                done.wait(0.2)


def _report_counts(text: str) -> None:
    for match in TQDM.finditer(text):
        desc, n, total = match["desc"].strip(), int(match["n"]), int(match["total"])
        layer = LAYER.match(desc)
        if layer:  # llm-compressor's sequential pipeline: one bar per layer and phase
            done = int(layer["i"]) - 1 + (n == total and "Propagating" in layer["what"])
            progress.count("layers calibrated", done, int(layer["n"]))
        elif desc:
            progress.count(desc, n, total)
