"""Eval reports: lm-eval's raw JSON, qserve's summary JSON, a Markdown report and the model card.

All four are rendered from the same summary, so they cannot disagree; the summary is written
last because `serve` trusts it.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

from qserve.manifest import EVAL_NAME, LM_EVAL_RESULTS_NAME, Manifest

REPORT_NAME = "qserve_eval.md"
CARD_NAME = "README.md"


def write_all(ckpt: Path, manifest: Manifest, summary: dict[str, Any], raw: dict[str, Any]) -> None:
    write_json(ckpt / LM_EVAL_RESULTS_NAME, raw)
    write_text(ckpt / REPORT_NAME, markdown_report(summary))
    write_text(ckpt / CARD_NAME, model_card(ckpt, manifest, summary))
    write_json(ckpt / EVAL_NAME, summary)


def write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def write_text(path: Path, text: str) -> None:
    """Write through a temporary file so a crash never leaves half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # per process: concurrent writers never share one
    tmp.write_text(text)
    os.replace(tmp, path)


def gate_rows(summary: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = [("task", "metric", "baseline", "quantized", "recovery", "degradation", "allowed", "status")]
    for g in summary["gates"]:
        rows.append(
            (
                g["task"],
                g["metric"] + ("" if g["higher_is_better"] else " (lower is better)"),
                _with_err(g["baseline"], g["baseline_stderr"]),
                _with_err(g["quantized"], g["quantized_stderr"]),
                "n/a" if g["recovery"] is None else f"{g['recovery']:.3f}",
                _with_err(g["degradation"], g["degradation_stderr"]),
                "n/a" if g["allowed_degradation"] is None else f"{g['allowed_degradation']:.4g}",
                g["status"].upper(),
            )
        )
    return rows


def format_table(summary: dict[str, Any]) -> str:
    """The terminal view: the gate table, notes for anything not a clean pass, parity, verdict."""
    rows = gate_rows(summary)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [f"  {g['task']} {g['metric']}: {g['status']}: {g['reason']}" for g in summary["gates"]]
    lines.append(f"engine parity: {summary['parity']['status'].upper()}: {summary['parity'].get('reason', '')}")
    kv = summary.get("kv_cache") or {}
    if kv.get("status") not in (None, "skipped"):
        lines.append(f"kv cache ({kv['kv_cache_dtype']}): {kv['status'].upper()}: {kv['reason']}")
    cache = summary.get("baseline_cache", {})
    if cache.get("hits"):
        lines.append(f"baseline: cached for {', '.join(cache['hits'])} (--refresh-baseline re-runs it)")
    if summary.get("emulated"):
        lines.append("EMULATED: scores come from transformers, not vLLM")
    limit = f" on {summary['limit']} items per task" if summary.get("limit") else ""
    lines.append(f"verdict: {summary['verdict'].upper()}{limit}")
    return "\n".join(lines)


def markdown_report(summary: dict[str, Any]) -> str:
    p = summary["parity"]
    out = [
        f"# qserve eval: {Path(summary['checkpoint']).name}",
        "",
        f"**Verdict: {summary['verdict'].upper()}** (decided {summary['decided_at']}"
        + (f", {summary['limit']} items per task" if summary.get("limit") else "")
        + ")",
        "",
    ]
    if summary.get("emulated"):
        out += ["> **Emulated**: vLLM cannot run this scheme on this device; scores come from transformers.", ""]
    out += _md_table(gate_rows(summary)) + [""]
    out += [f"- {g['task']} / {g['metric']}: **{g['status']}**: {g['reason']}" for g in summary["gates"]] + [""]
    out += [
        "## Engine parity",
        "",
        f"**{p['status'].upper()}**: {p.get('reason', '')}",
        "",
    ]
    if "tolerance" in p:
        t = p["tolerance"]
        out += [
            f"vLLM's greedy tokens over {p['positions']} positions, teacher-forced through transformers: "
            f"greedy-token agreement {p['top1_agreement']:.1%} (minimum {t['min_top1_agreement']:.0%}), "
            f"mean |Δ logprob| of vLLM's top tokens {p['mean_abs_logprob_diff']:.4f} nats "
            f"(maximum allowed {t['max_mean_abs_logprob_diff']}; {t['why']}).",
            "",
        ]
    kv = summary.get("kv_cache") or {}
    if kv.get("status") not in (None, "skipped"):
        out += [
            "## KV cache",
            "",
            f"**{kv['status'].upper()}**: {kv['reason']} ({kv['kv_cache_dtype']}, {kv['layers']} attention layers; "
            f"k_scale {kv['k_scale'][0]:.4g}–{kv['k_scale'][1]:.4g}, v_scale {kv['v_scale'][0]:.4g}–{kv['v_scale'][1]:.4g}).",
            "",
        ]
    cache = summary["baseline_cache"]
    out += [
        "## Setup",
        "",
        f"- Scheme: {summary['scheme']} (recipe `{summary['recipe']}`)",
        f"- Device: {summary['device']['kind']} ({summary['device']['detail']})",
        f"- Quantized engine: `{json.dumps(summary['engine_args']['quantized'])}`",
        f"- Baseline: {summary['baseline_model']['id']}, engine `{json.dumps(summary['engine_args']['baseline'])}`; "
        f"cached for: {', '.join(cache['hits']) or 'none'}",
        f"- Versions: {', '.join(f'{k} {v}' for k, v in sorted(summary['versions'].items()))}",
        f"- Timings (s): {', '.join(f'{k} {v}' for k, v in summary['timings'].items())}",
        "",
        "Scores with ± are lm-eval's standard errors (bootstrap over items for perplexities). "
        "Degradation is how much worse the quantized model is, ± the paired standard error over the same items; "
        "a pass must clear the allowance at the one-sided 95% noise bound.",
        "",
    ]
    return "\n".join(out)


def model_card(ckpt: Path, manifest: Manifest, summary: dict[str, Any] | None) -> str:
    """README.md for the checkpoint: what it is, how it was made, how it scored, how to serve it."""
    r = manifest.recipe
    calib = manifest.calibration or {}
    lines = [
        f"# {ckpt.resolve().name}",
        "",
        f"{manifest.source_model['id']} quantized to **{manifest.scheme}** by qserve (recipe `{r.get('name')}`: {r.get('description') or r.get('scheme')}).",
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
        lines += [
            f"Gate verdict: **{summary['verdict'].upper()}** (decided {summary['decided_at']}; engine parity {summary['parity']['status']})",
            "",
        ]
        lines += _md_table(gate_rows(summary)) + [""]
        if summary.get("emulated"):
            lines += ["Scores are **emulated** (transformers), not from vLLM.", ""]
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


def _md_table(rows: list[tuple[str, ...]]) -> list[str]:
    head, *body = rows
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]


def _with_err(value: float, err: float | None) -> str:
    return f"{value:.4g}" + (f" ± {err:.2g}" if err else "")
