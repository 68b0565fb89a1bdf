"""`make demo` as a newcomer runs it (README's first command), timed for the benchmarks page.

A fresh clone of this checkout's HEAD and an empty QSERVE_CACHE_DIR; the clock runs from `make demo`
until qserve prints that it serves. Each step's start and length come from qserve's own step lines
(progress.step_line), stamped as they arrive, so the phases are what the terminal showed; the time
outside them (make setup, imports, the work between steps) is shown as such.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from qserve.errors import QserveError
from qserve.progress import info, step_line

COMMAND = ["make", "demo"]
SERVING = "serving "  # serve/server.py's line once the server answers
TIMEOUT = 1800.0  # seconds: a demo not serving by then is reported as such, not waited for
# The project's goals, seconds from `make demo` to serving (fresh clone, empty cache): looser on a CPU
# without a bfloat16 kernel, which computes the baseline and the calibration in float32.
GOAL_SECONDS = {True: 150.0, False: 200.0}


def time_demo(work_dir: Path, data_dir: Path) -> dict[str, Any]:
    """Clone, run `make demo` until it serves, stop it; the timed lines' phases and the machine."""
    from qserve.bench import peak
    from qserve.device import detect

    repo = _checkout()
    work_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="demo-", dir=work_dir)).resolve()  # this command's own, removed at the end
    try:
        clone, cache = scratch / "clone", scratch / "cache"
        subprocess.run(["git", "clone", "--quiet", str(repo), str(clone)], check=True)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True, check=True)
        cache.mkdir()
        env = os.environ | {"QSERVE_CACHE_DIR": str(cache), "QSERVE_DATA_DIR": str(data_dir)}
        with (work_dir / "demo.log").open("w") as log:
            lines = run_until_serving(COMMAND, clone, env, log)
        result = {"command": " ".join(COMMAND), "machine": detect.machine() | {"commit": head.stdout.strip()}}
        result |= phases(lines, str(scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    native = detect.native_bfloat16()
    rate = max(peak.matmul_gflops("bfloat16").values())  # after the demo: the page's machine key
    result |= {"bfloat16_kernel": native, "bfloat16_matmul_gflops": round(rate, 1), "goal_seconds": GOAL_SECONDS[native]}
    return result | {"met": result["served_seconds"] <= result["goal_seconds"]}


def _checkout() -> Path:
    """The git checkout qserve runs from: the demo is timed on its committed HEAD."""
    repo = Path(__file__).resolve().parents[2]
    if not (repo / ".git").exists() or not (repo / "Makefile").is_file():
        raise QserveError(f"qserve bench --demo times `make demo` in a clone of qserve's repository; {repo} is not one")
    return repo


def run_until_serving(command: list[str], cwd: Path, env: dict[str, str], log) -> list[tuple[float, str]]:
    """Run `command` in its own process group, each output line stamped with the seconds since its
    start (and written to `log`), until the serving line; then end the group."""
    start = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    watchdog = threading.Timer(TIMEOUT, _end_group, (proc,))
    watchdog.start()
    lines: list[tuple[float, str]] = []
    try:
        for raw in proc.stdout:
            stamped = (round(time.monotonic() - start, 2), raw.rstrip("\n"))
            lines.append(stamped)
            log.write(f"{stamped[0]:8.2f} {stamped[1]}\n")
            log.flush()
            if stamped[1].startswith(SERVING):
                info(f"`{' '.join(command)}` served after {stamped[0]:.1f} s; stopping it")
                break
            if step_line(stamped[1]):
                info(f"  {stamped[0]:6.1f} s  {stamped[1]}")
    finally:
        watchdog.cancel()
        _end_group(proc)
    if not lines or not lines[-1][1].startswith(SERVING):
        raise QserveError(f"`{' '.join(command)}` ended (exit {proc.returncode}) before serving; its output: {log.name}")
    return lines


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the demo's process group (make, qserve, vLLM's server), SIGKILL to what outlives 15 s."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def phases(lines: list[tuple[float, str]], scratch: str = "") -> dict[str, Any]:
    """From stamped lines: seconds to the serving line, to the line where make starts `qserve run`
    (make setup before it), each step's start and length (paths under `scratch` shortened), and the
    seconds after setup in no step (imports, checks, the work between steps)."""
    started: dict[str, float] = {}
    steps = []
    for stamp, line in lines:
        found = step_line(line)
        if found is None:
            continue
        kind, name = found
        if kind == "start":
            started[name] = stamp
        elif name in started:
            begun = started.pop(name)
            steps.append(
                {"step": name.replace(scratch, "$WORK") if scratch else name, "start": begun, "seconds": round(stamp - begun, 2)}
            )
    served = lines[-1][0]
    run = next((stamp for stamp, line in lines if " qserve run " in f" {line} "), None)
    return {
        "served_seconds": served,
        "setup_seconds": run,
        "steps": steps,
        "outside_steps_seconds": round(served - (run or 0.0) - _covered(steps), 2),
    }


def _covered(steps: list[dict[str, Any]]) -> float:
    """Seconds inside at least one step (steps may nest: a step inside another counts once)."""
    covered, reach = 0.0, 0.0
    for s in sorted(steps, key=lambda s: s["start"]):
        end = s["start"] + s["seconds"]
        covered += max(0.0, end - max(s["start"], reach))
        reach = max(reach, end)
    return covered


def markdown(result: dict[str, Any]) -> str:
    """The page's section for one host: the total against its goal, then each step."""
    m = result["machine"]
    kernel = "with" if result["bfloat16_kernel"] else "without"
    lines = [
        f"Produced by `qserve bench --demo` ({result['command']} from a fresh clone, empty QSERVE_CACHE_DIR) on "
        f"{m['time'][:10]}, commit {m['commit']}, {m['cpu']}, {m['cpus']} cores, {kernel} a bfloat16 kernel.",
        "",
        f"**Served after {result['served_seconds']:.1f} s** (goal on a CPU {kernel} a bfloat16 kernel: "
        f"{result['goal_seconds']:.0f} s; {'met' if result['met'] else 'NOT met'}).",
        "",
        "| from | step | seconds |",
        "|---|---|---|",
    ]
    if result["setup_seconds"] is not None:
        lines.append(f"| 0.0 | make setup (uv sync of the clone's environment) | {result['setup_seconds']:.1f} |")
    lines += [f"| {s['start']:.1f} | {s['step']} | {s['seconds']:.1f} |" for s in result["steps"]]
    lines.append(
        f"| | in no step after setup (imports, checks, the work between steps) | {result['outside_steps_seconds']:.1f} |"
    )
    return "\n".join(lines) + "\n"
