"""The model card (the checkpoint's README.md) and the gate table it shares with the eval reports."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from qserve.checkpoint.manifest import CARD_NAME, Manifest
from qserve.gate.decisions import Gate
from qserve.gate.schema import EvalRecord, Waiver
from qserve.paths import write_text
from qserve.schemes.backends import backend_writing

__all__ = [
    "CARD_NAME",
    "front_matter",
    "gate_rows",
    "md_table",
    "model_card",
    "text_table",
    "vllm_serve_command",
    "write_card",
]


def gate_rows(gates: list[Gate]) -> list[tuple[str, ...]]:
    rows = [("task", "metric", "n", "baseline", "quantized", "recovery", "degradation", "allowed", "status")]
    for g in gates:
        rows.append(
            (
                g.task,
                g.metric + ("" if g.higher_is_better else " (lower is better)"),
                str(g.items or "?"),
                _with_err(g.baseline, g.baseline_stderr),
                _with_err(g.quantized, g.quantized_stderr),
                "n/a" if g.recovery is None else f"{g.recovery:.3f}",
                _with_err(g.degradation, g.degradation_stderr),
                "n/a" if g.allowed_degradation is None else f"{g.allowed_degradation:.4g}",
                g.status.upper(),
            )
        )
    return rows


def write_card(ckpt: Path, manifest: Manifest, record: EvalRecord | None, named: Path | None = None) -> None:
    """The one writer of the card: at quantize (no record; `named` is the final directory it is built
    for), after each eval, and when a waiver joins the record. Not hashed, so rewriting it never
    changes the checkpoint's identity."""
    write_text(ckpt / CARD_NAME, model_card(named or ckpt, manifest, record))


def model_card(ckpt: Path, manifest: Manifest, summary: EvalRecord | None) -> str:
    """README.md for the checkpoint: what it is, how it was made, how it scored, how to serve it."""
    r = manifest.recipe
    calib = manifest.calibration or {}
    lines = front_matter(ckpt, manifest, summary) + [
        f"# {ckpt.resolve().name}",
        "",
        f"{manifest.source_model['id']} quantized to **{manifest.scheme}** by qserve (recipe `{r.name}`: {r.description or r.scheme}).",
        "",
        "## How it was made",
        "",
        f"- Source model: {manifest.source_model['id']}",
        f"- Recipe: `{manifest.recipe_source.get('path')}` (sha256 {manifest.recipe_source.get('sha256', '')[:16]}...)",
        f"- Calibration: {_calibration_line(calib)}",
        f"- Libraries: {', '.join(f'{k} {v}' for k, v in sorted(manifest.versions.items()))}",
        f"- Quantization took {manifest.timings.get('quantize_seconds', '?')} s; peak memory {manifest.timings.get('peak_rss_mib', '?')} MiB",
        "",
        "## Accuracy",
        "",
    ]
    if summary is None:
        lines += ["Not evaluated yet: run `qserve eval` on this directory.", ""]
    else:
        parity = summary.parity.status if summary.parity else "not run"
        lines += [f"Gate verdict: **{summary.verdict.upper()}** (decided {summary.decided_at}; engine parity {parity})", ""]
        lines += md_table(gate_rows(summary.gates)) + [""]
        lines += [_waiver_line(w) for w in summary.waivers or []]
        if summary.emulated:
            lines += ["Scores are **emulated** (transformers), not from vLLM.", ""]
        if summary.outside_runs:  # whoever reads the card sees the scores are not qserve's own runs
            runs = f"{summary.outside_runs.baseline.results} and {summary.outside_runs.quantized.results}"
            lines += [f"Scores come from lm-eval runs made outside qserve: {runs}.", ""]
    lines += [
        "## Serve",
        "",
        "```bash",
        shlex.join(vllm_serve_command(ckpt, manifest)),
        "```",
        "",
        f"or, with the accuracy gate and integrity checks: `qserve serve {ckpt}`.",
        "",
    ]
    return "\n".join(lines)


def front_matter(ckpt: Path, manifest: Manifest, summary: EvalRecord | None) -> list[str]:
    """The Hugging Face model-card metadata block: base model, library, tags, quantization, and the
    gate's results in the model-index form (what the hub and its tools read)."""
    import yaml

    args = manifest.vllm_args
    source = str(manifest.source_model.get("id", ""))
    meta: dict[str, Any] = {}
    if _hub_id(source):
        meta |= {"base_model": source, "base_model_relation": "quantized"}
    made_by = backend_writing(args.quantization)
    meta["library_name"] = "transformers"
    meta["tags"] = ["qserve", "quantized", manifest.scheme.lower(), args.quantization or "unquantized"]
    meta["tags"] += [made_by.label.lower()] * bool(made_by) + ["vllm"]
    meta["quantization"] = {
        "scheme": manifest.scheme,
        "recipe": manifest.recipe.name,
        "vllm_quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "dtype": args.dtype,
    }
    if summary is not None and summary.gates:
        meta["model-index"] = [{"name": ckpt.resolve().name, "results": [_result(g, summary.emulated) for g in summary.gates]}]
    return ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", ""]


def _hub_id(name: str) -> bool:
    """`org/model` as the hub names it, not a local path."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and not Path(name).exists()


def _result(gate: Gate, emulated: bool) -> dict[str, Any]:
    metric = gate.metric.split(",")[0]
    where = "emulated in transformers" if emulated else "vLLM"
    name = f"{metric} ({where}; baseline {gate.baseline:.4g}; gate {gate.status} on {gate.items} items)"
    return {
        "task": {"type": "text-generation"},
        "dataset": {"name": gate.task, "type": gate.task},
        "metrics": [{"type": metric, "value": gate.quantized, "name": name, "verified": False}],
    }


def _waiver_line(waiver: Waiver) -> str:
    how = f"`qserve {waiver.accepted_by} {waiver.override}`, policy of {waiver.policy}"
    return f"**Gate below its policy, accepted by the operator** ({how}): {'; '.join(waiver.differences)}.\n"


def vllm_serve_command(ckpt: Path, manifest: Manifest) -> list[str]:
    args = manifest.vllm_args
    cmd = ["vllm", "serve", str(ckpt.resolve())]
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    cmd += ["--kv-cache-dtype", args.kv_cache_dtype, "--dtype", args.dtype]
    if args.trust_remote_code:
        cmd.append("--trust-remote-code")
    return cmd


def _calibration_line(calib: dict) -> str:
    if not calib:
        return "none (data-free)"
    origins = " + ".join(f"{s['samples']} from {_origin(s)}" for s in calib.get("sources", []))
    return f"{calib.get('samples')} samples of {calib.get('seq_len')} tokens: {origins} (seed {calib.get('seed')}, texts sha256 {str(calib.get('content_sha256', ''))[:16]}...)"


def _origin(source: dict) -> str:
    if source.get("kind") == "generate":
        return "text the model generated itself"
    return f"`{source.get('path') or source.get('dataset')}`"


def text_table(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as aligned terminal lines, the header underlined."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def md_table(rows: list[tuple[str, ...]]) -> list[str]:
    head, *body = rows
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]


def _with_err(value: float, err: float | None) -> str:
    return f"{value:.4g}" + (f" ± {err:.2g}" if err else "")
