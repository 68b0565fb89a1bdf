"""`qserve eval`: lm-eval on the checkpoint and on its baseline in vLLM, then accuracy gates."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qserve import baselines, engine, fallback, parity, paths, reports, stats, support
from qserve.errors import QserveError
from qserve.gates import DEFAULT_MIN_RECOVERY, Gate, GateSpec, decide, normalize, verdict
from qserve.manifest import EVAL_NAME, Manifest, VllmArgs, manifest_digest, read_manifest, verify_files
from qserve.models import ModelRef, resolve_model
from qserve.progress import info, step
from qserve.schemes import SCHEMES
from qserve.stats import ItemValues
from qserve.tasks import TaskDef, get_tasks, lm_eval_config


def resolve_checkpoint(checkpoint: str | Path | None) -> Path:
    """The given checkpoint, else the most recent output of `qserve quantize`."""
    if checkpoint is not None:
        return Path(checkpoint)
    marker = paths.last_checkpoint_file()
    if not marker.is_file():
        raise QserveError("no checkpoint given and no previous `qserve quantize` output found; pass CHECKPOINT")
    last = Path(marker.read_text().strip())
    if not last.is_dir():
        raise QserveError(f"the last `qserve quantize` output {last} no longer exists; pass CHECKPOINT")
    info(f"using the most recent checkpoint: {last}")
    return last


@dataclass
class EngineRun:
    """One engine's lm-eval output: results without per-sample logs, per-item values, timing."""

    raw: dict[str, Any]
    items: dict[str, dict[str, ItemValues]] = field(default_factory=dict)  # task -> metric -> items
    seconds: float = 0.0
    extra: Any = None


def evaluate(
    checkpoint: str | Path | None = None,
    tasks: list[str] | None = None,
    limit: int | None = None,
    gates: dict[str, list[GateSpec]] | None = None,
    data_dir: str | Path | None = None,
    refresh_baseline: bool = False,
    check_parity: bool = True,
    measure_decode: bool = False,
    kv_cache_dtype: str | None = None,
) -> dict[str, Any]:
    """Evaluate a checkpoint against its (cached) baseline, apply the gates, write the reports.

    Where vLLM cannot run the scheme on this device, both sides go through transformers and
    the summary says `emulated: true`. `kv_cache_dtype`, if given, must match the checkpoint.
    """
    ckpt = resolve_checkpoint(checkpoint)
    manifest = read_manifest(ckpt)
    verify_files(ckpt, manifest)
    support.check_user_args(ckpt, manifest, {"--kv-cache-dtype": kv_cache_dtype})
    recipe_gates = {t: normalize(v) for t, v in (manifest.recipe.get("gates") or {}).items()}
    task_defs = get_tasks(tasks or list(recipe_gates) or ["gsm8k"])
    specs = {
        t.name: (gates or {}).get(t.name) or recipe_gates.get(t.name) or [GateSpec(min_recovery=DEFAULT_MIN_RECOVERY)]
        for t in task_defs
    }
    root = paths.data_dir(data_dir)
    configs = {t.name: lm_eval_config(t, root) for t in task_defs}
    device = engine.detect_device()
    support.check_dtype(manifest, device.kind, device.detail)
    runnable = support.vllm_support(manifest, device.kind)
    emulated = not runnable.runs
    if emulated:
        info(
            f"vLLM cannot run {manifest.scheme} here ({runnable.evidence}): evaluating through transformers; results are EMULATED"
        )
    baseline = baseline_model(manifest)
    base_args = engine.baseline_args(device, manifest.vllm_args.trust_remote_code)
    trc = manifest.vllm_args.trust_remote_code

    started = time.monotonic()
    with step("hashing the baseline model for the baseline cache"):
        model_hash = baselines.model_digest(baseline.path)
    if emulated:
        base_kwargs = fallback.lm_kwargs(baseline.path, None, trc)
    else:
        base_kwargs = engine.engine_kwargs(baseline.path, base_args, device)
    keys = {n: baselines.task_key(model_hash, cfg, limit, base_kwargs, device.kind) for n, cfg in configs.items()}
    cached = {} if refresh_baseline else {n: e for n, k in keys.items() if (e := baselines.lookup(k))}

    quant, parity_result, extra = _quantized_run(
        ckpt, manifest, device, list(configs.values()), limit, emulated, check_parity, measure_decode
    )
    label = f"the baseline {manifest.source_model['id']}"
    base = _baseline_run(baseline.path, label, base_args, device, configs, limit, keys, cached, emulated)

    decided = [_decide(t, spec, base, quant) for t in task_defs for spec in specs[t.name]]
    final = verdict(decided)
    if "fail" in (parity_result["status"], extra["kv_cache"]["status"]):
        final = "fail"
    summary = {
        "checkpoint": str(ckpt.resolve()),
        "manifest_sha256": manifest_digest(ckpt),
        "decided_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "verdict": final,
        "gates": [asdict(g) for g in decided],
        "parity": parity_result,
        "kv_cache": extra["kv_cache"],
        "emulated": emulated,  # true: scores come from transformers, not vLLM
        "engine": "transformers" if emulated else "vllm",
        "vllm_support": asdict(runnable),
        "decode": extra["decode"],
        "scheme": manifest.scheme,
        "recipe": manifest.recipe.get("name"),
        "tasks": [t.name for t in task_defs],
        "limit": limit,
        "n_samples": {n: (quant.raw.get("n-samples") or {}).get(n) for n in configs},
        "device": asdict(device),
        "engine_args": {
            "quantized": fallback.lm_kwargs(ckpt, manifest.vllm_args.quantization, trc)
            if emulated
            else manifest.vllm_args.model_dump(),
            "baseline": base_kwargs if emulated else base_args.model_dump(),
        },
        "baseline_model": {"id": manifest.source_model["id"], "path": str(baseline.path), "sha256": model_hash},
        "baseline_cache": {"hits": sorted(cached), "misses": sorted(set(configs) - set(cached)), "refresh": refresh_baseline},
        "versions": manifest.versions | {"lm-eval": _version("lm-eval")},
        "timings": {
            "quantized_eval_seconds": quant.seconds,
            "baseline_eval_seconds": base.seconds,
            "total_seconds": round(time.monotonic() - started, 2),
        },
    }
    reports.write_all(ckpt, manifest, summary, {"quantized": quant.raw, "baseline": base.raw})
    return summary


def _quantized_run(
    ckpt: Path,
    manifest: Manifest,
    device: engine.Device,
    configs: list[dict],
    limit: int | None,
    emulated: bool,
    check_parity: bool,
    measure_decode: bool,
) -> tuple[EngineRun, dict[str, Any], dict[str, Any]]:
    """lm-eval on the checkpoint, plus what shares its vLLM engine: parity, decode speed, KV scales."""

    def on_engine(lm: Any) -> dict[str, Any]:
        return {
            "generations": parity.vllm_generations(lm) if check_parity else None,
            "decode": engine.decode_throughput(lm) if measure_decode else None,
            "kv_cache": engine.check_kv_scales(engine.kv_scales(lm), manifest.vllm_args.kv_cache_dtype),
        }

    label = "the quantized checkpoint"
    quant = run_lm_eval(ckpt, manifest.vllm_args, device, configs, limit, label, None if emulated else on_engine, emulated)
    extra = quant.extra or {"generations": None, "decode": None, "kv_cache": _skipped("emulated: no vLLM engine")}
    if emulated:
        parity_result = _skipped("emulated: vLLM cannot run this scheme here, so there is no engine to compare")
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
    with step("engine parity: transformers teacher-forced on vLLM's greedy tokens") as timing:
        result = parity.compare_with_transformers(ckpt, generations, tolerance, manifest.vllm_args.trust_remote_code)
    result["seconds"] = timing["seconds"]
    if result["status"] == "fail":
        info(f"ENGINE PARITY FAILED: vLLM and transformers disagree on this checkpoint ({result['reason']})")
    return result


def _baseline_run(
    model_path: Path,
    label: str,
    args: VllmArgs,
    device: engine.Device,
    configs: dict,
    limit: int | None,
    keys: dict,
    cached: dict,
    emulated: bool = False,
) -> EngineRun:
    """Cached tasks from the cache; the rest through one baseline engine, then stored."""
    for name in cached:
        info(f"baseline for {name}: cached ({baselines.entry_path(keys[name]).name})")
    missing = [n for n in configs if n not in cached]
    run = EngineRun(raw={})
    if missing:
        run = run_lm_eval(model_path, args, device, [configs[n] for n in missing], limit, label, emulated=emulated)
        for name in missing:
            baselines.store(keys[name], _task_slice(run.raw, name), run.items.get(name, {}))
    for name, entry in cached.items():
        for section, values in entry["result"].items():
            run.raw.setdefault(section, {})[name] = values
        run.items[name] = entry["items"]
    return run


def _task_slice(raw: dict, task: str) -> dict:
    return {section: values[task] for section, values in raw.items() if isinstance(values, dict) and task in values}


def _decide(task: TaskDef, spec: GateSpec, base: EngineRun, quant: EngineRun) -> Gate:
    metric = spec.metric or task.metric
    hib = task.higher_is_better if metric == task.metric else _higher_is_better(quant.raw, task.name, metric)
    cmp = stats.compare(metric, hib, _score(base, task.name, metric), _score(quant, task.name, metric))
    return decide(task.name, spec, cmp)


def _higher_is_better(raw: dict, task: str, metric: str) -> bool:
    return bool((raw.get("higher_is_better") or {}).get(task, {}).get(metric.partition(",")[0], True))


def baseline_model(manifest: Manifest) -> ModelRef:
    """The checkpoint's source model: where it was quantized from, else resolved again by id."""
    src = manifest.source_model
    return resolve_model(src["path"] if Path(src["path"]).is_dir() else src["id"])


def run_lm_eval(
    model_path: Path,
    args: VllmArgs,
    device: engine.Device,
    configs: list[dict],
    limit: int | None,
    label: str,
    during: Callable[[Any], Any] | None = None,
    emulated: bool = False,
) -> EngineRun:
    """All tasks through one vLLM engine (transformers if `emulated`); `during(lm)` runs on it before it stops."""
    import lm_eval

    names = [c["task"] for c in configs]
    if emulated:
        opened = fallback.open_transformers(model_path, args.quantization, label, args.trust_remote_code)
    else:
        opened = engine.open_engine(model_path, args, device, label)
    with opened as lm:
        with step(f"lm-eval on {label}: {', '.join(names)}" + (f" (limit {limit})" if limit else "")) as timing:
            out = lm_eval.simple_evaluate(model=lm, tasks=configs, limit=limit, log_samples=True, bootstrap_iters=1000)
        extra = during(lm) if during else None
    keep = ("results", "n-samples", "configs", "versions", "higher_is_better")
    raw = _jsonable({k: out[k] for k in keep if k in out})
    items = {n: _items(out.get("samples", {}).get(n, []), raw["results"].get(n, {})) for n in names}
    return EngineRun(raw, items, timing["seconds"], extra)


def _items(samples: list[dict], results: dict) -> dict[str, ItemValues]:
    keys = [k for k in results if "," in k and "_stderr" not in k]
    return {k: v for k in keys if (v := stats.item_values(samples, k))}


def _score(run: EngineRun, task: str, metric: str) -> tuple[float, float | None, ItemValues | None]:
    res = run.raw["results"].get(task, {})
    if metric not in res:
        raise QserveError(f"lm-eval returned no {metric!r} for {task}; it reported {', '.join(k for k in res if k != 'alias')}")
    name, _, filt = metric.partition(",")
    stderr = res.get(f"{name}_stderr,{filt}")
    return float(res[metric]), float(stderr) if isinstance(stderr, (int, float)) else None, run.items.get(task, {}).get(metric)


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def _version(name: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(name)


def read_eval(ckpt: Path) -> dict[str, Any] | None:
    path = ckpt / EVAL_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise QserveError(f"{path} is corrupt; run `qserve eval` again") from None
