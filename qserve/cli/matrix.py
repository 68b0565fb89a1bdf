"""`qserve matrix`: tiny models of the architectures users bring, through every shipped scheme."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from qserve.cli._common import DataDirOpt, split, user_errors


@user_errors
def matrix(
    archs: Annotated[
        str | None, typer.Option("--archs", help="Comma-separated architectures (default: all; see --list).")
    ] = None,
    columns: Annotated[
        str | None, typer.Option("--columns", help="Comma-separated recipes of the matrix (default: all).")
    ] = None,
    workdir: Annotated[
        Path | None, typer.Option("--workdir", help="Models, checkpoints and logs (default: the qserve cache's matrix/).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write the Markdown page here (and the results as JSON beside it).")
    ] = None,
    serve: Annotated[
        bool, typer.Option("--serve/--no-serve", help="Also serve each passing cell and ask one chat question.")
    ] = True,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Keep the cells an earlier run wrote to WORKDIR/matrix.json (and serve those it did not, unless --no-serve).",
        ),
    ] = False,
    from_: Annotated[
        Path | None, typer.Option("--from", help="Rewrite the page from a results JSON an earlier run wrote (no run).")
    ] = None,
    data_dir: DataDirOpt = None,
    real_weights: Annotated[
        bool,
        typer.Option(
            "--real-weights",
            help="Instead of the tiny models, quantize the trained models the suite has (SmolLM2-135M, Gemma 3 270M) "
            "with the --columns recipes and gate each in vLLM; the results join the page at --out (its other cells kept).",
        ),
    ] = False,
    list_: Annotated[bool, typer.Option("--list", help="List the architectures and columns, and exit.")] = False,
) -> None:
    """Build tiny random-initialised models of real architectures (Llama, Qwen 2 and 3, Mistral, Gemma 2
    and 3, Phi-3, OLMo 2, Granite, Qwen3-MoE, Mixtral), quantize each with the shipped recipes, compare
    vLLM with transformers on the same weights, and serve it: the cells that pass, and the message of each
    that does not. The 99 cells take tens of minutes on 2 CPU cores, serving included (docs/architectures.md
    gives the last run's time).

    \b
    Examples:
      qserve matrix --list
      qserve matrix --archs qwen3,qwen3_moe --columns w8a8-int8,w4a16-awq
      qserve matrix --out docs/architectures.md          # the whole matrix (make matrix)
      qserve matrix --from docs/architectures.json --out docs/architectures.md   # the page again, no run
      qserve matrix --real-weights --columns w8a8-int8,fp8-dynamic --out docs/architectures.md
    """
    from qserve.matrix.cells import COLUMNS, MOE_ONLY
    from qserve.matrix.tiny import ARCHITECTURES

    if list_:
        for name, arch in ARCHITECTURES.items():
            typer.echo(f"{name:<12} {arch.what}")
        typer.echo("columns: " + ", ".join(f"{c} ({r})" for c, r in COLUMNS.items()))
        return
    from qserve.matrix.page import markdown
    from qserve.matrix.run import default_workdir, provenance, run_matrix

    if from_ is not None:
        record = json.loads(from_.read_text())
    elif real_weights:
        record = _with_real_weights(
            out, split(columns) if columns else [c for c in COLUMNS if c not in MOE_ONLY], workdir, data_dir
        )
    else:
        chosen = split(archs) if archs else list(ARCHITECTURES)
        results = run_matrix(
            chosen, split(columns) if columns else list(COLUMNS), workdir or default_workdir(), data_dir, serve, resume
        )
        record = {
            "provenance": provenance(archs, columns, serve, resume),
            "served": serve,
            "cells": [c.record() for c in results],
        }
    if out is not None:
        _write(out, record)
    typer.echo(markdown(record["cells"], record["provenance"], record["served"], record.get("real_weights", [])))


def _with_real_weights(out: Path | None, columns: list[str], workdir: Path | None, data_dir: Path | None) -> dict:
    """The page's recorded run with the real-weights cells of `columns` run again (the others kept);
    the page and its JSON are rewritten as each cell finishes."""
    from qserve.errors import QserveError
    from qserve.matrix.cells import COLUMNS
    from qserve.matrix.run import default_workdir
    from qserve.workflows.real_weights import run_real_weights

    if out is None or not out.with_suffix(".json").is_file():
        raise QserveError("--real-weights adds to a recorded matrix: pass --out PAGE.md with PAGE.json beside it (make matrix)")
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown:
        raise QserveError(f"unknown column(s) {', '.join(unknown)}; see qserve matrix --list")
    record = json.loads(out.with_suffix(".json").read_text())

    def merged(fresh: list[dict]) -> dict:
        ran = {(r["model"], r["column"]) for r in fresh}
        return record | {
            "real_weights": [r for r in record.get("real_weights", []) if (r["model"], r["column"]) not in ran] + fresh
        }

    def write(fresh: list[dict]) -> None:
        _write(out, merged(fresh))

    return merged(run_real_weights({c: COLUMNS[c] for c in columns}, workdir or default_workdir(), data_dir, write))


def _write(out: Path, record: dict) -> None:
    from qserve.matrix.page import markdown
    from qserve.paths import write_text

    page = markdown(record["cells"], record["provenance"], record["served"], record.get("real_weights", []))
    write_text(out, page + "\n")
    write_text(out.with_suffix(".json"), json.dumps(record, indent=1) + "\n")
