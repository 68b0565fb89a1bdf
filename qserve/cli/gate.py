"""`qserve gate` and `qserve gate-levels`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from qserve.cli._common import GateOpt, JsonOpt, TasksOpt, split, user_errors, verdict_exit


@user_errors
def gate(
    baseline: Annotated[Path, typer.Argument(help="lm-eval --output_path of the baseline run (or its results_*.json).")],
    quantized: Annotated[Path, typer.Argument(help="lm-eval --output_path of the quantized run (or its results_*.json).")],
    tasks: TasksOpt = None,
    gate: GateOpt = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Also write the gate record (JSON) here.")] = None,
    looks_from: Annotated[
        Path | None,
        typer.Option(
            "--looks-from",
            help="An earlier record of these weights (this command's --out, or a qserve_eval.json): its look history "
            "continues here, so each new set of items spends less of the 5 %; the same items again are the same look.",
        ),
    ] = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint",
            help="The qserve checkpoint the quantized run evaluated: its files are checked against its manifest, the "
            "quantized run's model_args must name its directory (absolute path) and the baseline's its source model, "
            "then the decision is written into it as its gate record, so `qserve serve` starts on a PASS. Its recipe's "
            "gates apply to tasks --gate does not name.",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Apply qserve's paired gate to two lm-eval runs made elsewhere (a GPU cluster, a CI job).

    Both runs need `--log_samples` on the same items, few-shot count and prompts: the gate compares them
    item by item (a test by betting on scores in [0, 1], 0/1 included, or in a range the gate declares
    (truthfulqa_gen@bleu_max:score_range=0,100), taken in the task's seeded order, on
    corpus perplexities by the words or bytes lm-eval counted, and on lambada's perplexity per item; runs on
    part of a task, lm-eval's --limit in file order, are a claim about the scored items alone; a t bound on
    per-document terms for other means; see docs/gates.md). Which way a metric is
    better comes from lm-eval's own results. Default gate: min_recovery 0.95 on each task's first metric.
    qserve counts only the looks it is shown: after an inconclusive run, gate the larger run with
    `--looks-from` the first one's --out record. Exit 0 PASS, 3 FAIL, 4 INCONCLUSIVE.

    Alone, the verdict serves nothing. With `--checkpoint DIR` it becomes DIR's gate record, as `qserve eval`
    writes its own, naming the two runs: `qserve serve DIR` then starts on a PASS (and refuses a FAIL or an
    INCONCLUSIVE, or gates short of the recipe's). Refused before deciding, with nothing written: a file of DIR
    that differs from its manifest, a quantized run of another path (lm-eval's config.model_args
    `pretrained=`), with an adapter, another tokenizer or another kv_cache_dtype, or started before DIR was
    made, and a baseline run of another model than DIR's source.

    \b
    Example:
      lm_eval --model vllm --model_args pretrained=BASE --tasks gsm8k --log_samples --output_path runs/base
      lm_eval --model vllm --model_args pretrained=QUANT --tasks gsm8k --log_samples --output_path runs/quant
      qserve gate runs/base runs/quant --gate gsm8k:max_drop=0.02 --out gate-1.json
      qserve gate runs/base-1000 runs/quant-1000 --gate gsm8k:max_drop=0.02 --looks-from gate-1.json
      lm_eval --model vllm --model_args pretrained=$PWD/out-w8a8-int8 --tasks gsm8k_ppl --include_path my_tasks \\
        --log_samples --output_path runs/q           (runs/b: pretrained= the source model, the same options)
      qserve gate runs/b runs/q --checkpoint out-w8a8-int8 && qserve serve out-w8a8-int8
    """
    from qserve.gate.external import format_report, gate_runs
    from qserve.paths import write_json
    from qserve.spec.gates import parse_cli_gates

    opened = None
    if checkpoint is not None:
        from qserve.checkpoint.opened import open_checkpoint

        opened = open_checkpoint(checkpoint)  # its files against its manifest, before any run is read
    summary = gate_runs(baseline, quantized, parse_cli_gates(gate or []), split(tasks), looks_from, opened)
    if out is not None:
        write_json(out, summary)
    typer.echo(json.dumps(summary, indent=2) if as_json else format_report(summary))
    if opened is not None:
        from qserve.progress import info

        info(f"gate record written into {checkpoint} (qserve_eval.json): `qserve serve {checkpoint}` reads it")
    raise typer.Exit(verdict_exit(summary["verdict"]))


@user_errors
def gate_levels(
    draws: Annotated[int, typer.Option(min=100, help="Simulated samples per cell.")] = 2000,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write the Markdown page here (e.g. docs/gate-levels.md).")
    ] = None,
) -> None:
    """Print how often each gate passes a model at exactly its allowance (false pass) and a good model
    (power), by n, by allowance and flip rate for 0/1 tasks, and by the shape of per-item losses for
    perplexities: the tables to choose --limit from before spending the compute.

    Seeded simulation through qserve's own bounds (a few minutes); tests/test_gate_levels.py asserts it.

    \b
    Example:
      qserve gate-levels --out docs/gate-levels.md
    """
    from qserve.gate.levels import page as levels_page
    from qserve.progress import step

    with step("simulating the gate's bounds"):
        page = levels_page(draws)
    if out is not None:
        from qserve.paths import write_text

        write_text(out, page + "\n")
    typer.echo(page)
