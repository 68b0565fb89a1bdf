"""What `qserve tune` writes: the sensitivity table and the Pareto table of candidates, each as
JSON (for machines), Markdown (for people) and a PNG plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qserve.paths import write_json, write_text

SENSITIVITY = "sensitivity"
PARETO = "pareto"


def _write(stem: str, result: dict[str, Any], markdown: Any, plot: Any, out: Path) -> dict[str, str]:
    """`stem`.json, .md and .png in `out`; returns their paths by kind."""
    files = {"json": out / f"{stem}.json", "markdown": out / f"{stem}.md", "plot": out / f"{stem}.png"}
    write_json(files["json"], result)
    write_text(files["markdown"], markdown(result))
    plot(result, files["plot"])
    return {k: str(v) for k, v in files.items()}


def write_sensitivity(result: dict[str, Any], out: Path) -> dict[str, str]:
    return _write(SENSITIVITY, result, sensitivity_markdown, _sensitivity_plot, out)


def sensitivity_markdown(result: dict[str, Any]) -> str:
    head = (
        f"Each layer group quantized alone to {result['scheme']} (group size {result['group_size']}), "
        f"{result['tokens']} held-out calibration tokens; least harmful first.\n\n"
        "| rank | group | parameters | KL (nats/token) | token perplexity change |\n|---:|---|---:|---:|---:|\n"
    )
    rows = [
        f"| {i} | {g['group']} | {g['params']:,} | {g['kl']:.5f} | {g['ppl_change']:+.2%} |"
        for i, g in enumerate(result["groups"], start=1)
    ]
    return head + "\n".join(rows) + "\n"


def _sensitivity_plot(result: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    groups = sorted(result["groups"], key=lambda g: (g["block"], g["kind"]))
    fig, ax = plt.subplots(figsize=(9, 4), dpi=120)
    for kind, colour in zip(sorted({g["kind"] for g in groups}), ("tab:blue", "tab:orange", "tab:green"), strict=False):
        mine = [g for g in groups if g["kind"] == kind]
        ax.bar(
            [g["block"] + (0.2 if kind == "self_attn" else -0.2) for g in mine],
            [g["kl"] for g in mine],
            width=0.4,
            color=colour,
            label=kind,
        )
    ax.set_xlabel("decoder block")
    ax.set_ylabel("KL divergence (nats/token)")
    ax.set_title(f"Sensitivity: each group quantized alone to {result['scheme']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_pareto(result: dict[str, Any], out: Path) -> dict[str, str]:
    return _write(PARETO, result, pareto_markdown, _pareto_plot, out)


def pareto_markdown(result: dict[str, Any]) -> str:
    """One row per candidate tried, in the order tried; the winner marked."""
    low, high = result["schemes"]
    head = (
        f"Candidates: the first k of {result['groups']} layer groups (least KL per parameter) in {low}, the rest in {high}; "
        f"gate {result['gate']}, {result['limit']} items per task.\n\n"
        f"| candidate | groups in {low} | quantized-layer bytes vs bf16 | checkpoint vs bf16 | recovery | "
        "one look's fixed-n bounds (degradation; for scale, the verdict is the gate's test) | allowed | verdict | "
        "decode tok/s |\n|---|---:|---:|---:|---:|---|---:|---|---:|\n"
    )
    rows = []
    for c in result["candidates"]:
        mark = " **(winner)**" if c["name"] == (result.get("winner") or {}).get("name") else ""
        b = c["bounds"] or {}
        bounds = f"[{b['lower']:+.2%}, {b['upper']:+.2%}]" if b else "n/a"
        decode = f"{c['decode_tokens_per_second']:.0f}" if c["decode_tokens_per_second"] else "n/a"
        rows.append(
            f"| {c['name']}{mark} | {c['k']} | {c['layer_bytes_vs_bf16']:.3f} | {c['size_vs_bf16']:.3f} | "
            f"{c['recovery']:.4f} | {bounds} | {b.get('allowed', float('nan')):+.2%} | {c['verdict']} | {decode} |"
        )
    return head + "\n".join(rows) + "\n"


def _pareto_plot(result: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    colours = {"pass": "tab:green", "fail": "tab:red", "inconclusive": "tab:orange"}
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for c in result["candidates"]:
        ax.scatter([c["layer_bytes_vs_bf16"]], [c["recovery"]], s=90, color=colours.get(c["verdict"], "tab:blue"), zorder=3)
        ax.annotate(
            f"k={c['k']} ({c['verdict']})",
            (c["layer_bytes_vs_bf16"], c["recovery"]),
            textcoords="offset points",
            xytext=(6, -4),
            fontsize=8,
        )
    ax.axhline(result["min_recovery"], color="tab:red", lw=0.8, ls="--", label=f"gate {result['min_recovery']}")
    ax.set_xlabel("quantized-layer bytes relative to bf16")
    ax.set_ylabel("recovery on the gated task")
    ax.set_title("qserve tune: candidates tried (green passed the noise-aware gate in vLLM)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def format_tune(result: dict[str, Any]) -> str:
    """The terminal summary: the Pareto table, then the winner (or the closest) and the files."""
    lines = [pareto_markdown(result)] if result.get("candidates") else []
    w = result.get("winner")
    if w:
        lines.append(
            f"winner: {w['name']} (k={w['k']}): quantized-layer bytes {w['layer_bytes_vs_bf16']:.3f}x bf16, "
            f"recovery {w['recovery']:.4f}, PASS"
        )
        lines.append(f"checkpoint: {w['checkpoint']}")
        lines.append(f"recipe:     {result['recipe_file']}  (qserve quantize it to re-make the checkpoint)")
    if result.get("stopped"):
        lines.append(f"search stopped: {result['stopped']}")
    conf = result.get("confirmation")
    if conf:
        lines.append(
            f"confirmation on held-out items {conf['items']}: {conf['verdict'].upper()}, recovery {conf['recovery']:.4f} "
            "(the gate record serve checks; the search's records are not gates)"
        )
    if not w and result.get("closest"):
        c = result["closest"]
        lines.append(f"no candidate passed; closest: {c['name']} (k={c['k']}), recovery {c['recovery']:.4f}, {c['verdict']}")
    lines += [f"{what}: {p}" for what, p in result.get("files", {}).items()]
    return "\n".join(lines)
