"""`qserve eval`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from typer.core import TyperCommand

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
from qserve.gate.order import FIRST_ROUND

if TYPE_CHECKING:
    from qserve.spec.lm_eval_args import LmEvalArgs

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

UntilDecidedOpt = Annotated[
    bool,
    typer.Option(
        "--until-decided",
        help=f"Evaluate the first {FIRST_ROUND} items of each task's seeded order, then {2 * FIRST_ROUND}, "
        f"{4 * FIRST_ROUND}, ... (--limit is the ceiling) until every gate passes or one fails: one engine start per "
        "model per round, each round scoring only the items after the last round's. Betting gates keep their level "
        "at any stopping point.",
    ),
]

# lm-eval's evaluation options (its CLI's names with dashes), for `eval` and `run`; both models get them.
NumFewshotOpt = Annotated[
    int | None,
    typer.Option("--num-fewshot", help="lm-eval's --num_fewshot: few-shot examples per item (default: each task's own)."),
]
ApplyChatTemplateOpt = Annotated[
    str | None,
    typer.Option(
        "--apply-chat-template",
        metavar="[=TEMPLATE]",
        help="lm-eval's --apply_chat_template: prompt through the model's chat template; =NAME picks one of several.",
    ),
]
FewshotAsMultiturnOpt = Annotated[
    bool | None,
    typer.Option(
        "--fewshot-as-multiturn/--no-fewshot-as-multiturn",
        help="lm-eval's --fewshot_as_multiturn: few-shot examples as chat turns (default: on with --apply-chat-template, which it needs).",
    ),
]
SystemInstructionOpt = Annotated[
    str | None, typer.Option("--system-instruction", metavar="TEXT", help="lm-eval's --system_instruction: a system prompt.")
]
GenKwargsOpt = Annotated[
    str | None,
    typer.Option(
        "--gen-kwargs",
        metavar="K=V,...",
        help="lm-eval's --gen_kwargs for generation tasks, over each task's own: e.g. temperature=0,max_gen_toks=256.",
    ),
]
SeedOpt = Annotated[
    str | None,
    typer.Option(
        "--seed",
        metavar="N|PY,NP,TORCH,FEWSHOT",
        help="lm-eval's --seed: one for all four, or python,numpy,torch,fewshot ('None' leaves one unset; default 0,1234,1234,1234).",
    ),
]


class LmEvalCommand(TyperCommand):
    """A command with lm-eval's options: a bare --apply-chat-template (before `--`) means the model's own
    template, as lm-eval's optional-value flag does; Typer's parser has no optional values, so it is
    passed on as an empty value (a template name is given as --apply-chat-template=NAME)."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        end = args.index("--") if "--" in args else len(args)
        bare = [a + "=" if a == "--apply-chat-template" else a for a in args[:end]]
        return super().parse_args(ctx, bare + args[end:])


def lm_eval_args(
    num_fewshot: int | None,
    apply_chat_template: str | None,
    fewshot_as_multiturn: bool | None,
    system_instruction: str | None,
    gen_kwargs: str | None,
    seed: str | None,
) -> LmEvalArgs:
    """The command line's lm-eval options, checked (one `error:` line each) before any work."""
    from qserve.spec.lm_eval_args import LmEvalArgs

    given = {
        "num_fewshot": num_fewshot,
        "apply_chat_template": apply_chat_template,
        "fewshot_as_multiturn": fewshot_as_multiturn,
        "system_instruction": system_instruction,
        "gen_kwargs": gen_kwargs,
        "seed": seed,
    }
    return LmEvalArgs.parse(**given)


@user_errors
def eval_(
    checkpoint: Annotated[Path | None, typer.Argument(help="Checkpoint dir. Default: the last `qserve quantize` output.")] = None,
    tasks: TasksOpt = None,
    limit: LimitOpt = None,
    until_decided: UntilDecidedOpt = False,
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
    num_fewshot: NumFewshotOpt = None,
    apply_chat_template: ApplyChatTemplateOpt = None,
    fewshot_as_multiturn: FewshotAsMultiturnOpt = None,
    system_instruction: SystemInstructionOpt = None,
    gen_kwargs: GenKwargsOpt = None,
    seed: SeedOpt = None,
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

    lm-eval's options (--num-fewshot, --apply-chat-template, ...) apply to both models alike, over the
    recipe's eval section; the record keeps lm-eval's own account of how it prompted each, and the
    eval refuses to gate if the two differ.

    Every eval of the same weights is a look. Gates decided by betting (scores in [0, 1], corpus
    perplexities and lambada's perplexity, on a prefix of the task's seeded order) hold 5 % over every
    look; the rest decide the
    k-th look at a smaller level, so that all of them together pass a model at its allowance at most
    5 % of the time (`qserve gate-levels` shows false-pass and power by --limit).

    \b
    Examples:
      qserve eval out-w8a8-int8 --tasks gsm8k_ppl --limit 150
      qserve eval out-w8a8-int8 --tasks gsm8k_ppl --until-decided
      qserve eval out-w8a8-int8 --tasks gsm8k,arc_challenge --datasets ~/hf-datasets
      qserve eval out-w8a8-int8 --tasks my_task --include-path my_tasks/
      qserve eval out-w8a8-int8 --tasks gsm8k_cot_llama --apply-chat-template --fewshot-as-multiturn --limit 100
      qserve eval out-w8a8-int8 --tasks gsm8k_ppl,gsm8k_mc --gate gsm8k_ppl:max_increase=0.03 --json
      qserve eval out-llama-70b-w4a16 --tasks gsm8k -tp 8
      qserve eval out-llama-70b-w4a16 --tasks gsm8k -tp 8 -pp 2 --distributed-executor-backend ray
    """
    from qserve.evaluate.evaluation import EvalOptions
    from qserve.gate.reports import format_table
    from qserve.spec.gates import parse_cli_gates
    from qserve.workflows.run import evaluate_logged, evaluate_until_decided

    asked = lm_eval_args(num_fewshot, apply_chat_template, fewshot_as_multiturn, system_instruction, gen_kwargs, seed)
    options = EvalOptions(
        lm_eval=asked,
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
    record = (evaluate_until_decided if until_decided else evaluate_logged)(checkpoint, options, verbose)
    typer.echo(json.dumps(record.model_dump(exclude_unset=True), indent=2) if as_json else format_table(record))
    raise typer.Exit(verdict_exit(record.verdict))
