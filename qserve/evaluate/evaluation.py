"""`qserve eval`: lm-eval on the checkpoint and on its baseline in vLLM, then accuracy gates."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qserve import paths
from qserve.checkpoint import signing
from qserve.checkpoint.hashing import model_digest
from qserve.checkpoint.manifest import ITEMS_NAME, Manifest, VllmArgs, library_versions, manifest_digest, read_manifest
from qserve.checkpoint.opened import Checkpoint, open_checkpoint
from qserve.device import detect
from qserve.engines import flags, kv_scales, throughput
from qserve.engines import vllm as engine
from qserve.errors import QserveError
from qserve.evaluate import baselines, fallback, parity
from qserve.evaluate.lm_eval_run import EngineRun, Subject, Window, join, prompting, run_fields, run_lm_eval, unjoinable
from qserve.evaluate.tasks import Resolved, Task, dataset_copies, datasets_dir, lm_eval_config, resolve_tasks
from qserve.gate import looks, reports
from qserve.gate.core import Group, decide_gates, gated_metrics
from qserve.gate.decisions import Gate, Status, verdict
from qserve.gate.order import GROUPS, ORDER
from qserve.gate.records import read_eval, resolve_checkpoint
from qserve.gate.schema import EvalRecord
from qserve.models.sources import ModelRef, baseline_model
from qserve.progress import info, step
from qserve.schemes.catalog import SCHEMES, transformers_dtype
from qserve.spec.gates import GateSpec, check_allowance, default_gate
from qserve.spec.lm_eval_args import LmEvalArgs
from qserve.support import claims as support


@dataclass(frozen=True)
class EvalOptions:
    """What an eval is asked (the defaults are `qserve eval`'s).

    `kv_cache_dtype`, if given, must match the checkpoint; with `verify_key`, the checkpoint must
    carry a signature by it over exactly its files. `parallel`: vLLM parallelism for both engines
    (tensor_parallel_size, pipeline_parallel_size, data_parallel_size (through Ray, as lm-eval runs
    it), distributed_executor_backend). `offset`: evaluate items offset .. offset + limit (held-out
    items, as `qserve tune` confirms on). `purpose` "gate" counts as a look at these weights
    (looks.py); "tune search" does not, and serve refuses it. `include_path`: a folder of lm-eval task
    YAMLs (lm-eval's --include_path); `datasets`: local copies of hub datasets as DIR/<org>/<name>
    (default $QSERVE_DATASETS_DIR). `lm_eval`: lm-eval's evaluation options for both models, over the
    recipe's eval section.
    """

    tasks: list[str] | None = None
    limit: int | None = None
    gates: dict[str, list[GateSpec]] | None = None
    data_dir: str | Path | None = None
    refresh_baseline: bool = False
    check_parity: bool = True
    measure_decode: bool = False
    kv_cache_dtype: str | None = None
    verify_key: Path | None = None
    parallel: dict[str, Any] | None = None
    offset: int = 0
    purpose: str = "gate"
    include_path: Path | None = None
    datasets: str | Path | None = None
    lm_eval: LmEvalArgs = LmEvalArgs()


@dataclass
class _Plan:
    """What one eval decides on: the checkpoint, its tasks and gates, and which engine runs them."""

    ckpt: Path
    manifest: Manifest
    tasks: list[Task]
    specs: dict[str, list[GateSpec]]
    configs: dict[str, dict]
    device: detect.Device
    runnable: support.Support
    source: tuple[Path, str] | None = None  # Checkpoint.source: read already in this command
    datasets: dict[str, dict] | None = None  # task -> the local dataset copy it read (tasks.dataset_copies)
    lm_eval: LmEvalArgs = LmEvalArgs()  # the command line's over the recipe's, checked
    groups: dict[str, Group] = field(default_factory=dict)  # lm-eval groups gated over their tasks' pooled items

    @property
    def emulated(self) -> bool:
        return not self.runnable.runs


@dataclass
class _Baseline:
    """The unquantized reference: its model, engine arguments and cache entries."""

    model: ModelRef
    args: VllmArgs
    kwargs: dict[str, Any]
    sha256: str
    keys: dict[str, dict]
    cached: dict[str, dict]


@dataclass(frozen=True)
class Scored:
    """What an eval of the first `upto` items of each task's seeded order scored, for a later round to
    continue from (`evaluate_round`): both models' runs, joinable (lm_eval_run.join)."""

    quant: EngineRun
    base: EngineRun
    upto: int

    def unjoinable(self) -> str | None:
        return unjoinable(self.quant) or unjoinable(self.base)


def evaluate(checkpoint: str | Path | Checkpoint | None = None, options: EvalOptions | None = None) -> EvalRecord:
    """Evaluate a checkpoint against its (cached) baseline, apply the gates, write the reports; returns
    the record written (qserve_eval.json).

    Where vLLM cannot run the scheme on this device, both sides go through transformers and
    the record says `emulated: true`.
    """
    return evaluate_round(checkpoint, options)[0]


def evaluate_round(
    checkpoint: str | Path | Checkpoint | None = None, options: EvalOptions | None = None, earlier: Scored | None = None
) -> tuple[EvalRecord, Scored]:
    """`evaluate`, and what it scored. With `earlier` (a `Scored` of this checkpoint and these options'
    first `earlier.upto` items), only the items after them up to options.limit are scored, each model on
    one engine, and joined with them: the record is that of `--limit` options.limit. Without it, the
    checkpoint's record of a smaller --limit of the same request is continued so (`stored`)."""
    options = options or EvalOptions()
    plan = _plan(checkpoint, options)
    window = Window.select(options.limit, options.offset, list(plan.configs.values()), plan.groups)
    earlier = earlier or stored(plan, options, window)
    scoring, block = _with_items(plan, window), window
    if earlier is not None:
        scoring, block = _after(plan, window, earlier.upto)
    started = time.monotonic()
    base_side = _baseline_side(scoring, block, options.refresh_baseline)
    quant, parity_result, extra = _quantized_run(scoring, block, options)
    base = _baseline_run(scoring, base_side, block)
    if earlier is not None:
        same_prompting(quant.raw, base.raw)  # this block's prompts, before they join the earlier ones
        quant, base = join(earlier.quant, quant), join(earlier.base, base)
    prompted = same_prompting(quant.raw, base.raw)
    for task in (t for t in plan.tasks if t.name in base.raw.get("results", {})):
        baselines.check_sane(plan.manifest.source_model["id"], task.name, task.metric, base.score(task.name, task.metric)[0])
    look = _look(plan, options)
    decided = decide_gates(
        plan.specs, {t.name: t.metric for t in plan.tasks}, base, quant, look["level"], plan.groups, window.sizes, window.counts
    )
    final = verdict(decided)
    if "fail" in (parity_result["status"], extra["kv_cache"]["status"]):
        final = Status.FAIL
    outcome = _Outcome(quant, base, decided, final, parity_result, extra)
    summary = _summary(plan, base_side, outcome, options)
    summary |= {
        "offset": options.offset,
        "order": _order(options, plan),
        "purpose": options.purpose,
        "look": look,
        "request": _request(plan, options),
    }
    summary["prompting"] = prompted
    summary["timings"]["total_seconds"] = round(time.monotonic() - started, 2)
    if options.purpose == "gate":
        entry = {key: summary[key] for key in ("decided_at", "tasks", "limit", "offset", "order")} | {
            "verdict": final,
            "level": look["level"],
        }
        if look["counted"]:
            looks.record(plan.manifest, entry)
        look["history"] = looks.chained(look["earlier"], *([entry] if look["counted"] else []))
    if options.limit is not None and not options.offset:
        summary["items_sha256"] = _write_items(plan.ckpt, quant, base)
    record = EvalRecord.model_validate(summary)  # a record that fails its schema is a qserve bug
    reports.write_all(plan.ckpt, plan.manifest, record, {"quantized": quant.raw, "baseline": base.raw})
    return record, Scored(quant, base, options.limit or 0)


def _write_items(ckpt: Path, quant: EngineRun, base: EngineRun) -> str:
    """Both runs and their per-item values beside the record (ITEMS_NAME), before it: the record names
    them by sha256, so a later --limit continues only from the file this record was decided on."""
    text = json.dumps(
        {
            side: {"raw": run.raw, "items": run.items, "seconds": run.seconds}
            for side, run in (("quantized", quant), ("baseline", base))
        }
    )
    paths.write_text(ckpt / ITEMS_NAME, text)
    return hashlib.sha256(text.encode()).hexdigest()


def stored(plan: _Plan, options: EvalOptions, window: Window) -> Scored | None:
    """What the checkpoint's record scored, when a --limit from the first item continues it: a record of a
    smaller --limit of this same request (everything but the limit equal: tasks, data, gates, lm-eval
    options, device, scoring) on this manifest, whose items file is the one it names, and a task with items
    after them; None otherwise, or with --refresh-baseline (everything scored afresh)."""
    if window.limit is None or window.offset or options.refresh_baseline:
        return None
    record = _continuable(plan, options)
    if record is None or not (upto := record.limit or 0) < window.limit:
        return None
    if not window.block(upto).scored():
        return None
    path = plan.ckpt / ITEMS_NAME
    text = path.read_text() if path.is_file() else ""
    if hashlib.sha256(text.encode()).hexdigest() != record.items_sha256:
        info(f"note: {path.name} is not the one the record of --limit {upto} names; every item is scored again")
        return None
    runs = json.loads(text)
    scored = Scored(*(EngineRun(runs[s]["raw"], runs[s]["items"], runs[s]["seconds"]) for s in ("quantized", "baseline")), upto)
    if scored.unjoinable():
        return None  # its scores do not follow from its items (lm_eval_run.unjoinable): scored whole
    info(f"continuing the record of --limit {upto}: items {upto}-{window.limit - 1} of each task scored now")
    return scored


def continuable(checkpoint: str | Path | Checkpoint, options: EvalOptions) -> EvalRecord | None:
    """The checkpoint's record when a larger --limit of `options` would continue it (`stored`), else None."""
    return _continuable(_plan(checkpoint, options), options)


def _continuable(plan: _Plan, options: EvalOptions) -> EvalRecord | None:
    """The checkpoint's record of a --limit from the first item, with its items file named, on this manifest
    and this request but for the limit."""
    try:
        record = read_eval(plan.ckpt)
    except QserveError:
        return None  # a corrupt record: _look says so
    if record is None or record.items_sha256 is None or record.offset or not record.limit:
        return None
    if record.manifest_sha256 != manifest_digest(plan.ckpt):
        return None
    return record if record.request == _request(plan, replace(options, limit=record.limit)) else None


def _after(plan: _Plan, window: Window, upto: int) -> tuple[_Plan, Window]:
    """The plan and window that score each task's items from `upto` to the window's limit, leaving out
    the tasks with none left."""
    if window.limit is None or window.offset or not 0 < upto < window.limit:
        raise ValueError(f"a later round scores items {upto} on of a --limit above them from the first, not {window.key()}")
    block = window.block(upto)
    if not block.scored():
        raise ValueError(f"every task has at most {upto} items: a later round would score nothing")
    return _with_items(plan, block), block


def _with_items(plan: _Plan, window: Window) -> _Plan:
    """The plan of the tasks with items in `window` (a group's pooled order may leave a task none)."""
    scored = window.scored()
    return plan if scored is None else replace(plan, configs={n: c for n, c in plan.configs.items() if n in scored})


@dataclass
class _Outcome:
    """What the two engine runs and the gates gave."""

    quant: EngineRun
    base: EngineRun
    decided: list[Gate]
    final: Status
    parity: dict[str, Any]
    extra: dict[str, Any]


def _look(plan: _Plan, options: EvalOptions) -> dict[str, Any]:
    """Which look at these weights this decision is, and the level it spends (looks.py): the same
    items as an earlier look are that look again."""
    if options.purpose != "gate":
        return {"number": None, "level": looks.level(1), "earlier": [], "counted": False}
    earlier = looks.earlier(plan.manifest, _travelled_history(plan))
    scored = {
        "tasks": [t.name for t in plan.tasks],
        "limit": options.limit,
        "offset": options.offset,
        "order": _order(options, plan),
    }
    number, new = looks.number(earlier, scored)
    if earlier:
        again = "" if new else f", the same items as look {number}: decided again at its level"
        info(
            f"note: look {number} at these weights ({len(earlier)} earlier gate runs{again}): bounds at one-sided {1 - looks.level(number):.2%}"
        )
    return {
        "number": number,
        "level": looks.level(number),
        "earlier": earlier,
        "counted": new,
        "weights": looks.weights_key(plan.manifest),
    }


def _order(options: EvalOptions, plan: _Plan) -> str | None:
    """How the items were picked: qserve's seeded order when limited (gate/order.ORDER, and GROUPS where
    a group's tasks take a prefix of its pooled order), None for all."""
    if options.limit is None:
        return None
    return f"{ORDER}; {GROUPS}" if plan.groups else ORDER


def _doc_ids(plan: _Plan, quant: EngineRun, base: EngineRun) -> dict[str, list[int]]:
    """Per task, lm-eval's ids of the documents both models scored on the headline metric: the sample a --limit picked."""
    scored = {}
    for task in plan.tasks:
        sides = [set(run.items.get(task.name, {}).get(task.metric) or {}) for run in (quant, base)]
        scored[task.name] = sorted(int(i) for i in sides[0] & sides[1])
    return scored


def _travelled_history(plan: _Plan) -> list[dict[str, Any]]:
    """The looks the checkpoint's own record carries, when that record is of these weights."""
    from qserve.checkpoint.manifest import EVAL_NAME

    try:
        record = read_eval(plan.ckpt)
    except QserveError:
        raise QserveError(
            f"{plan.ckpt / EVAL_NAME} is corrupt, so the looks at these weights it records cannot be counted; "
            "remove it to evaluate again (the looks are then those of this cache's ledger)"
        ) from None
    look = record.look if record else None
    return look.history if look and look.weights == looks.weights_key(plan.manifest) else []


def reusable_eval(checkpoint: str | Path | Checkpoint, options: EvalOptions | None = None) -> EvalRecord | None:
    """The checkpoint's eval record if re-running this eval would decide the same question: bound
    to the current manifest (files verified), same tasks, task configs and data contents, limit,
    gates and parity. None otherwise (or when there is no record)."""
    options = options or EvalOptions()
    path = checkpoint.path if isinstance(checkpoint, Checkpoint) else Path(checkpoint)
    record = read_eval(path)
    if record is None or record.manifest_sha256 != manifest_digest(path):
        return None
    plan = _plan(checkpoint, options)
    return record if record.request == _request(plan, options) else None


def _request(plan: _Plan, options: EvalOptions) -> dict[str, Any]:
    """What an eval was asked to decide, and how it scores; equal requests on the same manifest decide
    the same thing."""
    return baselines.stable(
        {
            "tasks": [t.name for t in plan.tasks],
            **({"groups": {n: asdict(g) for n, g in plan.groups.items()}} if plan.groups else {}),
            "task_configs": {n: baselines.with_data_hashes(c) for n, c in plan.configs.items()},
            "limit": options.limit,
            **({"offset": options.offset} if options.offset else {}),
            **({"order": _order(options, plan)} if options.limit is not None else {}),
            "gates": {n: [s.model_dump() for s in specs] for n, specs in plan.specs.items()},
            "parity": options.check_parity,
            "lm_eval": plan.lm_eval.resolved(),  # simple_evaluate's keywords, the same on both models
            "device": detect.fingerprint(plan.device),
            "scoring": _scoring(plan),  # by name and source hash: another way of scoring is another measurement
            **({"datasets": plan.datasets} if plan.datasets else {}),  # which local copies, by path and file hashes
        }
    )


def _plan(checkpoint: str | Path | Checkpoint | None, options: EvalOptions) -> _Plan:
    """Checks before any engine starts: integrity (unless the checkpoint was opened already), flags,
    tasks and their gates, the device."""
    given = checkpoint if isinstance(checkpoint, Checkpoint) else resolve_checkpoint(checkpoint)
    recipe = given.manifest.recipe if isinstance(given, Checkpoint) else read_manifest(given).recipe
    lm_eval = plan_lm_eval(recipe.lm_eval, options)  # before the files are hashed
    device = detect.detect_device().with_parallel(options.parallel)
    engine.check_data_parallel(device)
    opened = open_checkpoint(given)
    ckpt, manifest = opened.path, opened.manifest
    if options.verify_key is not None:
        signing.verify(ckpt, options.verify_key)
    flags.check_user_args(ckpt, manifest, {"--kv-cache-dtype": options.kv_cache_dtype})
    resolved, specs, configs = plan_tasks(manifest.recipe.gates, options)
    task_defs = resolved.tasks
    _note_fixed_zero_shot(lm_eval, configs)
    support.check_dtype(manifest, device.kind, device.detail)
    runnable = support.vllm_support(manifest, device.kind)
    if not runnable.runs:
        info(
            f"vLLM cannot run {manifest.scheme} here ({runnable.evidence}): evaluating through transformers; results are EMULATED"
        )
    copies = dataset_copies(task_defs, configs)
    return _Plan(ckpt, manifest, task_defs, specs, configs, device, runnable, opened.source, copies, lm_eval, resolved.groups)


def plan_lm_eval(recipe_eval: LmEvalArgs, options: EvalOptions) -> LmEvalArgs:
    """lm-eval's options for both models: the command line's over the recipe's eval section, checked
    together before any work (the recipe's own were checked when it was parsed)."""
    merged = options.lm_eval.over(recipe_eval)
    merged.check()
    return merged


def _note_fixed_zero_shot(args: LmEvalArgs, configs: dict[str, dict]) -> None:
    """lm-eval keeps a task its config makes 0-shot at 0 whatever num_fewshot says (simple_evaluate): say so."""
    fixed = [n for n, c in configs.items() if c.get("num_fewshot") == 0]
    if args.num_fewshot and fixed:
        info(f"note: {', '.join(fixed)} stay 0-shot: lm-eval ignores --num-fewshot for tasks whose config sets 0")


def same_prompting(quant: dict[str, Any], base: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """lm-eval's own account of how it prompted each model; refused unless equal, since the gate compares the
    two models on the same prompts."""
    sides = {"quantized": prompting(quant), "baseline": prompting(base)}
    differ = [k for k, v in sides["quantized"].items() if v != sides["baseline"][k]]
    if differ:
        raise QserveError(
            f"lm-eval prompted the quantized model and the baseline differently ({', '.join(differ)} differ in its "
            "results); their scores do not compare, so nothing was gated"
        )
    return sides


def plan_tasks(
    recipe_gates: dict[str, list[GateSpec]], options: EvalOptions
) -> tuple[Resolved, dict[str, list[GateSpec]], dict[str, dict[str, Any]]]:
    """The tasks an eval runs (and the groups over them), each gated unit's gates, each task's lm-eval
    config: every check that needs no model (task names, --gate against the tasks, allowances the metric
    can exceed, data files), so that `qserve run` makes them before it quantizes. Gated by default: each
    group and task named; a --gate may also name a task inside a group."""
    gates = options.gates or {}
    datasets = datasets_dir(options.datasets)
    resolved = resolve_tasks(options.tasks or list(recipe_gates) or ["gsm8k"], options.include_path, datasets)
    headlines = {t.name: t.metric for t in resolved.tasks} | {n: g.metric for n, g in resolved.groups.items()}
    _check_gated_tasks(gates, resolved)
    units = list(dict.fromkeys(resolved.units + [t for t in gates if t not in resolved.units]))
    specs = {u: gates.get(u) or recipe_gates.get(u) or default_gate() for u in units}
    for unit, spec in ((u, s) for u, unit_specs in specs.items() for s in unit_specs):
        for metric in gated_metrics(unit, spec.metric, headlines, resolved.groups):
            check_allowance(unit, spec, metric)
    root = paths.data_dir(options.data_dir)
    return resolved, specs, {t.name: lm_eval_config(t, root, datasets) for t in resolved.tasks}


def _check_gated_tasks(gates: dict[str, list[GateSpec]], resolved: Resolved) -> None:
    """A --gate must name an evaluated task or group: a gate on a task that never runs would be silently ignored."""
    evaluated = {t.name for t in resolved.tasks} | set(resolved.groups)
    stray = [t for t in gates if t not in evaluated]
    if stray:
        inside = len(evaluated) - len(resolved.units)
        raise QserveError(
            f"--gate names {', '.join(stray)}, which this eval does not run (tasks: {', '.join(resolved.units)}"
            + (f", and {inside} tasks inside its groups" if inside > 0 else "")
            + "); add it to --tasks or drop the gate"
        )


def _baseline_side(plan: _Plan, window: Window, refresh: bool) -> _Baseline:
    """The baseline's model, engine arguments and cache keys; cached scores unless `refresh`."""
    model = baseline_model(plan.manifest)
    trc = plan.manifest.vllm_args.trust_remote_code
    args = engine.baseline_args(plan.device, trc)
    if plan.source and plan.source[0].resolve() == model.path.resolve():
        sha = plan.source[1]  # this command read the model already (quantize or the reuse check)
    else:
        with step("hashing the baseline model for the baseline cache"):
            sha = model_digest(model.path)
    if plan.emulated:
        kwargs = fallback.lm_kwargs(model.path, None, trc)
    else:
        kwargs = engine.engine_kwargs(model.path, args, plan.device)
    device, scoring = detect.fingerprint(plan.device), _scoring(plan)
    asked = plan.lm_eval.resolved()
    keys = {
        n: baselines.task_key(sha, cfg, window.key(n), kwargs, device, scoring=scoring, lm_eval=asked)
        for n, cfg in plan.configs.items()
    }
    cached = {} if refresh else {n: e for n, k in keys.items() if (e := baselines.lookup(k))}
    return _Baseline(model, args, kwargs, sha, keys, cached)


def _scoring(plan: _Plan) -> Callable[[], type] | None:
    """What makes the lm-eval model class that scores: qserve's on vLLM; lm-eval's own HFLM when emulated."""
    return None if plan.emulated else engine.lm_eval_vllm_class


def _summary(plan: _Plan, base_side: _Baseline, outcome: _Outcome, options: EvalOptions) -> dict[str, Any]:
    """The eval record (qserve_eval.json): every report and `qserve serve` read it."""
    manifest, trc = plan.manifest, plan.manifest.vllm_args.trust_remote_code
    quant, base = outcome.quant, outcome.base
    quantized_args = (
        fallback.lm_kwargs(plan.ckpt, manifest.vllm_args.quantization, trc) if plan.emulated else manifest.vllm_args.model_dump()
    )
    return {
        "checkpoint": str(plan.ckpt.resolve()),
        "manifest_sha256": manifest_digest(plan.ckpt),
        "decided_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "verdict": outcome.final,
        "gates": [asdict(g) for g in outcome.decided],
        "parity": outcome.parity,
        "kv_cache": outcome.extra["kv_cache"],
        "emulated": plan.emulated,  # true: scores come from transformers, not vLLM
        "engine": "transformers" if plan.emulated else "vllm",
        "scoring": baselines.stable(_scoring(plan)),  # by name and source hash, as in the baseline cache key
        "vllm_support": asdict(plan.runnable),
        "decode": outcome.extra["decode"],
        "scheme": manifest.scheme,
        "recipe": manifest.recipe.name,
        "tasks": [t.name for t in plan.tasks],
        "groups": plan.groups or None,
        "limit": options.limit,
        "doc_ids": _doc_ids(plan, quant, base) if options.limit is not None else None,
        "n_samples": {n: (quant.raw.get("n-samples") or {}).get(n) for n in plan.configs},
        "device": asdict(plan.device),
        "engine_args": {
            "quantized": quantized_args,
            "baseline": base_side.kwargs if plan.emulated else base_side.args.model_dump(),
        },
        "baseline_model": {"id": manifest.source_model["id"], "path": str(base_side.model.path), "sha256": base_side.sha256},
        "baseline_cache": {
            "hits": sorted(base_side.cached),
            "misses": sorted(set(base_side.keys) - set(base_side.cached)),
            "refresh": options.refresh_baseline,
        },
        "versions": manifest.versions | {"lm-eval": library_versions()["lm-eval"]},
        "timings": {"quantized_eval_seconds": quant.seconds, "baseline_eval_seconds": base.seconds},
    }


def _quantized_run(plan: _Plan, window: Window, options: EvalOptions) -> tuple[EngineRun, dict[str, Any], dict[str, Any]]:
    """lm-eval on the checkpoint, plus what shares its vLLM engine: parity, decode speed, KV scales."""
    ckpt, manifest, emulated, check_parity = plan.ckpt, plan.manifest, plan.emulated, options.check_parity

    def on_engine(lm: Any) -> dict[str, Any]:
        if not engine.in_process(lm):
            why = "data parallel: lm-eval runs each replica as a Ray task, so no engine is in this process to read"
            return {"generations": None, "decode": None, "kv_cache": _skipped(why), "not_in_process": why}
        return {
            "generations": parity.vllm_generations(lm) if check_parity else None,
            "decode": throughput.decode_throughput(lm) if options.measure_decode else None,
            "kv_cache": kv_scales.check_kv_cache(
                kv_scales.kv_scales(lm), manifest.vllm_args.kv_cache_dtype, kv_scales.engine_cache_dtype(lm)
            ),
        }

    label = "the quantized checkpoint"
    configs = list(plan.configs.values())
    subject = Subject(ckpt, manifest.vllm_args, label, emulated)
    quant = run_lm_eval(subject, plan.device, configs, window, None if emulated else on_engine, plan.lm_eval)
    extra = quant.extra or {"generations": None, "decode": None, "kv_cache": _skipped("emulated: no vLLM engine")}
    if emulated:
        parity_result = _skipped("emulated: vLLM cannot run this scheme here, so there is no engine to compare")
    elif "not_in_process" in extra:
        parity_result = _skipped(extra.pop("not_in_process"))
    elif check_parity:
        parity_result = _parity(ckpt, manifest, extra["generations"])
    else:
        parity_result = _skipped("--no-parity")
    if extra["kv_cache"]["status"] == "fail":
        info(f"KV CACHE CHECK FAILED: {extra['kv_cache']['reason']}")
    return quant, parity_result, extra


def _skipped(reason: str) -> dict[str, str]:
    return {"status": "skipped", "reason": reason}


def _parity(ckpt: Path, manifest: Manifest, generations: list) -> dict[str, Any]:
    tolerance = parity.tolerance_for(SCHEMES[manifest.scheme].activations, manifest.vllm_args.kv_cache_dtype)
    baseline = baseline_model(manifest).path  # for the screening KL beside the gate
    dtype = transformers_dtype(manifest.scheme, manifest.vllm_args.quantization)
    with step(f"engine parity: transformers ({dtype}) teacher-forced on vLLM's greedy tokens") as timing:
        trust = manifest.vllm_args.trust_remote_code
        result = parity.compare_with_transformers(ckpt, generations, tolerance, trust, baseline, dtype)
    result["seconds"] = timing["seconds"]
    if result["status"] == "fail":
        info(f"ENGINE PARITY FAILED: vLLM and transformers disagree on this checkpoint ({result['reason']})")
    return result


def _baseline_run(plan: _Plan, side: _Baseline, window: Window) -> EngineRun:
    """Cached tasks from the cache; the rest through one baseline engine, then stored."""
    configs, keys, cached = plan.configs, side.keys, side.cached
    label = f"the baseline {plan.manifest.source_model['id']}"
    for name in cached:
        info(f"baseline for {name}: cached ({baselines.entry_path(keys[name]).name})")
    missing = [n for n in configs if n not in cached]
    run = EngineRun(raw={})
    if missing:
        todo = [configs[n] for n in missing]
        subject = Subject(side.model.path, side.args, label, plan.emulated)
        run = run_lm_eval(subject, plan.device, todo, window, options=plan.lm_eval)
        for name in missing:
            baselines.store(keys[name], _task_slice(run.raw, name), run.items.get(name, {}), run_fields(run.raw))
    for name, entry in cached.items():
        for section, values in entry["result"].items():
            run.raw.setdefault(section, {})[name] = values
        run.items[name] = entry["items"]
        _merge_run_fields(run.raw, entry.get("run") or {}, name)
    return run


def _merge_run_fields(raw: dict[str, Any], fields: dict[str, Any], task: str) -> None:
    """A cached task's run-wide lm-eval fields beside the others'; their keys hold the same options and
    model, so a difference is a damaged cache."""
    for key, value in fields.items():
        if raw.setdefault(key, value) != value:
            raise QserveError(
                f"the cached baseline for {task} says lm-eval ran with another {key} than the rest of the baseline; "
                "pass --refresh-baseline"
            )


def _task_slice(raw: dict, task: str) -> dict:
    return {section: values[task] for section, values in raw.items() if isinstance(values, dict) and task in values}
