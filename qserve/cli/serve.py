"""`qserve serve` and `qserve bench`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from qserve.cli._common import (
    AcceptGateDifferenceOpt,
    ApiKeyFileOpt,
    ApiKeyOpt,
    DataDirOpt,
    HostOpt,
    JsonOpt,
    PolicyOpt,
    PortOpt,
    ReadyTimeoutOpt,
    VerboseOpt,
    VerifyKeyOpt,
    api_key,
    library_output,
    user_errors,
    vllm_logs_to_stderr,
)
from qserve.engines.passthrough import pass_through_help
from qserve.errors import QserveError
from qserve.progress import info


@user_errors
def serve(
    ctx: typer.Context,
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint dir whose accuracy gate passed.")],
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    skip_gate: Annotated[
        bool, typer.Option("--skip-gate", help="Serve even without a passing gate (not for production).")
    ] = False,
    key: ApiKeyOpt = None,
    key_file: ApiKeyFileOpt = None,
    ready_timeout: ReadyTimeoutOpt = 900.0,
    verify_key: VerifyKeyOpt = None,
    policy: PolicyOpt = None,
    accept_gate_difference: AcceptGateDifferenceOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Start vLLM's OpenAI-compatible server with the checkpoint's quantization, kv_cache_dtype and dtype.

    Extra vLLM options go after `--`: only options that leave what the model computes, and who may
    reach it, unchanged (listed below); --quantization, --kv-cache-dtype and --dtype may only repeat
    the checkpoint's. The endpoint is printed only once the server has answered one short
    generation request. The gate record must meet the checkpoint's policy: the recipe's gates, passed
    on enough items (see --policy), or a policy file. vLLM's output goes to CKPT/logs/serve.log. Ctrl-C or SIGTERM stops the
    server's whole process group: SIGTERM first, SIGKILL for anything still alive 15 s later; exit
    130 (SIGINT) or 143 (SIGTERM).

    \b
    Examples:
      qserve serve out-w8a8-int8
      QSERVE_API_KEY=$(openssl rand -hex 24) qserve serve out-w8a8-int8 --host 0.0.0.0
      qserve serve out-w8a8-int8 -- --max-model-len 4096 --max-num-seqs 8
      qserve serve out-w8a8-int8 -- --enable-auto-tool-choice --tool-call-parser hermes

    {PASS_THROUGH}
    """
    from qserve.serve.plan import Endpoint, check_before_work
    from qserve.serve.server import Checks
    from qserve.serve.server import serve as run

    check_before_work(list(ctx.args))  # vLLM's options and environment, before the checkpoint is copied
    vllm_logs_to_stderr()  # stdout: the endpoint and curl lines only
    endpoint = Endpoint(host, port, **api_key(key, key_file))
    checks = Checks(skip_gate, verify_key, policy, accept_gate_difference)
    run(checkpoint, endpoint, checks, list(ctx.args), ready_timeout, verbose)


serve.__doc__ = (serve.__doc__ or "").replace("{PASS_THROUGH}", pass_through_help())


@user_errors
def bench(
    checkpoint: Annotated[
        Path | None, typer.Argument(help="Checkpoint to serve and load-test (not needed with --suite).")
    ] = None,
    suite: Annotated[
        bool, typer.Option("--suite", help="Run the benchmark suite: qserve's own costs as ratios against the raw libraries.")
    ] = False,
    num_prompts: Annotated[int, typer.Option(min=1, help="Requests in the synthetic load.")] = 32,
    input_len: Annotated[int, typer.Option(min=1, help="Prompt tokens per request (random).")] = 128,
    output_len: Annotated[int, typer.Option(min=1, help="Output tokens per request (EOS ignored).")] = 64,
    concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight at once.")] = 4,
    eval_throughput: Annotated[
        bool,
        typer.Option(
            "--eval-throughput",
            help="Only the eval-throughput part of the suite: prefill and decode tokens/s per dtype against the "
            "matmul bound, raw lm-eval and vLLM alone on the same tokens (quantizes W8A8 into --work-dir if needed).",
        ),
    ] = False,
    demo: Annotated[
        bool,
        typer.Option(
            "--demo",
            help="Time `make demo` as a newcomer runs it: a fresh clone of this checkout's HEAD, an empty cache, "
            "until it serves; each step's start and length.",
        ),
    ] = False,
    work_dir: Annotated[Path, typer.Option(help="Scratch dir for --suite checkpoints and bench_suite.json.")] = Path(
        "bench-suite"
    ),
    publish: Annotated[
        Path | None,
        typer.Option(
            help="With --suite (--demo): record the result as DIR/benchmarks/(demo/)<machine>.json and rewrite DIR/benchmarks.md."
        ),
    ] = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Throughput and latency (TTFT, TPOT) of a served checkpoint under vLLM's own benchmark load;
    with --suite, what qserve costs against the raw libraries (ratios measured in one run).

    \b
    Examples:
      qserve bench out-w8a8-int8 --num-prompts 16 --concurrency 2
      qserve bench --suite --work-dir /tmp/bench
      qserve bench --suite --publish docs      (what `make benchmarks` runs)
      qserve bench --eval-throughput --work-dir /tmp/bench
      qserve bench --demo --publish docs
    """
    if demo:
        typer.echo(_demo(work_dir, data_dir, publish, as_json))
        return
    if eval_throughput:
        typer.echo(_eval_throughput(work_dir, data_dir, verbose, as_json))
        return
    if suite:
        from qserve.bench.suite import format_suite, run_suite
        from qserve.paths import project_data

        with library_output(work_dir / "logs" / "bench-suite.log", verbose):
            result = run_suite(project_data("recipes"), work_dir, data_dir)
        if publish is not None:
            from qserve.bench.page import record

            info(f"recorded {record(result, publish)}; {publish / 'benchmarks.md'} rewritten")
        typer.echo(json.dumps(result, indent=2) if as_json else format_suite(result))
        return
    if checkpoint is None:
        raise QserveError("pass CHECKPOINT to benchmark, or --suite")
    from qserve.bench.load import Load, format_bench
    from qserve.bench.load import bench as run
    from qserve.paths import log_file

    with library_output(log_file(checkpoint, "bench"), verbose):
        result = run(checkpoint, Load(num_prompts, input_len, output_len, concurrency))
    typer.echo(json.dumps(result, indent=2) if as_json else format_bench(result))


def _demo(work_dir: Path, data_dir: Path | None, publish: Path | None, as_json: bool) -> str:
    from qserve import paths
    from qserve.bench.demo import markdown, time_demo

    result = time_demo(work_dir, paths.data_dir(data_dir))
    if publish is not None:
        from qserve.bench.page import record

        info(f"recorded {record(result, publish, demo=True)}; {publish / 'benchmarks.md'} rewritten")
    return json.dumps(result, indent=2) if as_json else markdown(result)


def _eval_throughput(work_dir: Path, data_dir: Path | None, verbose: bool, as_json: bool) -> str:
    from qserve import paths
    from qserve.bench.throughput import eval_throughput, markdown
    from qserve.workflows.run import checkpoint_for

    recipe = paths.project_data("recipes") / "w8a8-int8.yaml"
    ckpt = checkpoint_for(recipe, output=work_dir / "out-w8a8-int8", data_dir=data_dir, verbose=verbose, remember=False).path
    with library_output(work_dir / "logs" / "eval-throughput.log", verbose):
        result = eval_throughput(ckpt, paths.data_dir(data_dir))
    (work_dir / "eval_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    return json.dumps(result, indent=2) if as_json else "\n".join(markdown(result))
