"""Eval reports: lm-eval's raw JSON, qserve's summary JSON, a Markdown report and the model card.

All four are rendered from the same summary, so they cannot disagree; the summary is written
last because `serve` trusts it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qserve.checkpoint.card import CARD_NAME, gate_rows, md_table, model_card, text_table
from qserve.checkpoint.manifest import LM_EVAL_RESULTS_NAME, REPORT_NAME, Manifest
from qserve.gate.records import write_eval, write_json, write_text


def write_all(ckpt: Path, manifest: Manifest, summary: dict[str, Any], raw: dict[str, Any]) -> None:
    write_json(ckpt / LM_EVAL_RESULTS_NAME, raw)
    write_text(ckpt / REPORT_NAME, markdown_report(summary))
    write_text(ckpt / CARD_NAME, model_card(ckpt, manifest, summary))
    write_eval(ckpt, summary)


def format_table(summary: dict[str, Any]) -> str:
    """The terminal view: the gate table, notes for anything not a clean pass, parity, verdict."""
    lines = text_table(gate_rows(summary))
    lines += [f"  {g['task']} {g['metric']}: {_status(g)}: {g['reason']}" for g in summary["gates"]]
    lines.append(f"engine parity: {summary['parity']['status'].upper()}: {summary['parity'].get('reason', '')}")
    if _kl_line(summary):
        lines.append(_kl_line(summary))
    kv = summary.get("kv_cache") or {}
    if kv.get("status") not in (None, "skipped"):
        lines.append(f"kv cache ({kv['kv_cache_dtype']}): {kv['status'].upper()}: {kv['reason']}")
    cache = summary.get("baseline_cache", {})
    if cache.get("hits"):
        lines.append(f"baseline: cached for {', '.join(cache['hits'])} (--refresh-baseline re-runs it)")
    if summary.get("emulated"):
        lines.append("EMULATED: scores come from transformers, not vLLM")
    if _look_line(summary):
        lines.append(_look_line(summary))
    limit = f" on {summary['limit']} items per task" if summary.get("limit") else ""
    lines.append(f"verdict: {summary['verdict'].upper()}{limit}")
    return "\n".join(lines)


def markdown_report(summary: dict[str, Any]) -> str:
    return "\n".join(_verdict_section(summary) + _parity_section(summary) + _kv_section(summary) + _setup_section(summary))


def _verdict_section(summary: dict[str, Any]) -> list[str]:
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
    out += md_table(gate_rows(summary)) + [""]
    out += [f"- {g['task']} / {g['metric']}: **{_status(g)}**: {g['reason']}" for g in summary["gates"]] + [""]
    return out + ([_look_line(summary), ""] if _look_line(summary) else [])


def _parity_section(summary: dict[str, Any]) -> list[str]:
    p = summary["parity"]
    out = ["## Engine parity", "", f"**{p['status'].upper()}**: {p.get('reason', '')}", ""]
    if "tolerance" in p:
        t = p["tolerance"]
        out += [
            f"vLLM's greedy tokens over {p['positions']} positions, teacher-forced through transformers: "
            f"greedy-token agreement {p['top1_agreement']:.1%} (minimum {t['min_top1_agreement']:.0%}), "
            f"mean |Δ logprob| of vLLM's top tokens {p['mean_abs_logprob_diff']:.4f} nats "
            f"(maximum allowed {t['max_mean_abs_logprob_diff']}; {t['why']}).",
            "",
        ]
    return out + ([_kl_line(summary), ""] if _kl_line(summary) else [])


def _kv_section(summary: dict[str, Any]) -> list[str]:
    kv = summary.get("kv_cache") or {}
    if kv.get("status") in (None, "skipped"):
        return []
    return [
        "## KV cache",
        "",
        f"**{kv['status'].upper()}**: {kv['reason']} ({kv['kv_cache_dtype']}, {kv['layers']} attention layers; "
        f"k_scale {kv['k_scale'][0]:.4g}–{kv['k_scale'][1]:.4g}, v_scale {kv['v_scale'][0]:.4g}–{kv['v_scale'][1]:.4g}).",
        "",
    ]


def _setup_section(summary: dict[str, Any]) -> list[str]:
    cache = summary["baseline_cache"]
    return [
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
        "Scores with ± are lm-eval's standard errors (for perplexities, qserve's by linearization over documents). "
        "Degradation is how much worse the quantized model is, ± the paired standard error over the same items; "
        "a pass must clear the allowance at the one-sided 95% noise bound.",
        "",
    ]


def _kl_line(summary: dict[str, Any]) -> str | None:
    kl = (summary.get("parity") or {}).get("kl_to_baseline")
    if not kl:
        return None
    return (
        f"screening (not a gate): mean KL(baseline || checkpoint) {kl['mean_nats']:.4f} nats per token "
        f"over {kl['positions']} positions of the parity prompts"
    )


def _look_line(summary: dict[str, Any]) -> str | None:
    """Which look at these weights this was (a look is new items), and what a pass guarantees."""
    look = summary.get("look") or {}
    if not look or summary.get("purpose") == "tune search" or look.get("number") is None:
        return "tune search: not a gate decision (the winner is confirmed on held-out items)" if look else None
    window = f"items {summary['offset']}-{summary['offset'] + summary['limit'] - 1}; " if summary.get("offset") else ""
    again = "" if look.get("counted") else f"the same items as look {look['number']}, nothing spent; "
    return (
        f"look {look['number']} at these weights ({window}{again}{len(look['earlier'])} earlier gate runs): "
        f"bounds one-sided {1 - look['level']:.2%}, so that all looks together pass a model at its allowance at most 5 % of the time "
        f"({GUARANTEE})"
    )


# The class of loss shapes a pass's level holds for, as README and docs/gates.md state it.
GUARANTEE = (
    "exact for 0/1 metrics; for perplexities and other means, for the loss shapes docs/gate-levels.md covers, "
    "Pareto-tailed losses outside them"
)


def _status(gate: dict[str, Any]) -> str:
    """A gate without signal is a warning: it neither passes nor holds up the verdict (gates.verdict)."""
    return gate["status"] if gate.get("signal", True) else "warning: no signal"
