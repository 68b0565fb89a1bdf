"""What every command shares: options, the error handling, small parsers."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from qserve import paths
from qserve.errors import EXIT_ERROR, EXIT_GATE_FAILED, EXIT_GATE_INCONCLUSIVE, QserveError, Stopped
from qserve.gate.spending import MIN_ITEMS
from qserve.runtime.capture import library_output  # noqa: F401  (the commands' log capture)

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Local HF checkpoint dir, a .gguf file (converted once, its tokenizer checked), or hub id. "
        "Default: the embedded SmolLM2-135M-Instruct.",
    ),
]
DataDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--data-dir", help="Root for relative data paths in recipes and evals/. Default: $QSERVE_DATA_DIR or the current dir."
    ),
]
VerboseOpt = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Also show the libraries' own output live (vLLM, llm-compressor, lm-eval); it always goes to the log file.",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of text.")]
TrustRemoteCodeOpt = Annotated[
    bool, typer.Option("--trust-remote-code", help="Run the model repo's own Python code (off by default).")
]
TasksOpt = Annotated[
    str | None,
    typer.Option(
        "--tasks",
        "-t",
        help="Comma-separated tasks: qserve's evals/ (gsm8k_ppl, gsm8k, gsm8k_mc, arc_easy) or any task, tag or group "
        "lm-eval knows (arc_challenge, gsm8k_cot_llama, mmlu, ...); a group is one gate over its tasks' pooled items. "
        "Default: the recipe's gated tasks.",
    ),
]
LimitOpt = Annotated[
    int | None,
    typer.Option(
        "--limit",
        "-l",
        min=1,
        help="Evaluate N items of each task: the first N of a seeded random order of its documents, fixed per task, "
        "so a larger N keeps a smaller one's items (and after the checkpoint's record of a smaller N, scores only the rest). "
        "A group gated as one (mmlu) takes N items of the group: the first N of one order of its tasks' items.",
    ),
]
GateOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--gate",
        "-g",
        help="TASK[@METRIC][:CRITERION]=VALUE, repeatable; CRITERION is min_recovery (default), max_drop or "
        "max_increase (perplexity, relative). E.g. gsm8k=0.9, gsm8k_ppl:max_increase=0.05. A per-item score outside "
        "[0, 1] is bet on in the range you declare: truthfulqa_gen@bleu_max:score_range=0,100 (cap=NATS: a perplexity's). "
        "Replaces the recipe's gates for that task (default: min_recovery 0.95).",
    ),
]
ParityOpt = Annotated[
    bool,
    typer.Option(
        "--parity/--no-parity", help="Check that vLLM matches transformers on this checkpoint (greedy tokens, logprobs)."
    ),
]
HostOpt = Annotated[str, typer.Option(help="Address to bind. Loopback unless you mean otherwise.")]
PortOpt = Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="QSERVE_API_KEY",
        help="Require this bearer token on every route but /health, /ping, /version and /metrics. Prefer "
        "QSERVE_API_KEY or --api-key-file: on the command line the key is visible in `ps` (warned). "
        "An inherited VLLM_API_KEY is used (and reported) when none of these is set.",
    ),
]
ApiKeyFileOpt = Annotated[
    Path | None,
    typer.Option("--api-key-file", exists=True, dir_okay=False, help="Read the API key from this file (first line)."),
]
ReadyTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--ready-timeout",
        min=1,
        help="Seconds the vLLM server may take to answer its first request; then it is stopped (exit 1).",
    ),
]
VerifyKeyOpt = Annotated[
    Path | None,
    typer.Option(
        "--verify-key",
        help="PEM public key: refuse the checkpoint unless `qserve sign` with the matching private key covered "
        "exactly its files, manifest and eval record.",
    ),
]


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Print QserveError as one line on stderr and exit non-zero; no traceback for user mistakes."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            paths.cache_dir()  # a QSERVE_CACHE_DIR naming a file is refused before any work
            return fn(*args, **kwargs)
        except QserveError as exc:
            typer.echo(f"error: {one_line(str(exc))}", err=True)
            raise typer.Exit(EXIT_ERROR) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None
        except Stopped as exc:  # the vLLM process group is already gone
            typer.echo(str(exc), err=True)
            raise typer.Exit(128 + exc.signum) from None
        except OSError as exc:  # full disk, permissions; or qserve's own bug: its traceback is kept
            where = f": {exc.filename}" if exc.filename else ""
            typer.echo(f"error: {exc.strerror or exc}{where} (traceback in {_keep_traceback()})", err=True)
            raise typer.Exit(EXIT_ERROR) from None

    return wrapper


def _keep_traceback() -> Path:
    """Write the exception being handled to a log of its own (the cache's, else the temp dir's)."""
    import tempfile
    import traceback

    for folder in (lambda: paths.cache_dir() / "logs", lambda: Path(tempfile.gettempdir())):
        try:
            target = folder()
            target.mkdir(parents=True, exist_ok=True)
            log = target / f"error-{os.getpid()}.log"
            log.write_text(traceback.format_exc())
            return log
        except (OSError, QserveError):
            continue
    return Path("/dev/null")


def one_line(message: str) -> str:
    """A message as one line: a line break inside a user's input (a YAML key, a file name) would
    split the `error:` line."""
    return " ".join(message.splitlines())


def vllm_logs_to_stderr() -> None:
    """vLLM logs to stdout by default; qserve keeps stdout for results (children inherit this)."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def verdict_exit(verdict: str) -> int:
    """The exit code of a verdict: 0 pass, else the gate's failed or inconclusive code."""
    return {"pass": 0, "fail": EXIT_GATE_FAILED}.get(verdict, EXIT_GATE_INCONCLUSIVE)


def api_key(value: str | None, key_file: Path | None = None) -> dict[str, str | None]:
    """The API key and where it came from: --api-key-file, QSERVE_API_KEY, --api-key (warned: `ps` shows
    it), or an inherited VLLM_API_KEY (reported)."""
    if key_file is not None:
        if value is not None:
            raise QserveError("pass the API key once: --api-key-file or --api-key/QSERVE_API_KEY, not both")
        lines = key_file.read_text().splitlines()
        key = lines[0].strip() if lines else ""
        if not key:
            raise QserveError(f"--api-key-file {key_file} is empty")
        return {"api_key": key, "key_source": f"--api-key-file {key_file}"}
    if value is not None:
        flag = any(a == "--api-key" or a.startswith("--api-key=") for a in sys.argv)
        if flag:
            typer.echo(
                "warning: --api-key on the command line is visible to every user of this machine (ps, /proc); "
                "use QSERVE_API_KEY or --api-key-file",
                err=True,
            )
        return {"api_key": value, "key_source": "--api-key" if flag else "QSERVE_API_KEY"}
    inherited = os.environ.get("VLLM_API_KEY")
    if inherited:
        typer.echo("note: using the API key inherited in VLLM_API_KEY (pass --api-key-file to choose one)", err=True)
        return {"api_key": inherited, "key_source": "VLLM_API_KEY"}
    return {"api_key": None, "key_source": "--api-key"}


def split(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


PolicyOpt = Annotated[
    Path | None,
    typer.Option(
        "--policy",
        help="YAML gate policy (gates: as in a recipe; min_items: N; require_all_tasks: true). "
        f"Default: the recipe's gates on at least {MIN_ITEMS} items.",
    ),
]
AcceptGateDifferenceOpt = Annotated[
    bool,
    typer.Option(
        "--accept-gate-difference",
        help="Accept a gate record looser than the policy (or on fewer items); written into the eval record and model card.",
    ),
]
TensorParallelOpt = Annotated[
    int, typer.Option("--tensor-parallel-size", "-tp", min=1, help="vLLM tensor parallelism: GPUs per model replica.")
]
PipelineParallelOpt = Annotated[int, typer.Option("--pipeline-parallel-size", "-pp", min=1, help="vLLM pipeline stages.")]
DataParallelOpt = Annotated[
    int,
    typer.Option(
        "--data-parallel-size",
        "-dp",
        min=1,
        help="Engine replicas: lm-eval runs each as a Ray task on its own GPUs (GPU hosts, Ray installed).",
    ),
]
ExecutorOpt = Annotated[
    str | None,
    typer.Option("--distributed-executor-backend", help="vLLM's executor: mp (one node) or ray (several nodes)."),
]


def parallel_args(tp: int, pp: int, dp: int, backend: str | None) -> dict[str, Any]:
    """vllm.LLM keywords for the non-default parallel options."""
    named = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "data_parallel_size": dp}
    out: dict[str, Any] = {k: v for k, v in named.items() if v != 1}
    if backend:
        out["distributed_executor_backend"] = backend
    return out
