"""`qserve quantize`: check a recipe against the model, calibrate, export, write the manifest."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

from qserve import paths
from qserve.checkpoint.manifest import MANIFEST_NAME, Manifest, VllmArgs, hash_files, library_versions, write_manifest
from qserve.compat import patched
from qserve.errors import QserveError, is_out_of_memory
from qserve.gate.card import write_card
from qserve.models.sources import ModelRef, resolve_model
from qserve.progress import info, step
from qserve.quantize import architecture, backends
from qserve.quantize.execution import (
    Execution,
    check_parallel,
    choose,
    memory_limit_bytes,
    offload_budget,
    peak_rss_mib,
    recipe_calibration_dtype,
    shard_count,
)
from qserve.quantize.recipe_file import make_plain
from qserve.quantize.sparsity import check_structured_sparsity
from qserve.runtime.scratch import clean_stale, exchange, scratch_dir
from qserve.schemes.backends import get_backend
from qserve.schemes.catalog import SCHEMES
from qserve.spec.recipe import DEFAULT_CALIBRATION, CalibrationSpec, Recipe, load_recipe

CANDIDATE_GROUP_SIZES = (32, 64, 128, 256)


class RecipeSource(NamedTuple):
    path: str | Path
    sha256: str


@dataclass(frozen=True)
class QuantizeResult:
    output: Path
    manifest: Manifest


def default_output(recipe: Recipe) -> Path:
    return Path(recipe.output or f"out-{recipe.name}")


@dataclass(frozen=True)
class QuantizeOptions:
    """How a recipe is run (the defaults are `qserve quantize`'s).

    `model` and `output` win over the recipe's. `remember` makes the result the checkpoint
    `qserve eval` uses when given none. `nproc` > 1 calibrates data-parallel under torchrun; `nodes`
    (nnodes, node_rank, rdzv_endpoint) spans machines.
    """

    model: str | None = None
    output: str | Path | None = None
    data_dir: str | Path | None = None
    force: bool = False
    trust_remote_code: bool = False
    remember: bool = True
    nproc: int = 1
    nodes: dict[str, Any] | None = None


@dataclass(frozen=True)
class _Job:
    """One checked quantization: the model, the recipe as it will run, its data and how it runs."""

    ref: ModelRef
    recipe: Recipe
    source: RecipeSource
    texts: list[str] | None
    calibration: dict[str, Any] | None
    run: Execution
    options: QuantizeOptions


def quantize(recipe_path: str | Path, options: QuantizeOptions | None = None) -> QuantizeResult:
    """Quantize the model with the recipe and write a checkpoint plus manifest (default out-<name>)."""
    options = options or QuantizeOptions()
    recipe, recipe_sha = load_recipe(recipe_path)
    out = Path(options.output) if options.output else default_output(recipe)
    if out.exists() and not options.force:
        raise QserveError(f"output {out} already exists; pass --force to replace it or --output to choose another")
    recipe = with_default_calibration(recipe)
    nnodes = (options.nodes or {}).get("nnodes", 1)
    check_parallel(recipe, options.nproc * nnodes)
    check_writable(out)
    if recipe.calibration is not None:
        from qserve.quantize.calibration import check_files

        check_files(recipe.calibration, paths.data_dir(options.data_dir))
    ref = resolve_model(options.model or recipe.model)
    check_output(out, ref.path)
    # tune and the matrix quantize in a process where vLLM ran before
    with patched("transformers-undecorated"):
        recipe = _checked_for_model(recipe, ref.path, options.trust_remote_code)
    run = choose(recipe, ref.path, options.nproc, nnodes)
    if run.path != "in_memory":  # the usual path stays quiet; the manifest records it either way
        info(f"execution: {run.path} ({run.reason})")
    texts, calib_record = _calibration_texts(recipe, options.data_dir, ref.path)
    job = _Job(ref, recipe, RecipeSource(recipe_path, recipe_sha), texts, calib_record, run, options)

    # Build next to the target in a directory of this run's own, and move it into place only
    # when complete: a crash, a Ctrl-C or a concurrent run never leaves a directory at `out`
    # that looks like a finished checkpoint, and --force keeps the old one until then.
    clean_stale(out)
    partial = scratch_dir(out, "partial")
    umask = os.umask(0)
    os.umask(umask)
    partial.chmod(0o777 & ~umask)  # mkdtemp's 0700 would make the checkpoint private
    try:
        with _terminate_as_interrupt(), patched("transformers-undecorated"):
            manifest = _run(job, partial)
        write_card(partial, manifest, None, named=out)
        publish(partial, out, options.force)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    if options.remember:
        paths.remember_checkpoint(out)
    info(f"checkpoint written to {out}")
    return QuantizeResult(out, manifest)


def _checked_for_model(recipe: Recipe, model_path: Path, trust_remote_code: bool) -> Recipe:
    """The recipe as it will run on this model (routers ignored), refused before any work where the
    model's shapes, experts, dtype or layer mappings cannot take it."""
    recipe = architecture.with_routers_ignored(model_path, recipe, trust_remote_code)
    check_shapes(model_path, recipe, trust_remote_code)
    check_moe(model_path, recipe, trust_remote_code)
    architecture.check_dtype(model_path, recipe)
    architecture.check_mappings(model_path, recipe, trust_remote_code)
    return recipe


def _calibration_texts(
    recipe: Recipe, data_dir: str | Path | None, model_path: Path
) -> tuple[list[str] | None, dict[str, Any] | None]:
    """The calibration samples and their record (None, None for a data-free recipe)."""
    if recipe.calibration is None:
        return None, None
    from qserve.quantize.calibration import load_texts

    return load_texts(recipe.calibration, paths.data_dir(data_dir), model_path)


def check_writable(out: Path) -> None:
    """Refuse, before any work, an output whose nearest existing folder is a file or cannot be written
    (the checkpoint is built beside it, then moved into place)."""
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists() or p.is_symlink())
    if existing != out.absolute() and not existing.is_dir():
        raise QserveError(f"--output {out}: {existing} is a file, not a directory")
    folder = existing.parent if existing == out.absolute() else existing
    if not os.access(folder, os.W_OK | os.X_OK):
        raise QserveError(f"--output {out}: cannot write in {folder}")


def check_output(out: Path, source: Path) -> None:
    """Refuse an output that overlaps the source model, or that --force would wrongly delete."""
    o, src = out.resolve(), source.resolve()
    if o == src or src in o.parents or o in src.parents:
        raise QserveError(f"--output {out} overlaps the source model {source}; choose a directory outside it")
    if out.exists() and not (out / MANIFEST_NAME).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise QserveError(
            f"--force replaces only a qserve checkpoint, and {out} has no {MANIFEST_NAME}; remove it yourself or choose another --output"
        )


def publish(partial: Path, out: Path, force: bool) -> None:
    """Move a finished checkpoint into place; a checkpoint already there is replaced only with `force`,
    and only now that the new one is complete, by an atomic exchange: a crash at any moment leaves
    the old checkpoint or the new one at `out`, never neither (the caller removes `partial`, which
    then holds the old one)."""
    if not out.exists():
        try:
            partial.rename(out)
            return
        except OSError:
            if not out.exists():
                raise
    if not force:
        raise QserveError(
            f"output {out} appeared while this run worked (another qserve quantize?); this run's result was discarded"
        )
    if exchange(partial, out):
        return
    # No atomic exchange here: the old checkpoint waits beside `out` between two renames, where the
    # next run puts it back if this one is killed in between (scratch.clean_stale).
    old = scratch_dir(out, "old")
    old.rmdir()
    out.rename(old)
    try:
        partial.rename(out)
    except OSError:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _run(job: _Job, partial: Path) -> Manifest:
    ref, recipe, source, texts, calib_record, run = job.ref, job.recipe, job.source, job.texts, job.calibration, job.run
    trust_remote_code, nodes = job.options.trust_remote_code, job.options.nodes
    start = time.monotonic()
    label = f"quantizing {ref.id}: {recipe.label}"
    label += f" on {len(texts)} calibration samples" if texts else " (data-free)"
    label += f" in {run.nproc} processes" if run.nproc > 1 else " shard by shard" if run.path == "model_free" else ""
    with step(label) as timing:
        try:
            name, execution, counts = _execute(ref.path, recipe, texts, partial, trust_remote_code, run, nodes or {})
        except Exception as exc:
            if is_out_of_memory(exc):
                raise QserveError(_out_of_memory(run.path, recipe)) from None
            raise
    scheme = SCHEMES[name]
    sparsity, experts = _checked_export(ref.path, recipe, partial, trust_remote_code, counts)
    with step("hashing checkpoint files"):
        files = hash_files(partial)
    manifest = Manifest(
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        scheme=scheme.name,
        recipe=recipe,
        recipe_source={"path": str(Path(source.path).resolve()), "sha256": source.sha256},
        source_model={"id": ref.id, "path": str(ref.path), "source": ref.source},
        calibration=calib_record,
        versions=library_versions(),
        vllm_args=VllmArgs(
            quantization=get_backend(recipe.backend).vllm_quantization,
            kv_cache_dtype=recipe.kv_cache.dtype if recipe.kv_cache else "auto",
            dtype=architecture.serving_dtype(ref.path, recipe, scheme.vllm_dtype),
            trust_remote_code=trust_remote_code,
        ),
        timings={
            "quantize_seconds": timing["seconds"],
            "total_seconds": round(time.monotonic() - start, 2),
            "peak_rss_mib": max([peak_rss_mib(), *(r["peak_rss_mib"] for r in execution.get("ranks", []))]),
        },
        files=files,
        environment=environment(ref.path),
        execution=execution,
        experts=experts,
        sparsity=sparsity,
    )
    write_manifest(partial, manifest)
    return manifest


def _checked_export(
    model_path: Path, recipe: Recipe, partial: Path, trust_remote_code: bool, counts: dict | None
) -> tuple[dict | None, dict | None]:
    """What the written files must show before they are hashed (2:4 sparsity where asked, no router
    quantized), and the manifest's `sparsity` and `experts` records."""
    make_plain(partial)  # llm-compressor's recipe.yaml, re-runnable with yaml.safe_load and oneshot
    sparsity = check_structured_sparsity(partial, recipe.sparsity) if recipe.sparsity else None
    experts = _experts_record(model_path, trust_remote_code, counts)
    if experts is not None:
        from qserve.quantize.experts import check_routers_unquantized, experts_quantized, name_unquantized_experts

        check_routers_unquantized(partial)
        experts["quantized"] = experts_quantized(partial)
        if not experts["quantized"] and (partial / "config.json").is_file():
            name_unquantized_experts(partial)
    return sparsity, experts


def _experts_record(model_path: Path, trust_remote_code: bool, counts: dict | None) -> dict | None:
    """The manifest's `experts`: the MoE shape from the config, and the calibration counts if any."""
    from qserve.quantize.experts import moe_summary

    summary = moe_summary(model_path, trust_remote_code)
    return None if summary is None else summary | (counts or {})


def check_moe(model_path: Path, recipe: Recipe, trust_remote_code: bool = False) -> None:
    """qserve checks expert calibration through llm-compressor's linearized experts only."""
    from qserve.quantize.experts import moe_summary

    if recipe.backend == "quark" and recipe.calibration is not None and moe_summary(model_path, trust_remote_code):
        raise QserveError(
            "calibrating a mixture-of-experts model is supported with backend: llmcompressor only "
            "(qserve counts each expert's calibration tokens through llm-compressor's linearized experts)"
        )


def _offloaded(
    model_path: Path, recipe: Recipe, texts: list[str] | None, out: Path, trust_remote_code: bool
) -> tuple[str, dict | None]:
    """oneshot with the weights beyond this machine's memory on disk, in a folder removed afterwards."""
    from qserve.quantize.backends.llmcompressor import exported_scheme, run_oneshot

    folder = out / ".offload"  # inside this run's partial directory: removed with it, whatever happens
    folder.mkdir()
    try:
        offload = {"max_memory": {"cpu": offload_budget()}, "offload_folder": str(folder)}
        with patched("glibc-freed-weights-returned"):
            experts = run_oneshot(model_path, recipe, texts, out, trust_remote_code, offload=offload)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return exported_scheme(out, recipe), experts


def _out_of_memory(path: str, recipe: Recipe) -> str:
    where = {"in_memory": "in memory", "model_free": "shard by shard", "offload": "with offloading"}.get(
        path, "in the calibration processes"
    )
    limit = f"limit {memory_limit_bytes() / 2**30:.1f} GiB available now"
    if path == "in_memory" and recipe.model_free_obstacle() is None:
        advice = "this recipe is data-free: set `execution: model_free` (or auto) to quantize one shard at a time"
    elif path == "in_memory" and recipe.backend == "llmcompressor":
        advice = "set `execution: offload` (or auto) to keep the weights that do not fit on disk"
    else:
        advice = "free memory or use a larger machine"
    return f"out of memory quantizing {where} ({limit}); {advice}"


def _execute(
    model_path: Path,
    recipe: Recipe,
    texts: list[str] | None,
    out: Path,
    trust_remote_code: bool,
    run: Execution,
    nodes: dict[str, Any],
) -> tuple[str, dict, dict | None]:
    """The library call for the chosen execution path; returns the scheme written, the record of
    how, and a calibrated mixture of experts' token counts."""
    record = run.record()
    if run.path == "model_free":
        from qserve.quantize.backends.llmcompressor import quantize_model_free

        record["shards"] = shard_count(model_path)
        return quantize_model_free(model_path, recipe, out), record, None
    if run.path == "offload":
        name, experts = _offloaded(model_path, recipe, texts, out, trust_remote_code)
        return name, record | {"max_memory_cpu": offload_budget()}, experts
    if run.path == "distributed":
        from qserve.quantize import distributed
        from qserve.quantize.backends.llmcompressor import exported_scheme

        launched = distributed.launch(model_path, recipe, texts, out, trust_remote_code, run.nproc, **nodes)
        experts = launched.pop("experts")  # the added-up counts go to the manifest's `experts`
        return exported_scheme(out, recipe), record | launched, experts
    if (calibrating := recipe_calibration_dtype(recipe, model_path)) is not None:  # as run_oneshot does
        record["calibration_dtype"] = calibrating
    name, experts = backends.runner(recipe.backend).quantize(model_path, recipe, texts, out, trust_remote_code)
    return name, record, experts


def environment(model_path: Path) -> dict[str, Any]:
    """What a bit-exact re-run needs besides recipe, model, data and library versions."""
    import platform

    import torch

    from qserve.checkpoint.hashing import model_digest
    from qserve.device.detect import detect_device, fingerprint

    return {
        "torch_threads": torch.get_num_threads(),
        "device": fingerprint(detect_device()),
        "python": platform.python_version(),
        "source_model_sha256": model_digest(model_path),
    }


def with_default_calibration(recipe: Recipe) -> Recipe:
    """llm-compressor modifiers that calibrate but came without data get qserve's default source."""
    if recipe.calibration is not None or recipe.modifiers is None:
        return recipe
    from qserve.quantize.backends.llmcompressor import modifiers_need_data

    if not modifiers_need_data(recipe.modifiers):
        return recipe
    info(f"the recipe's modifiers calibrate; using the default calibration {DEFAULT_CALIBRATION}")
    return recipe.model_copy(update={"calibration": CalibrationSpec.model_validate(DEFAULT_CALIBRATION)})


class _terminate_as_interrupt:
    """Turn SIGTERM into KeyboardInterrupt so cleanup runs for `kill` as for Ctrl-C."""

    def __enter__(self):
        self._old = signal.signal(signal.SIGTERM, self._raise)

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self._old)

    @staticmethod
    def _raise(signum, frame):
        raise KeyboardInterrupt


def check_shapes(model_path: Path, recipe: Recipe, trust_remote_code: bool = False) -> None:
    """Fail before calibrating when the recipe cannot apply to the model's layers. An override's
    group size is checked against every layer too: cheap, and its targets are usually regexes."""
    if recipe.scheme is None:
        return
    _check_tiles(model_path, recipe, trust_remote_code)
    wanted = [(recipe.scheme, recipe.group_size), *((o.scheme, o.group_size) for o in recipe.overrides)]
    groups = {g or _preset_group_size(s) for s, g in wanted if g is not None or SCHEMES[s].group_quantized} - {None}
    if not groups:
        return
    dims = linear_input_dims(model_path, recipe.ignore, trust_remote_code)
    for group in sorted(groups):
        bad = {name: d for name, d in dims.items() if d % group}
        if not bad:
            continue
        fits = [g for g in CANDIDATE_GROUP_SIZES if all(d % g == 0 for d in dims.values())]
        layers = ", ".join(f"{name} (input dim {d})" for name, d in sorted(bad.items()))
        advice = f"set group_size to {' or '.join(map(str, fits))}" if fits else "add these layers to ignore"
        raise QserveError(f"group_size {group} does not divide the input dim of {layers}; {advice} in the recipe")


# vLLM loads these projections as one fused GEMM (packed_modules_mapping in vLLM 0.32's source: Llama
# and Mistral, Qwen 2/3, Gemma 2/3, Granite; the MoE models fuse q/k/v only, and Phi-3's checkpoint is
# fused already, so none of its names is listed); with block-
# quantized weights every part but the last must be a whole number of blocks (fp8_utils.py,
# validate_fp8_block_shape: "Weight output_partition_size = 576 is not divisible by ... block_n = 128").
FUSED_NOT_LAST = {"q_proj": "q_proj, k_proj, v_proj", "k_proj": "q_proj, k_proj, v_proj", "gate_proj": "gate_proj, up_proj"}


def _check_tiles(model_path: Path, recipe: Recipe, trust_remote_code: bool) -> None:
    """Block-quantized weights (FP8_BLOCK) and activations quantized in groups along the input dim
    that the model's layers cannot be cut into: vLLM would refuse to load them, or fail at the
    first request (per-token-group quantization needs whole groups), so say so before any work."""
    preset = _preset(recipe.scheme)
    block = preset.weights.block_structure if preset.weights else None
    act_group = preset.input_activations.group_size if preset.input_activations else None
    if not block and not act_group:
        return
    dims = linear_dims(model_path, recipe.ignore, trust_remote_code)
    fused = {n: out for n, (_, out) in dims.items() if n.rsplit(".", 1)[-1] in FUSED_NOT_LAST and block and out % block[0]}
    if fused:
        layers = ", ".join(f"{n} ({out} rows)" for n, out in sorted(fused.items()))
        groups = sorted({FUSED_NOT_LAST[n.rsplit(".", 1)[-1]] for n in fused})
        raise QserveError(
            f"{recipe.scheme}'s {block[0]}x{block[1]} blocks do not fit {layers}: vLLM fuses "
            f"{' and '.join(groups)} into one GEMM and needs every part but the last to be a multiple of "
            f"{block[0]} rows; add the whole fused group to ignore in the recipe"
        )
    split = {n: d_in for n, (d_in, _) in dims.items() if act_group and d_in % act_group}
    if split:
        layers = ", ".join(f"{n} (input dim {d})" for n, d in sorted(split.items()))
        raise QserveError(
            f"{recipe.scheme} quantizes activations in groups of {act_group} along the input dim, which does not "
            f"divide {layers}; add these layers to ignore in the recipe"
        )


def _preset(scheme: str) -> Any:
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(SCHEMES[scheme].backends.get("llmcompressor", scheme), ["Linear"])


def _preset_group_size(scheme: str) -> int | None:
    return _preset(scheme).weights.group_size


def linear_input_dims(model_path: Path, ignore: list[str], trust_remote_code: bool = False) -> dict[str, int]:
    """Input dims of the Linear layers a recipe quantizes, keyed by name with layer numbers as '*'."""
    return {name: d_in for name, (d_in, _) in linear_dims(model_path, ignore, trust_remote_code).items()}


def linear_dims(model_path: Path, ignore: list[str], trust_remote_code: bool = False) -> dict[str, tuple[int, int]]:
    """(input, output) dims of the Linear layers a recipe quantizes, keyed by name with layer numbers as '*'."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    dims: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not is_ignored(name, ignore):
            key = re.sub(r"\.\d+\.", ".*.", name)
            dims[key] = (module.in_features, module.out_features)
    return dims


def is_ignored(name: str, ignore: list[str]) -> bool:
    for pattern in ignore:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False
