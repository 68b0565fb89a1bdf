"""The search: candidates built from the sensitivity ranking, each quantized with the recipe's own
algorithm, loaded in vLLM and gated like any checkpoint; the smallest (or fastest) that passes wins.

Candidate k puts the first k layer groups in the smaller scheme and the rest in the recipe's
scheme, in order of least KL per parameter (per byte saved). Accuracy falls (roughly) monotonically with k, so the search gallops up from a
predicted k (the summed KL of the first k groups within half the gate's log-allowance) and then
bisects between the largest k that passed and the smallest that failed, until the two meet or the
budget (candidates, minutes) runs out.

The search scores every candidate on the same items and keeps the best: the best of k looks better
than it is (the winner's curse), so its search record is not a gate (serve refuses it). The winner
is then evaluated on the next `limit` items, which no candidate was chosen on; that confirmation is
its gate record, and only a confirmed winner's recipe is written.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from qserve import paths
from qserve.errors import InvalidSpec, QserveError
from qserve.progress import info
from qserve.schemes.catalog import SCHEMES, mix_name
from qserve.spec.gates import DEFAULT_MIN_RECOVERY
from qserve.spec.recipe import Recipe, load_recipe
from qserve.tune import report
from qserve.tune.groups import LayerGroup, targets


@dataclass
class Budget:
    candidates: int = 8
    minutes: float = 15.0
    started: float = field(default_factory=time.monotonic)

    def allows(self, tried: int, seconds_each: float) -> bool:
        """Room for one more candidate, judged by the mean cost of those tried so far."""
        spent = time.monotonic() - self.started
        return tried < self.candidates and spent + seconds_each <= self.minutes * 60


@dataclass
class TuneOptions:
    """What `qserve tune` is asked (its defaults). `low`: the scheme the least sensitive layer groups
    move to (default: the one a runnable mix pairs with the recipe's); `objective`: bytes or
    throughput; `out_dir`: default tune-<recipe name>."""

    model: str | None = None
    tasks: list[str] | None = None
    limit: int | None = None
    data_dir: str | Path | None = None
    out_dir: str | Path | None = None
    low: str | None = None
    group_size: int | None = None
    objective: str = "bytes"
    budget: Budget = field(default_factory=Budget)
    sensitivity_only: bool = False


def smaller_scheme(recipe: Recipe, low: str | None, kind: str) -> str:
    """The scheme the least sensitive groups move to: `low`, or the one a runnable mix pairs with the recipe's."""
    from qserve.support.claims import support_for

    if recipe.backend != "llmcompressor" or recipe.scheme is None or recipe.overrides or recipe.kv_cache or recipe.sparsity:
        raise InvalidSpec("qserve tune starts from an llm-compressor recipe with one scheme (no overrides, kv_cache or sparsity)")
    runnable = [
        n for n in SCHEMES if "+" in n and recipe.scheme in n.split("+") and support_for("compressed-tensors", n, kind).runs
    ]
    partners = [p for n in runnable for p in n.split("+") if p != recipe.scheme]
    if low is not None:
        low = low.upper()
        if low not in partners:
            raise InvalidSpec(
                f"mixing {recipe.scheme} with {low} was never seen to run in vLLM here; runnable partners: {', '.join(partners) or 'none'}"
            )
        return low
    if not partners:
        raise InvalidSpec(f"no per-layer mix with {recipe.scheme} is known to run in vLLM on this device")
    return min(partners, key=lambda p: SCHEMES[p].weight_bits)


def min_recovery(recipe: Recipe, tasks: list[str] | None) -> float:
    """The tightest min_recovery among the gates the tune decides by (0.95 when none is given)."""
    specs = [s for t, gs in recipe.gates.items() if tasks is None or t in tasks for s in gs]
    values = [s.min_recovery for s in specs if s.min_recovery is not None]
    return min(values) if values else DEFAULT_MIN_RECOVERY


def predicted_k(kls: list[float], recovery: float) -> int:
    """The largest k whose summed KL stays within half the gate's log-allowance (at least 1)."""
    allowance = math.log(1 / recovery) / 2
    total, k = 0.0, 0
    for kl in kls:
        total += kl
        if total > allowance:
            break
        k += 1
    return max(1, k)


def candidate_recipe(base: Path, name: str, low: str, group_size: int | None, chosen: list[LayerGroup]) -> dict[str, Any]:
    """The base recipe file's own fields, renamed, with the chosen groups as one override."""
    data = yaml.safe_load(base.read_text())
    data.pop("output", None)
    data["name"] = name
    data["description"] = (
        f"{data.get('description') or data['name']}; {len(chosen)} layer groups with the least KL per parameter in {low} (qserve tune)"
    )
    if chosen:
        override: dict[str, Any] = {"scheme": low, "targets": targets(chosen)}
        if group_size is not None:
            override["group_size"] = group_size
        data["overrides"] = [override]
    return data


def search_order(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Least harm per parameter moved first: an MLP group frees three times an attention group's
    bytes, so at equal KL it goes first (the greedy order for a knapsack of bytes under a KL budget)."""
    return sorted(groups, key=lambda g: (g["kl"] / g["params"], g["group"]))


def next_k(lo: int, hi: int, n: int) -> int:
    """Gallop up (double) while no failure is known, then bisect."""
    return min(n, 2 * max(lo, 1)) if hi > n else (lo + hi) // 2


def run_candidate(recipe_file: Path, out: Path, k: int, options: TuneOptions) -> dict[str, Any]:
    """Quantize one candidate and gate it in vLLM, through the chain `qserve run` uses (its reuse rule:
    a candidate a stopped search already made is taken as it is); its row for the Pareto table."""
    from qserve.checkpoint.tensors import quantized_layer_bytes
    from qserve.evaluate.evaluation import EvalOptions
    from qserve.workflows.inspection import inspect_checkpoint
    from qserve.workflows.run import checkpoint_for, evaluate_logged

    start = time.monotonic()
    name = recipe_file.stem
    made = checkpoint_for(
        recipe_file, options.model, out / name, Path(options.data_dir) if options.data_dir else None, remember=False
    )
    ckpt = made.path
    asked = EvalOptions(options.tasks, options.limit, data_dir=options.data_dir, measure_decode=True, purpose="tune search")
    record = evaluate_logged(made, asked)
    gate = record.gates[0]
    return {
        "name": name,
        "k": k,
        "recipe": str(recipe_file),
        "checkpoint": str(ckpt),
        "verdict": record.verdict,
        "task": gate.task,
        "recovery": gate.recovery,
        "bounds": gate.bounds,
        "parity": record.parity.status if record.parity else None,
        "layer_bytes_vs_bf16": quantized_layer_bytes(ckpt)["ratio"],
        "size_vs_bf16": inspect_checkpoint(ckpt)["size_vs_bf16"],
        "decode_tokens_per_second": (record.decode or {}).get("tokens_per_second"),
        "seconds": round(time.monotonic() - start, 1),
    }


def tune(recipe_path: str | Path, options: TuneOptions | None = None) -> dict[str, Any]:
    """Sensitivity, then the search; writes sensitivity.*, pareto.* and the winner's recipe into `out_dir`."""
    from qserve.device.detect import detect_device

    options = options or TuneOptions()
    if options.objective not in ("bytes", "throughput"):
        raise InvalidSpec(f"objective must be bytes or throughput, not {options.objective!r}")
    if not options.limit and not options.sensitivity_only:  # the options' own mistakes before the device's
        raise InvalidSpec(
            "qserve tune needs --limit: the winner is confirmed on the next --limit items, held out from the search"
        )
    recipe, _ = load_recipe(recipe_path)
    low = smaller_scheme(recipe, options.low, detect_device().kind)
    out = Path(options.out_dir or f"tune-{recipe.name}")
    out.mkdir(parents=True, exist_ok=True)
    ranking, files = _sensitivity(recipe, options, low, out)
    result: dict[str, Any] = {
        "recipe": str(recipe_path),
        "schemes": [low, recipe.scheme],
        "mix": mix_name([low, recipe.scheme]),
        "group_size": ranking["group_size"],
        "sensitivity": files,
    }
    if options.sensitivity_only:
        return result | {"files": files}
    search = _Search(Path(recipe_path), recipe, low, ranking["group_size"], options, out)
    return _finish(result | search.run(ranking), recipe, options, out)


def _sensitivity(recipe: Recipe, options: TuneOptions, low: str, out: Path) -> tuple[dict[str, Any], dict[str, str]]:
    from qserve.models.sources import resolve_model
    from qserve.quantize.calibration import load_texts
    from qserve.quantize.pipeline import CANDIDATE_GROUP_SIZES, linear_input_dims, with_default_calibration
    from qserve.tune import sensitivity

    recipe = with_default_calibration(recipe)
    model, data_dir, group_size = options.model, options.data_dir, options.group_size
    ref = resolve_model(model or recipe.model)
    if group_size is None and SCHEMES[low].group_quantized:
        dims = linear_input_dims(ref.path, recipe.ignore).values()
        fits = [g for g in CANDIDATE_GROUP_SIZES if g <= 128 and all(d % g == 0 for d in dims)]
        if not fits:
            raise QserveError(f"no group size in {CANDIDATE_GROUP_SIZES} divides every layer's input dim; pass --group-size")
        group_size = max(fits)
    if recipe.calibration is None:
        raise QserveError(sensitivity.NEEDS_CALIBRATION)
    calibration, _ = load_texts(recipe.calibration, paths.data_dir(data_dir), ref.path)
    held_out = sensitivity.held_out_texts(recipe, data_dir, ref.path, calibration)
    ranking = sensitivity.measure(ref.path, recipe, low, group_size, held_out)
    return ranking, report.write_sensitivity(ranking, out)


@dataclass(frozen=True)
class _Search:
    """One search: the recipe it starts from, the smaller scheme, and where candidates go."""

    base: Path
    recipe: Recipe
    low: str
    group_size: int | None
    options: TuneOptions
    out: Path

    def run(self, ranking: dict[str, Any]) -> dict[str, Any]:
        """Gallop from the predicted k, then bisect; the rows of every candidate tried."""
        recipe, budget = self.recipe, self.options.budget
        modules = _group_modules(self.options.model or recipe.model, recipe.ignore)
        ranked = search_order(ranking["groups"])
        order = [LayerGroup(g["block"], g["kind"], modules[g["group"]], g["params"]) for g in ranked]
        n, recovery = len(order), min_recovery(recipe, self.options.tasks)
        k0 = predicted_k([g["kl"] for g in ranked], recovery)
        info(
            f"search: {n} layer groups; predicted start k={k0} (summed KL within half of log(1/{recovery})); budget "
            f"{budget.candidates} candidates, {budget.minutes:g} min"
        )
        rows: dict[int, dict[str, Any]] = {}
        lo, hi, k = 0, n + 1, k0
        stopped = "the passing and failing candidates met"
        while k not in rows:
            mean = sum(r["seconds"] for r in rows.values()) / len(rows) if rows else 0.0
            if not budget.allows(len(rows), mean):
                stopped = "budget reached"
                break
            info(
                f"candidate {len(rows) + 1}: k={k} ({k}/{n} groups in {self.low}); so far: passes up to "
                f"k={lo if lo in rows else '?'}, fails from k={hi if hi <= n else '?'}"
            )
            rows[k] = self.try_k(order, k)
            lo, hi = (k, hi) if rows[k]["verdict"] == "pass" else (lo, k)
            if hi - lo <= 1:
                break
            k = next_k(lo, hi, n)
        if not any(r["verdict"] == "pass" for r in rows.values()) and 0 not in rows and budget.allows(len(rows), 0):
            info(f"no mix passed; trying the recipe's own uniform {recipe.scheme} (k=0)")
            rows[0] = self.try_k(order, 0)
        return {
            "groups": n,
            "order": [g.name for g in order],
            "predicted_k": k0,
            "min_recovery": recovery,
            "candidates": list(rows.values()),
            "stopped": stopped,
        }

    def try_k(self, order: list[LayerGroup], k: int) -> dict[str, Any]:
        """Candidate k: the first k groups in the smaller scheme, quantized and gated."""
        name = f"{self.recipe.name}-{self.low.lower()}-k{k:02d}"
        recipe_file = self.out / "candidates" / f"{name}.yaml"
        recipe_file.parent.mkdir(parents=True, exist_ok=True)
        candidate = candidate_recipe(self.base, name, self.low, self.group_size, order[:k])
        recipe_file.write_text(yaml.safe_dump(candidate, sort_keys=False))
        row = run_candidate(recipe_file, self.out / "candidates", k, self.options)
        info(
            f"candidate k={k}: {row['verdict'].upper()}, recovery {row['recovery']:.4f}, "
            f"quantized-layer bytes {row['layer_bytes_vs_bf16']:.3f}x bf16 ({row['seconds']:.0f}s)"
        )
        return row


def _confirm(best: dict[str, Any], tasks: list[str] | None, limit: int | None, data_dir: Any) -> dict[str, Any]:
    """The search's best, gated on the `limit` items after those the search chose it on."""
    from qserve.evaluate.evaluation import EvalOptions
    from qserve.workflows.run import evaluate_logged

    info(f"confirming {best['name']} on held-out items {limit}-{2 * limit - 1} (the search chose it on items 0-{limit - 1})")
    record = evaluate_logged(Path(best["checkpoint"]), EvalOptions(tasks=tasks, limit=limit, data_dir=data_dir, offset=limit))
    gate = record.gates[0]
    info(f"confirmation: {record.verdict.upper()}, recovery {gate.recovery:.4f} on items {limit}-{2 * limit - 1}")
    return {
        "verdict": record.verdict,
        "recovery": gate.recovery,
        "bounds": gate.bounds,
        "items": f"{limit}-{2 * limit - 1}",
        "look": record.look.number if record.look else None,
    }


def _group_modules(model: str | None, ignore: list[str]) -> dict[str, tuple[str, ...]]:
    """Layer names per group, from the model's structure (meta device: no weights loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from qserve.models.sources import resolve_model
    from qserve.tune.groups import layer_groups

    path = resolve_model(model).path
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return {g.name: g.modules for g in layer_groups(skeleton, ignore)}


def _finish(result: dict[str, Any], recipe: Recipe, options: TuneOptions, out: Path) -> dict[str, Any]:
    """Confirm the best on held-out items; copy the confirmed winner's recipe next to the tables, write them."""
    tasks, limit, data_dir, objective = options.tasks, options.limit, options.data_dir, options.objective
    passed = [r for r in result["candidates"] if r["verdict"] == "pass"]
    key = (lambda r: r["layer_bytes_vs_bf16"]) if objective == "bytes" else (lambda r: -(r["decode_tokens_per_second"] or 0))
    best = min(passed, key=key) if passed else None
    result["confirmation"] = _confirm(best, tasks, limit, data_dir) if best else None
    winner = best if best and result["confirmation"]["verdict"] == "pass" else None
    others = [r for r in result["candidates"] if r["verdict"] != "pass"]
    result |= {
        "tasks": tasks,
        "limit": limit,
        "objective": objective,
        "winner": winner,
        "closest": max(others, key=lambda r: r["recovery"]) if others and not winner else None,
        "gate": f"recovery >= {result['min_recovery']} at the one-sided 95 % bound",
    }
    if best and not winner:
        info(f"the search's best, {best['name']}, did not pass on held-out items: no recipe written")
    if winner:
        result["recipe_file"] = str(out / f"{recipe.name}-tuned.yaml")
        shutil.copyfile(winner["recipe"], result["recipe_file"])  # the same bytes: the same recipe hash
        paths.remember_checkpoint(Path(winner["checkpoint"]))
    result["files"] = report.write_pareto(result, out) | {"sensitivity": result["sensitivity"]["markdown"]}
    return result
