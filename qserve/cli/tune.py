"""`qserve tune`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from qserve.cli._common import DataDirOpt, JsonOpt, LimitOpt, ModelOpt, TasksOpt, VerboseOpt, library_output, split, user_errors
from qserve.errors import EXIT_GATE_FAILED


@user_errors
def tune(
    recipe: Annotated[Path, typer.Argument(help="The recipe to start from (its scheme, algorithm, calibration and gates).")],
    model: ModelOpt = None,
    tasks: TasksOpt = None,
    limit: LimitOpt = None,
    out_dir: Annotated[
        Path | None,
        typer.Option("--out-dir", "-o", help="Tables, plots, candidates and the winner's recipe. Default: tune-<recipe name>."),
    ] = None,
    low: Annotated[
        str | None,
        typer.Option(
            "--with",
            help="The smaller scheme the least sensitive layer groups move to. Default: the smallest that "
            "forms a mix vLLM was seen to run here (W4A16 for a W8A8 recipe).",
        ),
    ] = None,
    group_size: Annotated[
        int | None,
        typer.Option(
            "--group-size",
            min=1,
            help="Weight group size of the smaller scheme. Default: the largest <=128 that fits every layer.",
        ),
    ] = None,
    objective: Annotated[
        str,
        typer.Option(
            "--objective",
            help="Winner among the passing candidates: bytes (fewest) or throughput (highest measured vLLM decode tok/s).",
        ),
    ] = "bytes",
    max_candidates: Annotated[
        int, typer.Option("--max-candidates", min=1, help="At most this many candidates quantized and gated in vLLM.")
    ] = 8,
    budget_minutes: Annotated[
        float, typer.Option("--budget-minutes", min=1, help="Start no candidate that would end past this many minutes.")
    ] = 15.0,
    sensitivity_only: Annotated[
        bool, typer.Option("--sensitivity-only", help="Only measure and write the per-group sensitivity table and plot.")
    ] = False,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Find the smallest per-layer mix of schemes that passes the recipe's noise-aware gate in vLLM.

    Measures how much each layer group (a decoder block's attention or MLP projections) hurts when
    quantized alone to the smaller scheme, then quantizes and gates candidates that move the k least
    sensitive groups to it, searching k. Writes sensitivity.{json,md,png}, pareto.{json,md,png}, every
    candidate's checkpoint and recipe, and <recipe>-tuned.yaml: `qserve quantize` on it re-makes the
    winner. Exit 0 with a winner; exit 3 when no candidate passed (the closest is named).

    \b
    Examples:
      qserve tune recipes/w8a8-int8.yaml --tasks gsm8k_ppl --limit 300
      qserve tune recipes/w8a8-int8.yaml --sensitivity-only
    """
    from qserve.runtime.process import bounded_in_process_stop
    from qserve.spec.recipe import load_recipe
    from qserve.tune.report import format_tune
    from qserve.tune.search import Budget, TuneOptions
    from qserve.tune.search import tune as run

    out = out_dir or Path(f"tune-{load_recipe(recipe)[0].name}")
    with library_output(out / "logs" / "tune.log", verbose), bounded_in_process_stop():
        options = TuneOptions(
            model=model,
            tasks=split(tasks),
            limit=limit,
            data_dir=data_dir,
            out_dir=out,
            low=low,
            group_size=group_size,
            objective=objective,
            budget=Budget(max_candidates, budget_minutes),
            sensitivity_only=sensitivity_only,
        )
        result = run(recipe, options)
    typer.echo(json.dumps(result, indent=2) if as_json else format_tune(result))
    if not sensitivity_only and result["winner"] is None:
        raise typer.Exit(EXIT_GATE_FAILED)
