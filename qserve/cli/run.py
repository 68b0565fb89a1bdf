"""`qserve run`: quantize -> eval -> serve in one command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qserve.cli._common import (
    ApiKeyFileOpt,
    ApiKeyOpt,
    DataDirOpt,
    GateOpt,
    HostOpt,
    LimitOpt,
    ModelOpt,
    ParityOpt,
    PortOpt,
    ReadyTimeoutOpt,
    TasksOpt,
    TrustRemoteCodeOpt,
    VerboseOpt,
    api_key,
    split,
    user_errors,
    verdict_exit,
    vllm_logs_to_stderr,
)
from qserve.cli.evaluate import (
    ApplyChatTemplateOpt,
    DatasetsOpt,
    FewshotAsMultiturnOpt,
    GenKwargsOpt,
    IncludePathOpt,
    NumFewshotOpt,
    SeedOpt,
    SystemInstructionOpt,
    lm_eval_args,
)


@user_errors
def run(
    ctx: typer.Context,
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML, e.g. recipes/w8a8-int8.yaml.")],
    model: ModelOpt = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Checkpoint directory. Default: out-<recipe name>.")
    ] = None,
    data_dir: DataDirOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
    tasks: TasksOpt = None,
    limit: LimitOpt = None,
    gate: GateOpt = None,
    parity: ParityOpt = True,
    include_path: IncludePathOpt = None,
    datasets: DatasetsOpt = None,
    num_fewshot: NumFewshotOpt = None,
    apply_chat_template: ApplyChatTemplateOpt = None,
    fewshot_as_multiturn: FewshotAsMultiturnOpt = None,
    system_instruction: SystemInstructionOpt = None,
    gen_kwargs: GenKwargsOpt = None,
    seed: SeedOpt = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    key: ApiKeyOpt = None,
    key_file: ApiKeyFileOpt = None,
    ready_timeout: ReadyTimeoutOpt = 900.0,
    verbose: VerboseOpt = False,
) -> None:
    """Quantize with the recipe, gate the checkpoint, and serve it if the gate passed: one command.

    Each step's valid output is reused: a checkpoint made from the same recipe file, model,
    calibration data and library versions whose files are intact is not quantized again, and an eval
    record bound to the current manifest that decided the same tasks, data, --limit, gates, parity and
    lm-eval options on this device is not re-run. So a second `qserve run` goes straight to serving. A gate that
    does not pass prints its table and exits 3 (fail) or 4 (inconclusive) without serving. While
    the gate runs, the server's interpreter imports vLLM beside it at idle priority; it is told
    what to serve only once the gate passed. Logs: CKPT/logs/{quantize,eval,serve}.log. Extra vLLM
    server options go after `--`.

    \b
    Examples:
      qserve run recipes/w8a8-int8.yaml --tasks gsm8k_ppl --limit 150
      qserve run recipes/w4a16-gptq.yaml --tasks gsm8k_ppl --limit 100 --port 8001 -- --max-num-seqs 8
    """
    from qserve.evaluate.evaluation import EvalOptions
    from qserve.gate.reports import format_table
    from qserve.serve.plan import Endpoint, check_before_work
    from qserve.serve.server import ensure_port_free, serve, warm_server
    from qserve.spec.gates import parse_cli_gates
    from qserve.workflows.run import check_run_before_work, checkpoint_for, gate_for

    gates = parse_cli_gates(gate or [])
    asked = lm_eval_args(num_fewshot, apply_chat_template, fewshot_as_multiturn, system_instruction, gen_kwargs, seed)
    check_before_work(list(ctx.args))  # the serve step's options and environment, before any work
    ensure_port_free(host, port)  # and its port: checked again when the server starts
    options = EvalOptions(
        tasks=split(tasks),
        limit=limit,
        gates=gates,
        data_dir=data_dir,
        check_parity=parity,
        include_path=include_path,
        datasets=datasets,
        lm_eval=asked,
    )
    loaded = check_run_before_work(recipe, options)  # and the recipe, its scheme, the eval's tasks, gates, data
    key_args = api_key(key, key_file)
    opened = checkpoint_for(  # opened once: its files are hashed once for eval and serve
        recipe, model, output, data_dir, trust_remote_code, verbose, loaded
    )
    endpoint = Endpoint(host, port, **key_args)
    # The server's interpreter imports vLLM on what the gate leaves idle; it is told what to serve
    # only after the gate passed and serve's checks, and ends with this block otherwise.
    with warm_server(opened.path, endpoint, list(ctx.args), verbose) as warm:
        record = gate_for(opened, options, verbose)
        typer.echo(format_table(record))
        if record.verdict != "pass":
            typer.echo(f"error: {opened.path} did not pass its gate (verdict: {record.verdict}); not serving it", err=True)
            raise typer.Exit(verdict_exit(record.verdict))
        vllm_logs_to_stderr()
        serve(opened, endpoint, extra_args=list(ctx.args), ready_timeout=ready_timeout, verbose=verbose, warm=warm)
