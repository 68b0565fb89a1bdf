"""`qserve compare` and `qserve doctor`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from qserve.cli._common import DataDirOpt, JsonOpt, LimitOpt, ModelOpt, TasksOpt, VerboseOpt, library_output, split, user_errors
from qserve.errors import EXIT_ERROR


@user_errors
def compare(
    recipes: Annotated[list[Path], typer.Argument(help="Two or more recipe YAMLs, e.g. recipes/*.yaml.")],
    model: ModelOpt = None,
    tasks: TasksOpt = None,
    limit: LimitOpt = None,
    out_dir: Annotated[Path, typer.Option("--out-dir", "-o", help="Where checkpoints, compare.json and compare.png go.")] = Path(
        "compare"
    ),
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Quantize with each recipe (reusing finished checkpoints), gate each against the shared cached
    baseline, measure size and vLLM decode speed, and print one table plus a PNG plot.

    \b
    Example:
      qserve compare recipes/w8a8-int8.yaml recipes/w4a16-gptq.yaml --tasks gsm8k_ppl --limit 50
    """
    from qserve.runtime.process import bounded_in_process_stop
    from qserve.workflows.compare import check_before_work, format_compare
    from qserve.workflows.compare import compare as run

    check_before_work(recipes, split(tasks), data_dir)
    with library_output(out_dir / "logs" / "compare.log", verbose), bounded_in_process_stop():
        result = run(recipes, model=model, tasks=split(tasks), limit=limit, data_dir=data_dir, out_dir=out_dir)
    typer.echo(json.dumps(result, indent=2) if as_json else format_compare(result))


@user_errors
def doctor(
    probe: Annotated[
        list[Path] | None,
        typer.Option("--probe", help="Also load this checkpoint in vLLM here and check the matrix's claim (repeatable)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Check this machine: library versions against the tested set, the device, and which schemes vLLM runs here.

    The scheme matrix is measured (the test suite re-runs every entry on vLLM); a scheme vLLM cannot run
    here is evaluated through transformers (emulated) and refused by `qserve serve`. Exit 1 if a
    required library is missing or a probed checkpoint contradicts the matrix.

    \b
    Examples:
      qserve doctor
      qserve doctor --probe out-w4a16-gptq
    """
    from qserve.paths import cache_dir
    from qserve.support.doctor import diagnose, format_report

    with library_output(cache_dir() / "logs" / "doctor.log", False):
        report = diagnose(probe)
    typer.echo(json.dumps(report, indent=2) if as_json else format_report(report))
    raise typer.Exit(0 if report["ok"] else EXIT_ERROR)
