"""Eval reports: lm-eval's raw JSON, qserve's summary JSON, a Markdown report and the model card.

All four are rendered from the same record, so they cannot disagree; the record is written
last because `serve` trusts it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qserve.checkpoint.manifest import LM_EVAL_RESULTS_NAME, REPORT_NAME, Manifest
from qserve.gate.card import gate_rows, md_table, text_table, write_card
from qserve.gate.core import Group
from qserve.gate.decisions import Gate
from qserve.gate.records import write_eval
from qserve.gate.schema import EvalRecord
from qserve.paths import write_json, write_text


def write_all(ckpt: Path, manifest: Manifest, record: EvalRecord, raw: dict[str, Any]) -> None:
    write_json(ckpt / LM_EVAL_RESULTS_NAME, raw)
    write_text(ckpt / REPORT_NAME, markdown_report(record, raw))
    write_card(ckpt, manifest, record)
    write_eval(ckpt, record)


def format_table(record: EvalRecord) -> str:
    """The terminal view: the gate table, notes for anything not a clean pass, parity, verdict."""
    lines = text_table(gate_rows(record.gates))
    lines += [f"  {g.task} {g.metric}: {_status(g)}: {g.reason}" for g in record.gates]
    for name, group in (record.groups or {}).items():
        lines.append(
            f"  {name}: the items of its {len(group.members)} tasks {_pooling(group)}; each task's scores: {REPORT_NAME}"
        )
    if record.parity:
        lines.append(f"engine parity: {record.parity.status.upper()}: {record.parity.reason}")
    if _kl_line(record):
        lines.append(_kl_line(record))
    kv = record.kv_cache
    if kv and kv.status != "skipped":
        lines.append(f"kv cache ({kv.kv_cache_dtype}): {kv.status.upper()}: {kv.reason}")
    if record.baseline_cache and record.baseline_cache.hits:
        lines.append(f"baseline: cached for {', '.join(record.baseline_cache.hits)} (--refresh-baseline re-runs it)")
    if record.emulated:
        lines.append("EMULATED: scores come from transformers, not vLLM")
    if _look_line(record):
        lines.append(_look_line(record))
    limit = f" on {record.limit} items per task{_per_group(record)}{_sampled(record)}" if record.limit else ""
    lines.append(f"verdict: {record.verdict.upper()}{limit}")
    return "\n".join(lines)


def markdown_report(record: EvalRecord, raw: dict[str, Any] | None = None) -> str:
    sections = _verdict_section(record) + _groups_section(record, raw or {})
    return "\n".join(sections + _parity_section(record) + _kv_section(record) + _setup_section(record))


def _pooling(group: Group) -> str:
    if len(group.gated) == 1:
        return "pooled in one test"
    return f"pooled in one test per metric ({', '.join(group.gated)}), over the tasks that report it"


def _groups_section(record: EvalRecord, raw: dict[str, Any]) -> list[str]:
    """Each gated group's tasks beside it, with the scores lm-eval gave each (`raw`: both models' outputs)."""
    out = []
    for name, group in (record.groups or {}).items():
        metrics = list(dict.fromkeys(g.metric for g in record.gates if g.task == name)) or [group.metric]
        rows = [("task", "metric", "n", "baseline", "quantized")]
        for member in group.members:
            for metric in (m for m in metrics if member in group.reporters(m)):
                scores = [
                    (raw.get(side, {}).get("results", {}).get(member) or {}).get(metric) for side in ("baseline", "quantized")
                ]
                n = ((raw.get("quantized", {}).get("n-samples") or {}).get(member) or {}).get("effective")
                rows.append((member, metric, str(n or "?"), *("n/a" if v is None else f"{v:.4f}" for v in scores)))
        out += [f"## {name}: its {len(group.members)} tasks", ""]
        out += [
            f"In the gates above, their items are {_pooling(group)}; the group's score is lm-eval's aggregation of theirs.",
            "",
        ]
        out += md_table(rows) + [""]
    return out


def _verdict_section(record: EvalRecord) -> list[str]:
    out = [
        f"# qserve eval: {Path(record.checkpoint or '').name}",
        "",
        f"**Verdict: {record.verdict.upper()}** (decided {record.decided_at}"
        + (f", {record.limit} items per task{_per_group(record)}{_sampled(record)}" if record.limit else "")
        + ")",
        "",
    ]
    if record.emulated:
        why = "vLLM cannot run this scheme on this device"
        if record.outside_runs:
            why = "the lm-eval runs made outside qserve used transformers"
        out += [f"> **Emulated**: {why}; scores come from transformers.", ""]
    out += md_table(gate_rows(record.gates)) + [""]
    out += [f"- {g.task} / {g.metric}: **{_status(g)}**: {g.reason}" for g in record.gates] + [""]
    return out + ([_look_line(record), ""] if _look_line(record) else [])


def _parity_section(record: EvalRecord) -> list[str]:
    p = record.parity
    if p is None:
        return []
    out = ["## Engine parity", "", f"**{p.status.upper()}**: {p.reason}", ""]
    t = p.tolerance
    if t and p.top1_agreement is not None and p.mean_abs_logprob_diff is not None:
        out += [
            f"vLLM's greedy tokens over {p.positions} positions, teacher-forced through transformers: "
            f"greedy-token agreement {p.top1_agreement:.1%} (minimum {t.min_top1_agreement:.0%}), "
            f"mean |Δ logprob| of vLLM's top tokens {p.mean_abs_logprob_diff:.4f} nats "
            f"(maximum allowed {t.max_mean_abs_logprob_diff}; {t.why}).",
            "",
        ]
    return out + ([_kl_line(record), ""] if _kl_line(record) else [])


def _kv_section(record: EvalRecord) -> list[str]:
    kv = record.kv_cache
    if kv is None or kv.status == "skipped" or kv.k_scale is None or kv.v_scale is None:
        return []
    return [
        "## KV cache",
        "",
        f"**{kv.status.upper()}**: {kv.reason} ({kv.kv_cache_dtype}, {kv.layers} attention layers; "
        f"k_scale {kv.k_scale[0]:.4g}–{kv.k_scale[1]:.4g}, v_scale {kv.v_scale[0]:.4g}–{kv.v_scale[1]:.4g}).",
        "",
    ]


def _setup_section(record: EvalRecord) -> list[str]:
    if record.outside_runs:
        return _outside_section(record)
    cache, device, args, base = record.baseline_cache, record.device, record.engine_args, record.baseline_model
    assert cache and device and args and base, "qserve eval writes these"  # a missing one is a qserve bug
    return [
        "## Setup",
        "",
        f"- Scheme: {record.scheme} (recipe `{record.recipe}`)",
        f"- Device: {device.kind} ({device.detail})",
        f"- Quantized engine: `{json.dumps(args.quantized)}`",
        f"- Baseline: {base.id}, engine `{json.dumps(args.baseline)}`; cached for: {', '.join(cache.hits) or 'none'}",
        *_lm_eval_lines(record),
        f"- Versions: {', '.join(f'{k} {v}' for k, v in sorted((record.versions or {}).items()))}",
        f"- Timings (s): {', '.join(f'{k} {v}' for k, v in (record.timings or {}).items())}",
        "",
        "Scores with ± are lm-eval's standard errors (for perplexities, qserve's by linearization over documents). "
        "Degradation is how much worse the quantized model is, ± the paired standard error over the same items. "
        "A gate decided by betting (its test says so) passes when its wealth against a degradation at or above the "
        "allowance reaches 1/alpha; its record's bounds are one look's fixed-n bounds, shown for scale, not the test. "
        "Any other gate passes when its one-sided bound at the look's level clears the allowance.",
        "",
    ]


def _outside_section(record: EvalRecord) -> list[str]:
    """`qserve gate --checkpoint`: the two lm-eval runs made elsewhere, as their results state them."""
    runs = record.outside_runs
    assert runs is not None
    lines = ["## Setup", "", f"- Scheme: {record.scheme} (recipe `{record.recipe}`)"]
    for side, run in (("Baseline", runs.baseline), ("Quantized", runs.quantized)):
        args = json.dumps(run.model_args) if isinstance(run.model_args, dict) else run.model_args
        lines.append(f"- {side}: lm-eval {run.lm_eval_version} run outside qserve, `{run.model}` with `{args}`: {run.results}")
    return [*lines, "", "Scores and items are those lm-eval wrote; qserve decided the gate on them (`qserve gate`).", ""]


def _lm_eval_lines(record: EvalRecord) -> list[str]:
    """lm-eval's options as both models got them, and the chat template by hash when one was applied."""
    asked = (record.request or {}).get("lm_eval")
    if asked is None:
        return []
    sha = record.prompting.quantized.get("chat_template_sha") if record.prompting else None
    template = f"; chat template sha256 {sha}" if sha else ""
    return [f"- lm-eval options (both models): `{json.dumps(asked)}`{template}"]


def _kl_line(record: EvalRecord) -> str | None:
    kl = record.parity.kl_to_baseline if record.parity else None
    if kl is None:
        return None
    return (
        f"screening (not a gate): mean KL(baseline || checkpoint) {kl.mean_nats:.4f} nats per token "
        f"over {kl.positions} positions of the parity prompts"
    )


def _per_group(record: EvalRecord) -> str:
    """A limited eval's groups gated as one took their N from the group's pooled order (gate/order.pooled_order)."""
    return " and group" if record.groups and record.order and "pooled" in record.order else ""


def _sampled(record: EvalRecord) -> str:
    """How a limited eval picked its items: a seeded random sample (record.order), or the file's first ones."""
    return f", a seeded random sample ({record.order})" if record.order else " (the first in file order)"


def _look_line(record: EvalRecord) -> str | None:
    """Which look at these weights this was (a look is new items), and what a pass guarantees."""
    look = record.look
    if look is None:
        return None
    if record.purpose == "tune search" or look.number is None:
        return "tune search: not a gate decision (the winner is confirmed on held-out items)"
    window = f"items {record.offset}-{record.offset + (record.limit or 0) - 1}; " if record.offset else ""
    again = "" if look.counted else f"the same items as look {look.number}, nothing spent; "
    return (
        f"look {look.number} at these weights ({window}{again}{len(look.earlier)} earlier gate runs): "
        f"gates on scores in [0, 1] and perplexities bet on a prefix of the seeded order at 5 % over every look; other bets and bounds are one-sided {1 - look.level:.2%}, "
        f"so that all looks together pass a model at its allowance at most 5 % of the time ({GUARANTEE})"
    )


# The class of loss shapes a pass's level holds for, as README and docs/gates.md state it.
GUARANTEE = (
    "for scores in [0, 1], 0/1 included, by betting and Ville's inequality, for every pattern of item scores "
    "(in a gate's declared score_range the same, for every item within it); "
    "for word and byte perplexity and bits per byte the same, for every loss within the cap of log 2 nats per word "
    "(per byte) on a document, and for lambada's perplexity within log 100 nats on an item; for other means, for the class "
    "of loss shapes docs/gate-levels.md covers (tails up to Pareto index 2.5, a loss in at least 5 % of documents)"
)


def _status(gate: Gate) -> str:
    """A gate without signal is a warning: it neither passes nor holds up the verdict (decisions.verdict)."""
    return gate.status if gate.signal else "warning: no signal"
