"""The steps as the CLI runs them, each with its library output in a log file, and `qserve run`'s reuse:
a step whose valid output exists is not redone."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qserve import paths
from qserve.checkpoint.manifest import MANIFEST_NAME, Manifest, library_versions, manifest_digest, read_manifest
from qserve.checkpoint.opened import Checkpoint, open_checkpoint
from qserve.errors import QserveError
from qserve.gate.order import FIRST_ROUND, rounds
from qserve.progress import info
from qserve.runtime.capture import library_output
from qserve.runtime.process import bounded_in_process_stop

if TYPE_CHECKING:
    from qserve.evaluate.evaluation import EvalOptions, Scored
    from qserve.gate.schema import EvalRecord
    from qserve.quantize.pipeline import QuantizeOptions
    from qserve.spec.recipe import Recipe


def quantize_logged(
    recipe: Path, options: QuantizeOptions | None = None, verbose: bool = False, gates_checked: bool = False
) -> Path:
    """`qserve quantize`: the libraries' output goes to CKPT/logs/quantize.log (the cache's logs/ on failure).
    `gates_checked`: the caller resolved the recipe's gated tasks already (`qserve run`, with its task folder)."""
    from qserve.evaluate.tasks import get_tasks
    from qserve.quantize.pipeline import quantize
    from qserve.spec.recipe import load_recipe

    log = paths.pending_log("quantize", os.getpid())
    with library_output(log, verbose):
        if not gates_checked:
            get_tasks(list(load_recipe(recipe)[0].gates))  # a gate on a task that does not exist, before any work
        result = quantize(recipe, options)
    paths.keep_log(log, result.output, "quantize")
    return result.output


def evaluate_logged(checkpoint: Path | Checkpoint | None, options: EvalOptions, verbose: bool = False) -> EvalRecord:
    """`qserve eval`: the libraries' output goes to CKPT/logs/eval.log; a signal stops it within a bound."""
    return _logged_round(checkpoint, options, verbose)[0]


def _logged_round(
    checkpoint: Path | Checkpoint | None, options: EvalOptions, verbose: bool, earlier: Scored | None = None
) -> tuple[EvalRecord, Scored]:
    from qserve.evaluate.evaluation import evaluate_round
    from qserve.gate.records import resolve_checkpoint

    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else resolve_checkpoint(checkpoint)
    where = ckpt.path if isinstance(ckpt, Checkpoint) else ckpt
    with library_output(paths.log_file(where, "eval"), verbose), bounded_in_process_stop():
        return evaluate_round(ckpt, options, earlier)


def evaluate_until_decided(
    checkpoint: Path | Checkpoint | None, options: EvalOptions, verbose: bool = False, first: int = FIRST_ROUND
) -> EvalRecord:
    """`qserve eval --until-decided`: rounds of `qserve eval --limit N` on growing prefixes of each task's
    seeded order (`rounds`; options.limit, if set, is the ceiling), stopping at the first round whose
    verdict is PASS or FAIL, or once every task is scored whole. A betting gate watched at every prefix of
    one order is one wealth process, so stopping at its first decision keeps its level (Ville's
    inequality); a round whose gates are not all such stops the loop, as a further look would spend
    level. Each round is one engine start per model and scores only the items after the last round's,
    joined with them (evaluation.evaluate_round); where lm-eval's scores do not follow from the items it
    logs (lm_eval_run.unjoinable), each round scores its whole prefix instead."""
    if options.offset:
        raise QserveError("--until-decided takes each task's seeded order from its first document; it cannot start at --offset")
    from qserve.gate.records import resolve_checkpoint

    # Opened once: its files are verified here, not again by every round.
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(resolve_checkpoint(checkpoint))
    earlier, whole = None, False
    recorded = _recorded_rounds(ckpt, options)
    for n in rounds(first, options.limit):
        if n <= recorded and n != options.limit:
            info(f"until decided: --limit {n}: in the checkpoint's record already (its --limit {recorded}, inconclusive)")
            continue
        info(
            f"until decided: --limit {n}"
            + (f" (items {earlier.upto}-{n - 1} scored now, the first {earlier.upto} carried)" if earlier else "")
        )
        record, scored = _logged_round(ckpt, replace(options, limit=n), verbose, earlier)
        if record.verdict in ("pass", "fail") or _scored_whole(record, n):
            return record
        if why := _not_free(record):
            info(f"until decided: stopping at --limit {n}: {why}")
            return record
        if not whole and earlier is None and (why := scored.unjoinable()):
            info(f"until decided: each round scores its whole prefix: {why}")
            whole = True
        earlier = None if whole else scored
    return record


def _recorded_rounds(checkpoint: Path | Checkpoint, options: EvalOptions) -> int:
    """The --limit of the checkpoint's record when --until-decided goes on after it: the same request but for
    the limit, INCONCLUSIVE, and every gate a bet over every look (so the rounds up to it were free and
    undecided); 0 otherwise. The next round continues its items (evaluation.stored)."""
    from qserve.evaluate.evaluation import continuable
    from qserve.gate.records import read_eval

    try:  # the record alone first: most checkpoints have none to go on from, and need no plan
        record = read_eval(checkpoint.path if isinstance(checkpoint, Checkpoint) else checkpoint)
    except QserveError:
        return 0  # a corrupt record: the eval says so
    if record is None or record.items_sha256 is None or record.verdict != "inconclusive" or _not_free(record):
        return 0
    return (record.limit or 0) if continuable(checkpoint, options) is not None else 0


def _scored_whole(record: EvalRecord, n: int) -> bool:
    """Every gated task had at most `n` documents: a larger --limit scores nothing new."""
    return all(g.evidence is not None and g.evidence["population"] <= n for g in record.gates)


def _not_free(record: EvalRecord) -> str | None:
    """Why another round would not be free: a gate decided otherwise than by betting at 5 % over every look."""
    from qserve.gate.decisions import EVERY_LOOK

    for g in record.gates:
        if not (g.test or "").endswith(EVERY_LOOK):
            return f"{g.task} {g.metric} is decided by {g.test or 'no test'}, whose level a further look would spend"
    return None


def checkpoint_for(
    recipe: Path,
    model: str | None = None,
    output: Path | None = None,
    data_dir: Path | None = None,
    trust_remote_code: bool = False,
    verbose: bool = False,
    loaded: tuple[Recipe, str] | None = None,
    remember: bool = True,
    reuse: bool = True,
) -> Checkpoint:
    """The chain's first step (`qserve run`, `compare`, the real-weights cells, the eval-throughput
    bench): the recipe's checkpoint, reused when it is still what this recipe, model, data and library
    versions would make, quantized (replacing a stale one) otherwise; opened once, for the steps after
    it. `loaded`: the recipe as the caller's before-work check parsed it (its gates checked);
    `remember`: record it as the last checkpoint made; `reuse`: False quantizes whatever is there (a
    timed cell)."""
    from qserve.quantize.pipeline import QuantizeOptions, default_output
    from qserve.spec.recipe import load_recipe

    checked = loaded is not None
    loaded = loaded or load_recipe(recipe)
    out = Path(output) if output else default_output(loaded[0])
    found = reusable_checkpoint(out, recipe, model, data_dir, trust_remote_code, loaded) if reuse else "asked to quantize anew"
    if isinstance(found, Checkpoint):
        info(f"reusing checkpoint {out}: same recipe, model, calibration data and libraries; files intact")
        if remember:
            paths.remember_checkpoint(out)
        return found
    info(f"quantizing: {found}")
    options = QuantizeOptions(model, out, data_dir, force=out.exists(), trust_remote_code=trust_remote_code, remember=remember)
    made = quantize_logged(recipe, options, verbose, gates_checked=checked)
    # Its manifest was just written from the bytes quantize hashed: opened without reading them again.
    manifest = read_manifest(made)
    return Checkpoint(made, manifest, manifest_digest(made), _source(manifest))


def _source(manifest: Manifest) -> tuple[Path, str] | None:
    """The source model's directory and the digest quantize recorded for it in this command."""
    from qserve.models.sources import baseline_model

    digest = (manifest.environment or {}).get("source_model_sha256")
    return (baseline_model(manifest).path, digest) if digest else None


def check_run_before_work(recipe: Path, options: EvalOptions) -> tuple[Recipe, str]:
    """`qserve run` quantizes, then evaluates, then serves: first, before any work, the recipe is parsed
    (once, for every step after), its scheme checked against what `qserve serve` serves on this device
    (support/claims.py), and the eval's checks that need no model made (tasks, gates, data, lm-eval's options)."""
    from qserve.evaluate.evaluation import plan_lm_eval, plan_tasks
    from qserve.spec.recipe import load_recipe

    parsed, sha = load_recipe(recipe)
    _check_servable_here(parsed)
    plan_tasks(parsed.gates, options)
    plan_lm_eval(parsed.lm_eval, options)
    return parsed, sha


def _check_servable_here(parsed: Recipe) -> None:
    from qserve.device import detect
    from qserve.schemes.backends import BACKENDS
    from qserve.support import claims as support

    if parsed.scheme is None:  # llm-compressor modifiers: the scheme is read from the export
        return
    kv = parsed.kv_cache.dtype if parsed.kv_cache else "auto"
    method = BACKENDS[parsed.backend].vllm_quantization
    claim = support.support_for(method, parsed.scheme, detect.detect_device().kind, kv_cache_dtype=kv)
    if not claim.serves:
        needs = f"; it needs {claim.needs}" if claim.needs else ""
        raise QserveError(
            f"{parsed.scheme} cannot be served on this machine ({claim.evidence}){needs}. "
            "`qserve quantize` and `qserve eval` still run it"
        )


def why_stale(out: Path, recipe: Path, model: str | None, data_dir: Path | None, trust_remote_code: bool) -> str | None:
    """Why the checkpoint at `out` is not this recipe's output (None: it is, and intact)."""
    found = reusable_checkpoint(out, recipe, model, data_dir, trust_remote_code)
    return None if isinstance(found, Checkpoint) else found


def reusable_checkpoint(
    out: Path,
    recipe: Path,
    model: str | None,
    data_dir: Path | None,
    trust_remote_code: bool,
    loaded: tuple[Recipe, str] | None = None,
) -> Checkpoint | str:
    """The checkpoint at `out`, opened, if it is this recipe's output and intact; else why not."""
    from qserve.checkpoint.hashing import model_digest
    from qserve.models.sources import resolve_model
    from qserve.quantize.pipeline import with_default_calibration
    from qserve.spec.recipe import load_recipe

    if not (out / MANIFEST_NAME).is_file():
        return f"no checkpoint at {out} yet"
    try:
        opened = open_checkpoint(out)
    except QserveError as exc:
        return f"{out} is not intact ({exc})"
    manifest = opened.manifest
    parsed, sha = loaded or load_recipe(recipe)
    parsed = with_default_calibration(parsed)
    ref = resolve_model(model or parsed.model)
    source_digest = model_digest(ref.path)
    changed = [
        what
        for what, same in (
            ("recipe file", manifest.recipe_source.get("sha256") == sha),
            ("source model", (manifest.environment or {}).get("source_model_sha256") == source_digest),
            ("--trust-remote-code", manifest.vllm_args.trust_remote_code == trust_remote_code),
            ("library versions", manifest.versions == library_versions()),
            ("calibration data", _same_calibration(manifest.calibration, parsed, data_dir, ref.path)),
        )
        if not same
    ]
    return (
        f"{out} was made with a different {', '.join(changed)}" if changed else replace(opened, source=(ref.path, source_digest))
    )


def _same_calibration(recorded: dict | None, recipe: Any, data_dir: Path | None, model_path: Path) -> bool:
    """Files and datasets are re-drawn and compared by content; generated text depends only on the
    model, seed and versions, which are compared already."""
    if recipe.calibration is None or recorded is None:
        return recipe.calibration is None and recorded is None
    if any(s.generate is not None for s in recipe.calibration.sources()):
        return True
    from qserve.quantize.calibration import load_texts

    _, record = load_texts(recipe.calibration, paths.data_dir(data_dir), model_path)
    return record.get("content_sha256") == recorded.get("content_sha256")


def gate_for(ckpt: Checkpoint, options: EvalOptions, verbose: bool = False) -> EvalRecord:
    """`qserve run`'s second step: the eval record when one decided exactly this question on these
    files (same tasks, data, limit, gates, parity, device), else a new eval."""
    from qserve.evaluate.evaluation import reusable_eval

    record = reusable_eval(ckpt, options)
    if record is not None:
        info(f"reusing the eval of {ckpt.path} decided {record.decided_at} (verdict: {record.verdict})")
        return record
    return evaluate_logged(ckpt, options, verbose)
