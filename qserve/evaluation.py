"""`qserve eval`: lm-eval on the checkpoint and on its baseline in vLLM, then accuracy gates."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qserve import engine, paths
from qserve.errors import QserveError
from qserve.manifest import EVAL_NAME, Manifest, VllmArgs, manifest_digest, read_manifest, verify_files
from qserve.models import ModelRef, resolve_model
from qserve.progress import info, step
from qserve.tasks import TaskDef, get_tasks, lm_eval_config

DEFAULT_GATE = 0.95
LM_EVAL_RESULTS_NAME = "lm_eval_results.json"


@dataclass
class Gate:
    task: str
    metric: str
    higher_is_better: bool
    baseline: float
    baseline_stderr: float | None
    quantized: float
    quantized_stderr: float | None
    threshold: float  # minimum recovery
    recovery: float | None
    status: str  # "pass", "fail" or "inconclusive"
    reason: str


def recovery(baseline: float, quantized: float, higher_is_better: bool) -> float | None:
    """quantized/baseline for scores, baseline/quantized for losses; None when undefined."""
    num, den = (quantized, baseline) if higher_is_better else (baseline, quantized)
    if den == 0 or not (math.isfinite(num) and math.isfinite(den)):
        return None
    return num / den


def decide(task: TaskDef, base: tuple[float, float | None], quant: tuple[float, float | None], threshold: float) -> Gate:
    rec = recovery(base[0], quant[0], task.higher_is_better)
    if rec is None:
        status = "inconclusive"
        reason = f"baseline {task.metric} is {base[0]:g}: recovery is undefined, this gate says nothing"
    elif rec >= threshold:
        status, reason = "pass", f"recovery {rec:.3f} >= {threshold:g}"
    else:
        status, reason = "fail", f"recovery {rec:.3f} < {threshold:g}"
    return Gate(
        task.name, task.metric, task.higher_is_better, base[0], base[1], quant[0], quant[1], threshold, rec, status, reason
    )


def verdict(gates: list[Gate]) -> str:
    """fail if any gate fails; pass if at least one passes and none fails; else inconclusive."""
    statuses = {g.status for g in gates}
    if "fail" in statuses:
        return "fail"
    return "pass" if "pass" in statuses else "inconclusive"


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


def evaluate(
    checkpoint: str | Path | None = None,
    tasks: list[str] | None = None,
    limit: int | None = None,
    gates: dict[str, float] | None = None,
    data_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Evaluate a checkpoint and its baseline, apply the gates, write results into the checkpoint."""
    ckpt = resolve_checkpoint(checkpoint)
    manifest = read_manifest(ckpt)
    verify_files(ckpt, manifest)
    task_names = tasks or list(manifest.recipe.get("gates") or {}) or ["gsm8k"]
    task_defs = get_tasks(task_names)
    thresholds = {t: (gates or {}).get(t, manifest.recipe.get("gates", {}).get(t, DEFAULT_GATE)) for t in task_names}
    root = paths.data_dir(data_dir)
    configs = [lm_eval_config(t, root) for t in task_defs]
    device = engine.detect_device()
    engine.check_supported(manifest, device)
    baseline = baseline_model(manifest)

    started = time.monotonic()
    quant_raw, quant_secs = run_lm_eval(ckpt, manifest.vllm_args, device, configs, limit, "the quantized checkpoint")
    base_args = engine.baseline_args(device, manifest.vllm_args.trust_remote_code)
    base_raw, base_secs = run_lm_eval(
        baseline.path, base_args, device, configs, limit, f"the baseline {manifest.source_model['id']}"
    )

    decided = [decide(t, _score(base_raw, t), _score(quant_raw, t), thresholds[t.name]) for t in task_defs]
    summary = {
        "checkpoint": str(ckpt.resolve()),
        "manifest_sha256": manifest_digest(ckpt),
        "decided_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "verdict": verdict(decided),
        "gates": [asdict(g) for g in decided],
        "tasks": task_names,
        "limit": limit,
        "device": asdict(device),
        "engine_args": {"quantized": manifest.vllm_args.model_dump(), "baseline": base_args.model_dump()},
        "baseline_model": {"id": manifest.source_model["id"], "path": str(baseline.path)},
        "versions": manifest.versions | {"lm-eval": _version("lm-eval")},
        "timings": {
            "quantized_eval_seconds": quant_secs,
            "baseline_eval_seconds": base_secs,
            "total_seconds": round(time.monotonic() - started, 2),
        },
    }
    _write_json(ckpt / LM_EVAL_RESULTS_NAME, {"quantized": quant_raw, "baseline": base_raw})
    _write_json(ckpt / EVAL_NAME, summary)
    return summary


def baseline_model(manifest: Manifest) -> ModelRef:
    """The checkpoint's source model: where it was quantized from, else resolved again by id."""
    src = manifest.source_model
    return resolve_model(src["path"] if Path(src["path"]).is_dir() else src["id"])


def run_lm_eval(
    model_path: Path, args: VllmArgs, device: engine.Device, configs: list[dict], limit: int | None, label: str
) -> tuple[dict, float]:
    """All tasks through one vLLM engine; returns lm-eval's results (without per-sample logs)."""
    import lm_eval

    with engine.open_engine(model_path, args, device, label) as lm:
        with step(
            f"lm-eval on {label}: {', '.join(c['task'] for c in configs)}" + (f" (limit {limit})" if limit else "")
        ) as timing:
            out = lm_eval.simple_evaluate(model=lm, tasks=configs, limit=limit, log_samples=False, bootstrap_iters=1000)
    return _jsonable({k: out[k] for k in ("results", "n-samples", "configs", "versions") if k in out}), timing["seconds"]


def _score(raw: dict, task: TaskDef) -> tuple[float, float | None]:
    res = raw["results"].get(task.name, {})
    if task.metric not in res:
        raise QserveError(
            f"lm-eval returned no {task.metric!r} for {task.name}; it reported {', '.join(k for k in res if k != 'alias')}"
        )
    metric, _, filt = task.metric.partition(",")
    stderr = res.get(f"{metric}_stderr,{filt}")
    return float(res[task.metric]), float(stderr) if isinstance(stderr, (int, float)) else None


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


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


def format_table(summary: dict[str, Any]) -> str:
    rows = [("task", "metric", "baseline", "quantized", "recovery", "gate", "status")]
    for g in summary["gates"]:
        rows.append(
            (
                g["task"],
                g["metric"] + ("" if g["higher_is_better"] else " (lower is better)"),
                _with_err(g["baseline"], g["baseline_stderr"]),
                _with_err(g["quantized"], g["quantized_stderr"]),
                "n/a" if g["recovery"] is None else f"{g['recovery']:.3f}",
                f">= {g['threshold']:g}",
                g["status"].upper(),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = [f"  {g['task']}: {g['reason']}" for g in summary["gates"] if g["status"] == "inconclusive"]
    limit = f" on {summary['limit']} items per task" if summary.get("limit") else ""
    tail = [f"verdict: {summary['verdict'].upper()}{limit}"]
    return "\n".join(lines + (["inconclusive gates:"] + notes if notes else []) + tail)


def _with_err(value: float, err: float | None) -> str:
    return f"{value:.4g}" + (f" ± {err:.2g}" if err else "")
