"""The demo benchmark's parts: reading qserve's step lines, the phases, and stopping a run at serving."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest

from qserve import progress
from qserve.bench.demo import phases, run_until_serving
from qserve.errors import QserveError


def test_step_line_reads_the_lines_step_writes() -> None:
    out = io.StringIO()
    previous = progress.use_terminal(out)
    try:
        with progress.step("converting the model into /tmp/x (GGUF, one-off)"):
            time.sleep(0.01)
    finally:
        progress.use_terminal(previous)
    opened, closed = out.getvalue().splitlines()
    name = "converting the model into /tmp/x (GGUF, one-off)"
    assert progress.step_line(opened) == ("start", name)
    assert progress.step_line(closed) == ("ok", name)
    assert progress.step_line(f"ok {name} ({progress.fmt_seconds(65.4)})") == ("ok", name)  # "1m05s"


@pytest.mark.parametrize(
    "line",
    [
        "  ... quantizing: 30.0s elapsed (layers calibrated 16/31)",  # a heartbeat
        "x quantizing failed after 3.0s",
        "ok then (fine)",
        "> a step without its dots",
        "checkpoint written to out-w8a8-int8",
    ],
)
def test_other_lines_are_no_step(line: str) -> None:
    assert progress.step_line(line) is None


def test_phases_of_stamped_lines() -> None:
    lines = [
        (0.2, "python3 -m uv sync --locked --extra cpu --quiet"),
        (8.6, "python3 -m uv run --no-sync qserve run recipes/w8a8-int8.yaml --tasks gsm8k_ppl --limit 100"),
        (9.6, "> converting the model into /S/cache/models/m ..."),
        (38.5, "ok converting the model into /S/cache/models/m (28.9s)"),
        (40.0, "> lm-eval ..."),
        (41.0, "> inner ..."),  # a step inside another counts once in the time outside steps
        (42.0, "ok inner (1.0s)"),
        (95.0, "ok lm-eval (55.0s)"),
        (100.0, "serving out at http://127.0.0.1:8000/v1"),
    ]
    got = phases(lines, "/S")
    assert got["served_seconds"] == 100.0 and got["setup_seconds"] == 8.6
    assert got["steps"] == [
        {"step": "converting the model into $WORK/cache/models/m", "start": 9.6, "seconds": 28.9},
        {"step": "inner", "start": 41.0, "seconds": 1.0},
        {"step": "lm-eval", "start": 40.0, "seconds": 55.0},
    ]
    assert got["outside_steps_seconds"] == pytest.approx(100.0 - 8.6 - 28.9 - 55.0)


def test_the_run_stops_at_the_serving_line_and_ends_its_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = (
        f"echo '> a step ...'; echo 'ok a step (0.0s)'; sleep 300 & echo $! > {pid_file}; echo 'serving m at http://x/v1'; wait"
    )
    log = io.StringIO()
    log.name = "demo.log"
    start = time.monotonic()
    lines = run_until_serving(["bash", "-c", script], tmp_path, dict(os.environ), log)
    assert time.monotonic() - start < 30
    assert [text for _, text in lines] == ["> a step ...", "ok a step (0.0s)", "serving m at http://x/v1"]
    assert not _running(int(pid_file.read_text()))  # the server-like child went with the group
    assert log.getvalue().splitlines()[-1].endswith(" serving m at http://x/v1")


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever reaps it, which need not be at once)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_run_that_ends_before_serving_is_one_error(tmp_path: Path) -> None:
    log = io.StringIO()
    log.name = "demo.log"
    with pytest.raises(
        QserveError,
        match=r"^`bash -c echo 'error: no such recipe'; exit 1` ended \(exit 1\) before serving; its output: demo.log$",
    ):
        run_until_serving(["bash", "-c", "echo 'error: no such recipe'; exit 1"], tmp_path, dict(os.environ), log)
