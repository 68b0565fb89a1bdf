"""Progress lines with elapsed time for long steps, on stderr so stdout stays parseable."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


def info(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fmt_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    return f"{minutes}m{sec:02d}s"


@contextmanager
def step(name: str, heartbeat: float = 30.0) -> Iterator[dict]:
    """Announce a step, print a heartbeat while it runs, and its elapsed time at the end.

    Yields a dict whose "seconds" key holds the duration once the step ends.
    """
    info(f"> {name} ...")
    start = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(heartbeat):
            info(f"  ... {name}: {fmt_seconds(time.monotonic() - start)} elapsed")

    ticker = threading.Thread(target=beat, daemon=True)
    ticker.start()
    timing: dict = {}
    try:
        yield timing
    except BaseException:
        info(f"x {name} failed after {fmt_seconds(time.monotonic() - start)}")
        raise
    finally:
        done.set()
        timing["seconds"] = round(time.monotonic() - start, 2)
    info(f"ok {name} ({fmt_seconds(timing['seconds'])})")
