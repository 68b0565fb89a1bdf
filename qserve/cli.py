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

from qserve.errors import EXIT_ERROR, EXIT_GATE_FAILED, EXIT_GATE_INCONCLUSIVE, QserveError

app = typer.Typer(
    name="qserve",
    help="Quantize an LLM, gate its accuracy with lm-eval, and serve it on vLLM with matched arguments.\n\n"
    "Typical flow: `qserve quantize recipes/w4a16-gptq.yaml` -> `qserve eval` -> `qserve serve out-w4a16-gptq`.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

ModelOpt = Annotated[
    str | None,
    typer.Option("--model", "-m", help="Local HF checkpoint dir or hub id. Default: the embedded SmolLM2-135M-Instruct."),
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
        except OSError as exc:  # full disk, permissions: the user's to fix, not a crash
            where = f": {exc.filename}" if exc.filename else ""
            typer.echo(f"error: {exc.strerror or exc}{where}", err=True)
            raise typer.Exit(EXIT_ERROR) from None

    return wrapper


@app.command()
@_user_errors
def quantize(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML, e.g. recipes/w4a16-gptq.yaml.")],
    model: ModelOpt = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Checkpoint directory. Default: out-<recipe name>.")
    ] = None,
    data_dir: DataDirOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output directory.")] = False,
    trust_remote_code: Annotated[
        bool, typer.Option("--trust-remote-code", help="Run the model repo's own Python code (off by default).")
    ] = False,
) -> None:
    """Quantize a model with a recipe and export a safetensors checkpoint plus qserve_manifest.json."""
    from qserve.quantize import quantize as run

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
        typer.Option("--gate", "-g", help="TASK=MIN_RECOVERY, e.g. gsm8k=0.9; repeatable. Overrides the recipe (default 0.95)."),
    ] = None,
    data_dir: DataDirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON instead of a table.")] = False,
) -> None:
    """Run lm-eval on the checkpoint and its baseline in vLLM; exit 3 if a gate fails, 4 if none could decide."""
    from qserve.evaluation import evaluate, format_table

    with _results_only_on_stdout():
        summary = evaluate(checkpoint, tasks=_split(tasks), limit=limit, gates=_parse_gates(gate), data_dir=data_dir)
    typer.echo(json.dumps(summary, indent=2) if as_json else format_table(summary))
    code = {"pass": 0, "fail": EXIT_GATE_FAILED}.get(summary["verdict"], EXIT_GATE_INCONCLUSIVE)
    raise typer.Exit(code)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@_user_errors
def serve(
    ctx: typer.Context,
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint dir whose accuracy gate passed.")],
    host: Annotated[str, typer.Option(help="Address to bind. Loopback unless you mean otherwise.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8000,
    skip_gate: Annotated[
        bool, typer.Option("--skip-gate", help="Serve even without a passing gate (not for production).")
    ] = False,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="QSERVE_API_KEY", help="Require this bearer token.")] = None,
) -> None:
    """Start vLLM's OpenAI-compatible server with the checkpoint's quantization, kv_cache_dtype and dtype.

    Extra vLLM options go after `--`, e.g. `qserve serve CKPT -- --tensor-parallel-size 2 --max-model-len 4096`;
    they may not contradict the checkpoint's --quantization, --kv-cache-dtype or --dtype.
    """
    from qserve.serving import serve as run

    _vllm_logs_to_stderr()  # stdout: the endpoint and curl lines only
    raise typer.Exit(run(checkpoint, host=host, port=port, skip_gate=skip_gate, api_key=api_key, extra_args=list(ctx.args)))


def _split(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def _parse_gates(values: list[str] | None) -> dict[str, float]:
    gates = {}
    for item in values or []:
        task, sep, threshold = item.partition("=")
        try:
            gates[task.strip()] = float(threshold)
        except ValueError:
            sep = ""
        if not sep or not task.strip():
            raise QserveError(f"--gate {item!r}: expected TASK=MIN_RECOVERY, e.g. gsm8k=0.9")
    return gates


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
