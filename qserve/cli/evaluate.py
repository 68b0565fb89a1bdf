"""`qserve eval`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from qserve.cli._common import (
    DataDirOpt,
    DataParallelOpt,
    ExecutorOpt,
    GateOpt,
    JsonOpt,
    LimitOpt,
    ParityOpt,
    PipelineParallelOpt,
    TasksOpt,
    TensorParallelOpt,
    VerboseOpt,
    VerifyKeyOpt,
    parallel_args,
    split,
    user_errors,
    verdict_exit,
)

IncludePathOpt = Annotated[
    Path | None,
    typer.Option(
        "--include-path",
        file_okay=False,
        help="A folder of lm-eval task YAMLs (lm-eval's --include_path format); its tasks join the names --tasks accepts.",
    ),
]
DatasetsOpt = Annotated[
    Path | None,
    typer.Option(
        "--datasets",
        envvar="QSERVE_DATASETS_DIR",
        file_okay=False,
        help="Local copies of hub datasets as DIR/ORG/NAME, as `hf download --repo-type dataset ORG/NAME --local-dir "
        "DIR/ORG/NAME` writes them: an lm-eval task whose dataset has a copy there reads it from there.",
    ),
]


@user_errors
def eval_(
    checkpoint: Annotated[Path | None, typer.Argument(help="Checkpoint dir. Default: the last `qserve quantize` output.")] = None,
    tasks: TasksOpt = None,
    limit: LimitOpt = None,
    gate: GateOpt = None,
    data_dir: DataDirOpt = None,
    include_path: IncludePathOpt = None,
    datasets: DatasetsOpt = None,
    refresh_baseline: Annotated[
        bool, typer.Option("--refresh-baseline", help="Re-run the baseline even if its scores are cached.")
    ] = False,
    parity: ParityOpt = True,
    kv_cache_dtype: Annotated[
        str | None,
        typer.Option(
            "--kv-cache-dtype",
            help="Assert the KV-cache dtype (auto, fp8). It must match the checkpoint: a contradiction is an error, never an override.",
        ),
    ] = None,
    verify_key: VerifyKeyOpt = None,
    tensor_parallel_size: TensorParallelOpt = 1,
    pipeline_parallel_size: PipelineParallelOpt = 1,
    data_parallel_size: DataParallelOpt = 1,
    distributed_executor_backend: ExecutorOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Run lm-eval on the checkpoint and its baseline in vLLM, check engine parity, apply the gates.

    Where vLLM cannot run the scheme on this device (see `qserve doctor`), both run through transformers
    and every report says EMULATED. With an FP8 KV cache, the eval also checks that the calibrated k/v
    scales reached vLLM. Writes qserve_eval.json, qserve_eval.md, lm_eval_results.json and a model card
    (README.md) into the checkpoint; the libraries' output goes to CHECKPOINT/logs/eval.log. Exit 3 if
    a gate, parity or the KV check fails, 4 if no gate could decide (too few items).

    Every eval of the same weights is a look: the k-th decides at a smaller level, so that all of
    them together pass a model at its allowance at most 5 % of the time. A perplexity gate passes
    only on enough items (`qserve gate-levels` shows false-pass and power by --limit).

    \b
    Examples:
      qserve eval out-w8a8-int8 --tasks gsm8k_ppl --limit 100
      qserve eval out-w8a8-int8 --tasks gsm8k,arc_challenge --datasets ~/hf-datasets
      qserve eval out-w8a8-int8 --tasks my_task --include-path my_tasks/
      qserve eval out-w8a8-int8 --tasks gsm8k_ppl,gsm8k_mc --gate gsm8k_ppl:max_increase=0.03 --json
      qserve eval out-llama-70b-w4a16 --tasks gsm8k -tp 8
      qserve eval out-llama-70b-w4a16 --tasks gsm8k -tp 8 -pp 2 --distributed-executor-backend ray
    """
    from qserve.evaluate.evaluation import EvalOptions
    from qserve.evaluate.reports import format_table
    from qserve.gate.decisions import parse_cli_gates
    from qserve.workflows.run import evaluate_logged

    options = EvalOptions(
        tasks=split(tasks),
        limit=limit,
        gates=parse_cli_gates(gate or []),
        data_dir=data_dir,
        include_path=include_path,
        datasets=datasets,
        refresh_baseline=refresh_baseline,
        check_parity=parity,
        kv_cache_dtype=kv_cache_dtype,
        verify_key=verify_key,
        parallel=parallel_args(tensor_parallel_size, pipeline_parallel_size, data_parallel_size, distributed_executor_backend),
    )
    record = evaluate_logged(checkpoint, options, verbose)
    typer.echo(json.dumps(record.model_dump(exclude_unset=True), indent=2) if as_json else format_table(record))
    raise typer.Exit(verdict_exit(record.verdict))
