"""CLI surface: help is instant (no heavy imports), flags are validated, errors are one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_qserve, run_qserve_in_process

HEAVY = ("torch", "vllm", "llmcompressor", "lm_eval", "transformers", "quark", "scipy", "model_signing")


def test_help_imports_nothing_heavy() -> None:
    code = (
        "import sys; from typer.testing import CliRunner; from qserve.cli import app\n"
        "for cmd in ('quantize', 'eval', 'serve', 'sign', 'run', 'reproduce', 'inspect', 'compare', 'bench', 'doctor'):\n"
        "    r = CliRunner().invoke(app, [cmd, '--help']); assert r.exit_code == 0, r.output\n"
        "for args in (['--help'],):\n"
        "    r = CliRunner().invoke(app, args); assert r.exit_code == 0, r.output\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    "cmd",
    [
        "run",
        "quantize",
        "eval",
        "serve",
        "reproduce",
        "inspect",
        "sign",
        "compare",
        "bench",
        "doctor",
        "tune",
        "gate",
        "gate-levels",
    ],
)
def test_subcommand_help_teaches_with_examples(cmd: str) -> None:
    proc = run_qserve(cmd, "--help")
    assert proc.returncode == 0
    assert "Usage: " in proc.stdout and "Example" in proc.stdout and f"qserve {cmd} " in proc.stdout


def test_bad_gate_flag(tmp_path: Path) -> None:
    proc = run_qserve("eval", tmp_path, "--gate", "gsm8k")
    assert proc.returncode == 1
    assert "expected TASK[@METRIC][:CRITERION]=VALUE" in proc.stderr


def test_eval_without_checkpoint_and_no_history(tmp_path: Path) -> None:
    proc = run_qserve("eval", env={"QSERVE_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: no checkpoint given and no previous `qserve quantize` output found; pass CHECKPOINT"


def test_eval_on_a_directory_that_is_no_checkpoint(tmp_path: Path) -> None:
    proc = run_qserve("eval", tmp_path)
    assert proc.returncode == 1
    assert "not a qserve checkpoint" in proc.stderr


def test_serve_rejects_bad_port() -> None:
    proc = run_qserve("serve", ".", "--port", "70000")
    assert proc.returncode == 2


def test_serve_option_typo_without_double_dash_is_an_error_not_a_pass_through() -> None:
    """vLLM options go after `--`; before it, an option qserve does not know is refused before anything runs."""
    proc = run_qserve("serve", ".", "--max-model-len", "4096")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "Error: No such option: --max-model-len"


def test_the_cli_reference_page_is_the_commands_own_help() -> None:
    """docs/cli.md is regenerated from the app (python -m qserve.cli.reference), and each section is
    what `qserve COMMAND --help` prints at 80 columns."""
    from qserve.cli.reference import render

    page = (REPO / "docs" / "cli.md").read_text()
    assert page == render(), "docs/cli.md is stale: python -m qserve.cli.reference > docs/cli.md"
    for name in (None, "serve", "run", "quantize", "eval"):
        proc = run_qserve_in_process(*([name] if name else []), "--help", env={"COLUMNS": "80"})
        assert proc.returncode == 0 and f"```text\n{proc.stdout}```" in page


def test_the_benchmarks_page_is_made_from_the_recorded_results() -> None:
    """docs/benchmarks.md is what `python -m qserve.bench.page docs` makes from docs/benchmarks/*.json,
    and each recorded result shows its command, date, commit and machine."""
    from qserve.bench.page import RESULTS, page

    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert text == page(REPO / "docs"), "docs/benchmarks.md is stale: make docs"
    for path in sorted((REPO / "docs" / RESULTS).glob("*.json")):
        m = json.loads(path.read_text())["machine"]
        assert f"Produced by `qserve bench --suite` on {m['time'][:10]}, commit {m['commit']}, {m['cpu']}" in text


def test_the_architectures_page_is_made_from_its_recorded_run() -> None:
    """docs/architectures.md is what `qserve matrix --from docs/architectures.json` makes, and it gives the
    run's time as the recorded cells' times add up."""
    from qserve.matrix.page import markdown

    record = json.loads((REPO / "docs" / "architectures.json").read_text())
    text = (REPO / "docs" / "architectures.md").read_text()
    page = markdown(record["cells"], record["provenance"], record["served"], record.get("real_weights", []))
    assert text == page + "\n", "stale: make matrix"
    minutes = sum(t for cell in record["cells"] for t in cell["seconds"].values()) / 60
    assert f"The {len(record['cells'])} cells took {minutes:.0f} minutes in all" in text


def test_a_machine_type_on_hosts_of_two_speeds_keeps_two_records() -> None:
    """The record's file is named by the machine and its measured bfloat16 matmul rate as a power of two:
    the two hosts of one AMD EPYC CPUID (1,086 and 460 GFLOP/s measured) keep separate records, a host's
    own run-to-run spread keeps one, and every recorded file is named by its own content."""
    from qserve.bench.page import RESULTS, machine_key

    machine = {"cpu": "AMD EPYC", "cpus": 2, "isa": ["avx512_bf16"]}

    def key(gflops: float | None) -> str:
        speed = {"eval_throughput": {"dtypes": {"bfloat16": {"matmul_gflops": gflops}}}} if gflops else {}
        return machine_key({"machine": machine} | speed)

    assert (key(1085.5), key(460.0)) == ("amd-epyc-2-cores-bf16-1024gflops", "amd-epyc-2-cores-bf16-512gflops")
    assert key(1085.5 * 0.85) == key(1085.5 * 1.15) and key(460 * 0.85) == key(460 * 1.15)
    assert key(None) == "amd-epyc-2-cores"  # a record without the throughput benchmark
    for path in sorted((REPO / "docs" / RESULTS).glob("*.json")):
        assert path.stem == machine_key(json.loads(path.read_text()))


def test_troubleshooting_is_keyed_by_error_lines_qserve_prints() -> None:
    """Each heading of docs/troubleshooting.md is the start of an error line in qserve's source
    (`...` stands for what the message fills in)."""
    import re

    source = "".join(p.read_text() for p in (REPO / "qserve").rglob("*.py"))
    headings = re.findall(r"^### `error: (.*)`$", (REPO / "docs" / "troubleshooting.md").read_text(), re.M)
    assert len(headings) >= 15
    for heading in headings:
        for fragment in (f.strip() for f in heading.split("...")):
            assert not fragment or fragment in source, (heading, fragment)
