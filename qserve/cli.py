"""The `qserve` command line: thin wrappers over the library functions."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from qserve.errors import EXIT_ERROR, EXIT_GATE_FAILED, EXIT_GATE_INCONCLUSIVE, QserveError, Stopped
from qserve.process import bounded_in_process_stop

app = typer.Typer(
    name="qserve",
    help="Quantize an LLM, gate its accuracy with lm-eval, and serve it on vLLM with matched arguments.\n\n"
    "Typical flow: `qserve quantize recipes/w8a8-int8.yaml` -> `qserve eval` -> `qserve serve out-w8a8-int8`.\n\n"
    "Also: `qserve doctor` (what runs here), `qserve inspect CKPT`, `qserve compare recipes/*.yaml`, `qserve bench CKPT` (or `--suite`).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

ModelOpt = Annotated[
    str | None,
    typer.Option("--model", "-m", help="Local HF checkpoint dir or hub id. Default: the embedded SmolLM2-135M-Instruct."),
]
ReadyTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--ready-timeout",
        min=1,
        help="Seconds the vLLM server may take to answer its first request; then it is stopped (exit 1).",
    ),
]
VerboseOpt = Annotated[
    bool, typer.Option("--verbose", "-v", help="Also show vLLM's own output live (it always goes to the log file).")
]
VerifyKeyOpt = Annotated[
    Path | None,
    typer.Option(
        "--verify-key",
        help="PEM public key: refuse the checkpoint unless `qserve sign` with the matching private key covered "
        "exactly its files, manifest and eval record.",
    ),
]
DataDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--data-dir", help="Root for relative data paths in recipes and evals/. Default: $QSERVE_DATA_DIR or the current dir."
    ),
]


def _vllm_logs_to_stderr() -> None:
    """vLLM logs to stdout by default; qserve keeps stdout for results (children inherit this)."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def _results_only_on_stdout():
    """Libraries log to stdout (vLLM by default); send all of it to stderr while a command works."""
    _vllm_logs_to_stderr()
    return contextlib.redirect_stdout(sys.stderr)


def _user_errors(fn):
    """Print QserveError as one line on stderr and exit non-zero; no traceback for user mistakes."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except QserveError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(EXIT_ERROR) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None
        except Stopped as exc:  # the vLLM process group is already gone
            typer.echo(str(exc), err=True)
            raise typer.Exit(128 + exc.signum) from None
        except OSError as exc:  # full disk, permissions: the user's to fix, not a crash
            where = f": {exc.filename}" if exc.filename else ""
            typer.echo(f"error: {exc.strerror or exc}{where}", err=True)
            raise typer.Exit(EXIT_ERROR) from None

    return wrapper


@app.command()
@_user_errors
def quantize(
    recipe: Annotated[
        Path, typer.Argument(help="Recipe YAML (qserve's or a plain llm-compressor recipe), e.g. recipes/w4a16-gptq.yaml.")
    ],
    model: ModelOpt = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Checkpoint directory. Default: the recipe's output, else out-<name>.")
    ] = None,
    data_dir: DataDirOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output directory.")] = False,
    trust_remote_code: Annotated[
        bool, typer.Option("--trust-remote-code", help="Run the model repo's own Python code (off by default).")
    ] = False,
) -> None:
    """Quantize a model with a recipe and export a safetensors checkpoint plus qserve_manifest.json.

    The recipe picks the backend (llm-compressor or AMD Quark), the scheme (FP8_DYNAMIC, FP8, W8A8,
    W4A16, MXFP4, MXFP4A16), the algorithm (rtn, gptq, awq), an optional FP8 KV cache, and the
    calibration data (files, a hub dataset, a weighted mix, or text the model writes itself). See
    recipes/ for one of each; the manifest records the vLLM arguments the checkpoint needs.
    """
    from qserve.quantize.pipeline import quantize as run

    with _results_only_on_stdout():
        result = run(recipe, model=model, output=output, data_dir=data_dir, force=force, trust_remote_code=trust_remote_code)
    typer.echo(str(result.output))


@app.command("eval")
@_user_errors
def eval_(
    checkpoint: Annotated[Path | None, typer.Argument(help="Checkpoint dir. Default: the last `qserve quantize` output.")] = None,
    tasks: Annotated[
        str | None,
        typer.Option(
            "--tasks", "-t", help="Comma-separated tasks from evals/ (gsm8k, gsm8k_ppl). Default: the recipe's gated tasks."
        ),
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", "-l", min=1, help="Evaluate only the first N items of each task.")
    ] = None,
    gate: Annotated[
        list[str] | None,
        typer.Option(
            "--gate",
            "-g",
            help="TASK[@METRIC][:CRITERION]=VALUE, repeatable; CRITERION is min_recovery (default), max_drop or "
            "max_increase (perplexity, relative). E.g. gsm8k=0.9, gsm8k_ppl:max_increase=0.05. Replaces the recipe's gates "
            "for that task (default: min_recovery 0.95).",
        ),
    ] = None,
    data_dir: DataDirOpt = None,
    refresh_baseline: Annotated[
        bool, typer.Option("--refresh-baseline", help="Re-run the baseline even if its scores are cached.")
    ] = False,
    parity: Annotated[
        bool,
        typer.Option(
            "--parity/--no-parity", help="Check that vLLM matches transformers on this checkpoint (greedy tokens, logprobs)."
        ),
    ] = True,
    kv_cache_dtype: Annotated[
        str | None,
        typer.Option(
            "--kv-cache-dtype",
            help="Assert the KV-cache dtype (auto, fp8). It must match the checkpoint: a contradiction is an error, never an override.",
        ),
    ] = None,
    verify_key: VerifyKeyOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON instead of a table.")] = False,
) -> None:
    """Run lm-eval on the checkpoint and its baseline in vLLM, check engine parity, apply the gates.

    Where vLLM cannot run the scheme on this device (see `qserve doctor`), both run through transformers
    and every report says EMULATED. With an FP8 KV cache, the eval also checks that the calibrated k/v
    scales reached vLLM. Writes qserve_eval.json, qserve_eval.md, lm_eval_results.json and a model card
    (README.md) into the checkpoint. Exit 3 if a gate, parity or the KV check fails, 4 if no gate could
    decide (too few items).
    """
    from qserve.evaluate.evaluation import evaluate
    from qserve.evaluate.gates import parse_cli_gates
    from qserve.evaluate.reports import format_table

    with _results_only_on_stdout(), bounded_in_process_stop():
        summary = evaluate(
            checkpoint,
            tasks=_split(tasks),
            limit=limit,
            gates=parse_cli_gates(gate or []),
            data_dir=data_dir,
            refresh_baseline=refresh_baseline,
            check_parity=parity,
            kv_cache_dtype=kv_cache_dtype,
            verify_key=verify_key,
        )
    typer.echo(json.dumps(summary, indent=2) if as_json else format_table(summary))
    code = {"pass": 0, "fail": EXIT_GATE_FAILED}.get(summary["verdict"], EXIT_GATE_INCONCLUSIVE)
    raise typer.Exit(code)


# Extra arguments only after `--` (they go to vLLM); an unknown option before it is a typo, not a pass-through.
@app.command(context_settings={"allow_extra_args": True})
@_user_errors
def serve(
    ctx: typer.Context,
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint dir whose accuracy gate passed.")],
    host: Annotated[str, typer.Option(help="Address to bind. Loopback unless you mean otherwise.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8000,
    skip_gate: Annotated[
        bool, typer.Option("--skip-gate", help="Serve even without a passing gate (not for production).")
    ] = False,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="QSERVE_API_KEY",
            help="Require this bearer token on every route but /health, /ping, /version and /metrics. "
            "An inherited VLLM_API_KEY is used (and reported) when neither this nor QSERVE_API_KEY is set.",
        ),
    ] = None,
    ready_timeout: ReadyTimeoutOpt = 900.0,
    verify_key: VerifyKeyOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Start vLLM's OpenAI-compatible server with the checkpoint's quantization, kv_cache_dtype and dtype.

    Extra vLLM options go after `--`, e.g. `qserve serve CKPT -- --tensor-parallel-size 2 --max-model-len 4096`;
    they may not contradict the checkpoint's --quantization, --kv-cache-dtype or --dtype.

    The endpoint is printed only once the server has answered one short generation request.
    vLLM's output goes to CKPT/logs/serve.log. Ctrl-C or SIGTERM stops the server's whole process
    group: SIGTERM first, SIGKILL for anything still alive 15 s later; exit 130 (SIGINT) or 143 (SIGTERM).
    """
    from qserve.serve.server import serve as run

    _vllm_logs_to_stderr()  # stdout: the endpoint and curl lines only
    run(
        checkpoint, host=host, port=port, skip_gate=skip_gate, extra_args=list(ctx.args), **_api_key(api_key),
        ready_timeout=ready_timeout, verbose=verbose, verify_key=verify_key,
    )  # fmt: skip


@app.command()
@_user_errors
def sign(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint dir whose accuracy gate passed.")],
    private_key: Annotated[Path, typer.Option("--private-key", help="PEM elliptic-curve private key (e.g. P-256).")],
    password_env: Annotated[
        str | None, typer.Option("--password-env", help="Name of the environment variable holding the key's password.")
    ] = None,
) -> None:
    """Sign a gated checkpoint with OpenSSF model-signing: every file, the manifest and the eval record.

    Writes CKPT/qserve_signature.sig (a sigstore bundle). `qserve serve CKPT --verify-key PUB` and
    `qserve eval CKPT --verify-key PUB` then refuse it if any file was added, removed or changed, or if
    another key signed it. Re-evaluating rewrites the eval record, so sign again after an eval.

    \b
    Example (a P-256 key pair, then the signature):
      openssl ecparam -name prime256v1 -genkey -noout | openssl pkcs8 -topk8 -nocrypt -out key.pem
      openssl ec -in key.pem -pubout -out key.pub
      qserve sign out-w8a8-int8 --private-key key.pem
      qserve serve out-w8a8-int8 --verify-key key.pub
    """
    from qserve.checkpoint.signing import sign as run

    password = os.environ.get(password_env) if password_env else None
    typer.echo(str(run(checkpoint, private_key, password)))


@app.command()
@_user_errors
def inspect(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint dir written by `qserve quantize`.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """Show a checkpoint's scheme, size against its baseline, vLLM arguments, integrity and gate status."""
    from qserve.checkpoint.inspection import format_inspection, inspect_checkpoint

    info = inspect_checkpoint(checkpoint)
    typer.echo(json.dumps(info, indent=2) if as_json else format_inspection(info))


@app.command()
@_user_errors
def compare(
    recipes: Annotated[list[Path], typer.Argument(help="Two or more recipe YAMLs, e.g. recipes/*.yaml.")],
    model: ModelOpt = None,
    tasks: Annotated[
        str | None, typer.Option("--tasks", "-t", help="Comma-separated tasks (default: each recipe's gated tasks).")
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", "-l", min=1, help="Items per task.")] = None,
    out_dir: Annotated[Path, typer.Option("--out-dir", "-o", help="Where checkpoints, compare.json and compare.png go.")] = Path(
        "compare"
    ),
    data_dir: DataDirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of the table.")] = False,
) -> None:
    """Quantize with each recipe (reusing finished checkpoints), gate each against the shared cached
    baseline, measure size and vLLM decode speed, and print one table plus a PNG plot."""
    from qserve.compare import compare as run
    from qserve.compare import format_compare

    with _results_only_on_stdout(), bounded_in_process_stop():
        result = run(recipes, model=model, tasks=_split(tasks), limit=limit, data_dir=data_dir, out_dir=out_dir)
    typer.echo(json.dumps(result, indent=2) if as_json else format_compare(result))


@app.command()
@_user_errors
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
    work_dir: Annotated[Path, typer.Option(help="Scratch dir for --suite checkpoints and bench_suite.json.")] = Path(
        "bench-suite"
    ),
    data_dir: DataDirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """Throughput and latency (TTFT, TPOT) of a served checkpoint under vLLM's own benchmark load;
    with --suite, what qserve costs against the raw libraries (ratios measured in one run)."""
    _vllm_logs_to_stderr()
    if suite:
        from qserve.bench_suite import format_suite, run_suite
        from qserve.paths import project_data

        with _results_only_on_stdout():
            result = run_suite(project_data("recipes"), work_dir, data_dir)
        typer.echo(json.dumps(result, indent=2) if as_json else format_suite(result))
        return
    if checkpoint is None:
        raise QserveError("pass CHECKPOINT to benchmark, or --suite")
    from qserve.serve.bench import Load, format_bench
    from qserve.serve.bench import bench as run

    with _results_only_on_stdout():
        result = run(checkpoint, Load(num_prompts, input_len, output_len, concurrency))
    typer.echo(json.dumps(result, indent=2) if as_json else format_bench(result))


@app.command()
@_user_errors
def doctor(
    probe: Annotated[
        list[Path] | None,
        typer.Option("--probe", help="Also load this checkpoint in vLLM here and check the matrix's claim (repeatable)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check this machine: library versions against the tested set, the device, and which schemes vLLM runs here.

    The scheme matrix is measured (the test suite re-runs every entry on vLLM); a scheme vLLM cannot run
    here is evaluated through transformers (emulated) and refused by `qserve serve`. Exit 1 if a
    required library is missing or a probed checkpoint contradicts the matrix.
    """
    from qserve.device.doctor import diagnose, format_report

    with _results_only_on_stdout():
        report = diagnose(probe)
    typer.echo(json.dumps(report, indent=2) if as_json else format_report(report))
    raise typer.Exit(0 if report["ok"] else EXIT_ERROR)


def _api_key(value: str | None) -> dict[str, str | None]:
    """The API key and where it came from: --api-key, QSERVE_API_KEY, or an inherited VLLM_API_KEY (reported)."""
    if value is not None:
        flag = any(a == "--api-key" or a.startswith("--api-key=") for a in sys.argv)
        return {"api_key": value, "key_source": "--api-key" if flag else "QSERVE_API_KEY"}
    inherited = os.environ.get("VLLM_API_KEY")
    if inherited:
        typer.echo("note: using the API key inherited in VLLM_API_KEY (pass --api-key to choose one)", err=True)
        return {"api_key": inherited, "key_source": "VLLM_API_KEY"}
    return {"api_key": None, "key_source": "--api-key"}


def _split(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
