"""`qserve quantize` and `qserve reproduce`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from qserve.cli._common import DataDirOpt, JsonOpt, ModelOpt, TrustRemoteCodeOpt, VerboseOpt, library_output, user_errors
from qserve.errors import EXIT_GATE_FAILED

RecipeArg = Annotated[
    Path, typer.Argument(help="Recipe YAML (qserve's or a plain llm-compressor recipe), e.g. recipes/w4a16-gptq.yaml.")
]
OutputOpt = Annotated[
    Path | None, typer.Option("--output", "-o", help="Checkpoint directory. Default: the recipe's output, else out-<name>.")
]


@user_errors
def quantize(
    recipe: RecipeArg,
    model: ModelOpt = None,
    output: OutputOpt = None,
    data_dir: DataDirOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output directory.")] = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
    nproc: Annotated[
        int, typer.Option("--nproc", min=1, help="Calibrate data-parallel in N processes under torchrun (one per GPU).")
    ] = 1,
    nnodes: Annotated[int, typer.Option("--nnodes", min=1, help="Machines taking part (with --rdzv-endpoint).")] = 1,
    rdzv_endpoint: Annotated[
        str | None, typer.Option("--rdzv-endpoint", help="HOST:PORT on this machine (node 0) that the other nodes join.")
    ] = None,
    verbose: VerboseOpt = False,
) -> None:
    """Quantize a model with a recipe and export a safetensors checkpoint plus qserve_manifest.json.

    The recipe picks the backend (llm-compressor or AMD Quark), the scheme (FP8_DYNAMIC, FP8, W8A8,
    W4A16, MXFP4, MXFP4A16; FP8_BLOCK, MXFP8, NVFP4, NVFP4A16, W4AFP8), the algorithm (rtn, gptq, awq, autoround), an optional FP8 KV cache, and the
    calibration data (files, a hub dataset, a weighted mix, or text the model writes itself). See
    recipes/ for one of each; the manifest records the vLLM arguments the checkpoint needs. The
    libraries' output goes to OUTPUT/logs/quantize.log; the checkpoint's path is printed on stdout.

    A model too large for memory is quantized shard by shard when the recipe is data-free (recipe
    field `execution`). --nproc N splits calibration between N torchrun processes; with --nnodes,
    qserve prints the torchrun command each other machine runs (model, data and output on shared
    storage).

    \b
    Examples:
      qserve quantize recipes/w8a8-int8.yaml
      qserve quantize recipes/w4a16-gptq.yaml --model ./my-model --output out-my-w4a16
      qserve quantize recipes/w4a16-gptq.yaml --model ./llama-70b --nproc 8
      qserve quantize recipes/w4a16-gptq.yaml --model /shared/llama-70b --nproc 8 --nnodes 2 --rdzv-endpoint node0:29500
    """
    from qserve.quantize.distributed import check_nodes, current_accelerator
    from qserve.quantize.pipeline import QuantizeOptions
    from qserve.workflows.run import quantize_logged

    if nnodes > 1:
        check_nodes(nnodes, current_accelerator())
    nodes = {"nnodes": nnodes, "rdzv_endpoint": rdzv_endpoint} if nnodes > 1 else {}
    options = QuantizeOptions(
        model=model,
        output=output,
        data_dir=data_dir,
        force=force,
        trust_remote_code=trust_remote_code,
        nproc=nproc,
        nodes=nodes,
    )
    out = quantize_logged(recipe, options, verbose)
    typer.echo(str(out))


@user_errors
def reproduce(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint dir written by `qserve quantize`.")],
    data_dir: DataDirOpt = None,
    keep: Annotated[Path | None, typer.Option("--keep", help="Keep the re-run checkpoint in this directory.")] = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Re-run the checkpoint's recipe on its recorded model and calibration data and compare every file.

    Prints "bit-exact" when every file's SHA-256 matches; otherwise each differing file and, for
    weights, each differing tensor's largest absolute difference, plus what the run depended on that
    changed since (torch threads, device and ISA, library versions, calibration texts). Exit 0 when
    bit-exact, 3 when anything differs. The libraries' output goes to CHECKPOINT/logs/reproduce.log.

    \b
    Example:
      qserve reproduce out-w8a8-int8
    """
    from qserve.paths import log_file
    from qserve.workflows.reproduce import format_reproduction
    from qserve.workflows.reproduce import reproduce as run

    with library_output(log_file(checkpoint, "reproduce"), verbose):
        result = run(checkpoint, data_dir=data_dir, keep=keep)
    typer.echo(json.dumps(result, indent=2) if as_json else format_reproduction(result))
    raise typer.Exit(0 if result["bit_exact"] else EXIT_GATE_FAILED)
