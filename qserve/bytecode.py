"""Python's bytecode for the libraries qserve imports, compiled on the idle core the first time qserve
runs in a fresh virtual environment.

uv installs packages without their .pyc files (pip compiles them at install), so the first run in a
fresh environment compiles every module it imports, serially, on one core; compiling everything at
install (`uv sync --compile-bytecode`) takes every file of every package, most never imported. The
measurements, with and without this module: docs/install.md, "A fresh environment has no bytecode".

So the first qserve command starts one child, at the lowest CPU priority (nice 19 and Linux's
SCHED_IDLE: it runs only on a core nothing else wants), that compiles the installed libraries while
the command works, on the core that the command's single-threaded imports and steps leave idle. It
first imports what `qserve run`'s later steps import (IMPORTS): an import compiles exactly the
modules a step will load, of which there are far fewer than files in their distributions (the demo
loads 7,126 of 30,737). In the demo most of that is done while the embedded model is converted.
Then, as a fresh process (so as not to hold those libraries in memory), it compiles every other file
of the installed libraries in the order `qserve run` needs them (STAGES: each library with the
distributions it requires, then everything else qserve requires).

Each .pyc is written as an import writes it (atomically, timestamp-checked). When the child has gone
through every file it marks the environment done and later commands start none; a child stopped
early (it ends with its parent) leaves the rest to the next command. Nothing is done outside a
virtual environment, or when the user asked Python not to write bytecode.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

# Top-level packages in the order `qserve run` imports them after torch: conversion (transformers),
# quantization, the eval engine, lm-eval. Not torch: every command imports it first, so the child
# would only compile what the command is compiling at the same moment. A name that is not installed
# only costs speed.
STAGES = ("transformers", "llmcompressor", "vllm", "lm_eval")
ROOT = "qserve"
# What `qserve run`'s steps import, in the order that keeps the child ahead of the command. First what
# transformers' model classes import beside torch and which needs no torch: sympy (through torch.fx),
# and sklearn with scipy and pandas (its generation utilities); the conversion imports torch
# meanwhile. Then quantize's, eval's and the server's entry points. A name that is not installed only
# costs speed (tests/test_bytecode.py checks that each is).
IMPORTS = (
    "sympy",
    "scipy.stats",
    "pandas",
    "sklearn",
    "llmcompressor",
    "vllm.config",
    "lm_eval.models.vllm_causallms",
    "vllm.entrypoints.openai.api_server",
)
_started: list[subprocess.Popen] = []


def marker() -> Path | None:
    """The file that says this environment's libraries are compiled; None outside a venv or in one
    this user cannot write to."""
    if sys.prefix == sys.base_prefix or not os.access(sys.prefix, os.W_OK):
        return None
    return Path(sys.prefix) / ".qserve-bytecode-compiled"


def warm_in_background(done: Path | None = None, imports: Sequence[str] = IMPORTS) -> None:
    """Start the child that imports `imports` and then compiles the rest, unless `done` (default: this
    environment's marker) exists, bytecode is off, or this process started one already. The child
    ends when this process exits."""
    done = done or marker()
    if done is None or done.exists() or sys.dont_write_bytecode or _started:
        return
    child = subprocess.Popen(
        _command(os.getpid(), done, *imports),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _started.append(child)
    atexit.register(_stop, child)


def finish_before_timing(done: Path | None = None) -> None:
    """Let this environment's compiling end before anything is timed: the child yields its core to the
    command's threads but not the caches and memory bandwidth they share, and a fresh clone's first
    benchmark runs would have it beside them. Waits for the child that holds the lock, else compiles
    what is left here."""
    done = done or marker()
    if done is None or done.exists() or sys.dont_write_bytecode:
        return
    from qserve.progress import step

    with step("compiling this environment's bytecode before timing (once per environment)"):
        compile_all(done, sources(), wait=True)


def _command(*args: object) -> list[str]:
    """This module as a child process's command (`__spec__`: its name also when run with -m)."""
    return [sys.executable, "-m", __spec__.name, *map(str, args)]


def _stop(child: subprocess.Popen) -> None:
    child.terminate()
    child.wait()


def sources(stages: Iterable[str] = STAGES, root: str = ROOT) -> Iterator[Path]:
    """The .py files of the distributions behind `stages` (top-level import names), each followed by
    the distributions it requires, directly or not, then of the rest of what `root` requires (with
    its extras: vLLM is one); each distribution and each file once (a file can be in two
    distributions' records: setuptools vendors tomli and zipp, whose own metadata is found once
    setuptools has put its _vendor folder on sys.path)."""
    by_package = importlib.metadata.packages_distributions()
    seen: set[str] = set()
    files: set[Path] = set()
    for name in [*(d for stage in stages for d in by_package.get(stage, [])), root]:
        for file in _closure(name, seen, extras=name == root):
            if file not in files:
                files.add(file)
                yield file


def _closure(name: str, seen: set[str], extras: bool = False) -> Iterator[Path]:
    """Breadth-first from distribution `name` through its requirements (and its extras', with
    `extras`), skipping `seen` ones."""
    from packaging.utils import canonicalize_name

    queue = [name]
    while queue:
        current = queue.pop(0)
        key = canonicalize_name(current)
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = importlib.metadata.distribution(current)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional requirement that is not installed
        yield from (Path(f.locate()) for f in dist.files or [] if f.suffix == ".py")
        queue += _requirements_of(dist, extras=extras and current == name)


def _requirements_of(dist: importlib.metadata.Distribution, extras: bool = False) -> list[str]:
    """The distribution names `dist` requires on this platform; with `extras`, also those its extras
    require (an extra's requirement that is not installed is skipped later)."""
    from packaging.requirements import Requirement

    wanted = [""] + ((dist.metadata.get_all("Provides-Extra") or []) if extras else [])
    requirements = [Requirement(r) for r in dist.requires or []]
    return [r.name for r in requirements if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in wanted)]


def import_ahead(modules: Iterable[str], parent: int) -> bool:
    """Import each of `modules`, which writes the bytecode of every module each one loads; False once
    `parent` is no longer this process's parent."""
    for name in modules:
        if os.getppid() != parent:
            return False
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 -- a library that fails to import here fails in the step, which says why
            continue
    return True


def compile_all(done: Path, files: Iterable[Path], parent: int | None = None, wait: bool = False) -> bool:
    """Compile each of `files` that has no up-to-date .pyc, then write `done`. Returns False at once
    when another process holds the lock (with `wait`, waits for it, and returns True if that process
    finished), and stops (False) once `parent` is no longer this process's parent (the command was
    killed without stopping us)."""
    import compileall
    import fcntl
    import py_compile

    with open(done.with_name(done.name + ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        if done.exists():
            return True
        for source in files:
            if parent is not None and os.getppid() != parent:
                return False
            # timestamp-checked, as an import writes them (compileall writes hash-checked ones when
            # SOURCE_DATE_EPOCH is set, and every later import would then hash the source)
            compileall.compile_file(str(source), quiet=2, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
        done.touch()
        return True


def _child(parent: int, done: Path, imports: list[str]) -> None:
    """Import `imports`, then go on as a fresh process (the same pid, priority and parent, no
    `imports`) that compiles the rest, so that what was imported is not held in memory meanwhile."""
    from qserve import priority

    os.nice(19)  # only what the command running beside it leaves idle (19 at most: the same after the exec)
    if priority.AVAILABLE:  # and preempted at once when one of its threads wakes
        priority.go_idle()
    if not imports:
        compile_all(done, sources(), parent=parent)
    elif import_ahead(imports, parent):
        os.execv(sys.executable, _command(parent, done))


if __name__ == "__main__":
    _child(int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
