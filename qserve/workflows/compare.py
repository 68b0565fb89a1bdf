"""`qserve compare`: several recipes side by side: accuracy recovery, size, decode speed.

Each recipe goes through the chain `qserve run` uses (workflows/run.py: its checkpoint reused by the
same rule, the libraries' output in its logs), gated against the shared cached baseline, and its decode throughput is
measured on the same vLLM engine the gate used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qserve.checkpoint.manifest import read_manifest
from qserve.device import detect
from qserve.engines import throughput
from qserve.engines import vllm as engine
from qserve.evaluate.evaluation import EvalOptions, plan_tasks
from qserve.gate.schema import EvalRecord
from qserve.models.sources import baseline_model
from qserve.spec.recipe import load_recipe
from qserve.workflows.inspection import inspect_checkpoint
from qserve.workflows.run import checkpoint_for, evaluate_logged

RESULT_NAME = "compare.json"
PLOT_NAME = "compare.png"


def check_before_work(recipes: list[Path], tasks: list[str] | None, data_dir: str | Path | None) -> None:
    """Every recipe, and the eval's tasks, gates and data for each, before anything is converted or written."""
    for recipe_path in recipes:
        recipe, _ = load_recipe(recipe_path)
        plan_tasks(recipe.gates, EvalOptions(tasks=tasks, data_dir=data_dir))


def compare(
    recipes: list[str | Path],
    model: str | None = None,
    tasks: list[str] | None = None,
    limit: int | None = None,
    data_dir: str | Path | None = None,
    out_dir: str | Path = "compare",
) -> dict[str, Any]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for recipe_path in recipes:
        loaded = load_recipe(recipe_path)
        name = loaded[0].name
        ckpt = checkpoint_for(Path(recipe_path), model, out / f"out-{name}", data_dir and Path(data_dir), loaded=loaded)
        options = EvalOptions(tasks=tasks, limit=limit, data_dir=data_dir, measure_decode=True)
        rows.append(_row(name, ckpt.path, evaluate_logged(ckpt, options)))
    result = {
        "baseline": _baseline_row(out / f"out-{load_recipe(recipes[0])[0].name}"),
        "recipes": rows,
        "tasks": tasks,
        "limit": limit,
    }
    (out / RESULT_NAME).write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / PLOT_NAME)
    result["files"] = {"json": str(out / RESULT_NAME), "plot": str(out / PLOT_NAME)}
    return result


def _row(name: str, ckpt: Path, record: EvalRecord) -> dict[str, Any]:
    facts = inspect_checkpoint(ckpt)
    return {
        "recipe": name,
        "checkpoint": str(ckpt),
        "scheme": record.scheme,
        "verdict": record.verdict,
        "emulated": record.emulated,
        "gates": [
            {"task": g.task, "metric": g.metric, "recovery": g.recovery, "degradation": g.degradation, "status": g.status}
            for g in record.gates
        ],
        "parity": record.parity.status if record.parity else None,
        "size_bytes": facts["size_bytes"],
        "size_vs_bf16": facts["size_vs_bf16"],
        # None when emulated: transformers' speed says nothing about serving
        "decode_tokens_per_second": (record.decode or {}).get("tokens_per_second"),
    }


def _baseline_row(any_ckpt: Path) -> dict[str, Any]:
    """The source model's decode speed in vLLM, measured now on this machine (never cached)."""
    manifest = read_manifest(any_ckpt)
    ref = baseline_model(manifest)
    device = detect.detect_device()
    args = engine.baseline_args(device, manifest.vllm_args.trust_remote_code)
    with engine.open_engine(ref.path, args, device, f"the baseline {manifest.source_model['id']} (decode speed)") as lm:
        decode, dtype = throughput.decode_throughput(lm), engine.resolved_dtype(lm)
    facts = inspect_checkpoint(any_ckpt)
    return {
        "model": ref.id,
        "dtype": dtype,
        "bf16_size_bytes": facts["bf16_size_bytes"],
        "decode_tokens_per_second": decode["tokens_per_second"],
    }


def headline(row: dict[str, Any]) -> dict[str, Any] | None:
    """The first gate with a defined recovery: the number the plot and table lead with."""
    return next((g for g in row["gates"] if g["recovery"] is not None), None)


def _speed(tps: float | None, base_tps: float) -> tuple[str, str]:
    return ("n/a", "n/a") if tps is None else (f"{tps:.0f}", f"{tps / base_tps:.2f}")


def format_compare(result: dict[str, Any]) -> str:
    base = result["baseline"]
    rows = [("recipe", "scheme", "size MiB", "vs bf16", "headline recovery", "verdict", "parity", "decode tok/s", "vs baseline")]
    rows.append(
        (
            "baseline",
            base["dtype"],
            f"{base['bf16_size_bytes'] / 2**20:.0f} (bf16)",
            "1.00",
            "1.000",
            "-",
            "-",
            f"{base['decode_tokens_per_second']:.0f}",
            "1.00",
        )
    )
    for r in result["recipes"]:
        h = headline(r)
        rows.append(
            (
                r["recipe"],
                r["scheme"],
                f"{r['size_bytes'] / 2**20:.0f}",
                f"{r['size_vs_bf16']:.2f}",
                f"{h['recovery']:.3f} ({h['task']})" if h else "n/a",
                r["verdict"].upper() + (" (emulated)" if r["emulated"] else ""),
                r["parity"],
                *_speed(r["decode_tokens_per_second"], base["decode_tokens_per_second"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + [f"plot: {result['files']['plot']}  json: {result['files']['json']}"])


def plot(result: dict[str, Any], path: Path) -> None:
    """Recovery against size (relative to bf16); each point labelled with its decode speed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = result["baseline"]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.scatter([1.0], [1.0], s=120, color="grey", marker="s", zorder=3)
    ax.annotate(
        f"baseline\n{base['decode_tokens_per_second']:.0f} tok/s",
        (1.0, 1.0),
        textcoords="offset points",
        xytext=(-10, 10),
        ha="right",
        fontsize=8,
    )
    colours = {"pass": "tab:green", "fail": "tab:red", "inconclusive": "tab:orange"}
    for r in result["recipes"]:
        h = headline(r)
        if h is None:
            continue
        ax.scatter([r["size_vs_bf16"]], [h["recovery"]], s=120, color=colours.get(r["verdict"], "tab:blue"), zorder=3)
        speed = "emulated" if r["decode_tokens_per_second"] is None else f"{r['decode_tokens_per_second']:.0f} tok/s"
        label = f"{r['recipe']} ({r['verdict']})\n{speed}"
        ax.annotate(label, (r["size_vs_bf16"], h["recovery"]), textcoords="offset points", xytext=(8, -4), fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xlabel("checkpoint size relative to bf16 baseline")
    ax.set_ylabel("recovery on the headline gated task")
    ax.set_title(f"{base['model']}: accuracy vs size (label: vLLM decode throughput)", fontsize=9)
    ax.set_xlim(0, 1.15)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
