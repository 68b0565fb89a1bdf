"""Eval throughput against the machine's limit: prefill and decode tokens/s of qserve's eval engine
per dtype, the arithmetic bound for that dtype, and raw lm-eval on the same engine settings.

Prefill is lm-eval's rolling log-likelihood over the demo's documents (gsm8k_ppl: every token is
a prompt token), and beside it vLLM alone scoring the same tokens in one `generate` call with
qserve's scoring parameters and engine settings, no lm-eval around it: what vLLM itself reaches on
these tokens. The goal: qserve's prefill at least GOAL_VS_VLLM_ALONE of vLLM alone's, per dtype (what
lm-eval and qserve add around vLLM may cost a twentieth at most). Each side is timed ROUNDS times, in
turns, and its median recorded. Decode is vLLM's offline generation of 16 x 128 tokens.

The bound is the model's FLOPs per token (bench/peak.py), each part at this CPU's measured matmul
rate for the dtype it runs in: float32 or bfloat16 for the unquantized model; for W8A8 its layers
in int8 (activations are quantized to int8 per token), its LM head and attention in bfloat16.
Where the time goes: one more vLLM-alone run per dtype under torch.profiler, kept out of the timed
figures (the profiler costs time of its own), records the ops that took the most of it.
Nothing asserts: it measures and reports.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from qserve.bench import peak
from qserve.checkpoint.manifest import VllmArgs, read_manifest
from qserve.device import detect
from qserve.engines import throughput
from qserve.engines import vllm as engine
from qserve.models.sources import baseline_model
from qserve.progress import step

TASK, LIMIT = "gsm8k_ppl", 100  # the demo's gate
GOAL_VS_VLLM_ALONE = 0.95  # qserve's prefill tokens/s against vLLM alone's on the same tokens, per dtype
# Each prefill side is timed this often, in turns: a single run of one side varies by a tenth between runs.
ROUNDS = 3
PROFILE_TOP = 8  # ops the profile names; the rest are summed


def eval_throughput(w8a8_ckpt: Path, data_dir: Path, limit: int = LIMIT) -> dict[str, Any]:
    """Per dtype: qserve's eval prefill and decode tokens/s, raw lm-eval's prefill tokens/s on the
    same engine settings, the bound, and the shares."""
    from qserve.evaluate.tasks import get_tasks, lm_eval_config

    manifest, device = read_manifest(w8a8_ckpt), detect.detect_device()
    base = baseline_model(manifest).path
    from qserve.evaluate.lm_eval_run import Window

    config = lm_eval_config(get_tasks([TASK])[0], data_dir)
    window = Window.select(limit, 0, [config])  # the items qserve eval --limit scores
    documents = _documents(config, window.ids[TASK])  # read once: every side scores these
    tokens = prompt_tokens(base, documents)
    flops = peak.flops_per_token(base, context=tokens["mean_context"])
    with step("eval throughput: matmul peaks (float32, bfloat16, int8; torch's and vLLM's kernels)"):
        kernels = {d: peak.matmul_gflops(d) for d in ("float32", "bfloat16", "int8")}
    rates = {d: max(by_kernel.values()) for d, by_kernel in kernels.items()}
    baseline = engine.baseline_args(device)
    # dtype -> the model, its engine arguments and the dtype each part of its FLOPs runs in
    sides: dict[str, tuple[Path, VllmArgs, dict[str, str]]] = {
        "float32": (base, baseline.model_copy(update={"dtype": "float32"}), dict.fromkeys(flops, "float32")),
        "bfloat16": (base, baseline.model_copy(update={"dtype": "bfloat16"}), dict.fromkeys(flops, "bfloat16")),
        "int8": (w8a8_ckpt, manifest.vllm_args, dict.fromkeys(flops, "bfloat16") | {"layers": "int8"}),
    }
    _warm_up(base, baseline, device, config)
    rows = {}
    for dtype, (path, args, runs_in) in sides.items():
        bound = peak.bound_tokens_per_second(flops, {part: rates[d] for part, d in runs_in.items()})
        row = _measure(path, args, device, config, window, documents, tokens["total"])
        rows[dtype] = row | {
            "profile": _vllm_alone_profile(path, args, device, f"{dtype} (profiled)", documents),
            "matmul_gflops": round(rates[dtype], 1),
            "matmul_gflops_by_kernel": {k: round(v, 1) for k, v in kernels[dtype].items()},
            "bound_tokens_per_second": round(bound, 1),
            "prefill_share_of_bound": round(row["prefill_tokens_per_second"] / bound, 3),
            "decode_share_of_bound": round(row["decode"]["tokens_per_second"] / bound, 3),
            "qserve_vs_raw_lm_eval": round(row["prefill_seconds"] / row["raw_prefill_seconds"], 3),
            "vllm_alone_share_of_bound": round(row["vllm_alone_prefill_tokens_per_second"] / bound, 3),
            "qserve_vs_vllm_alone": round(row["prefill_seconds"] / row["vllm_alone_prefill_seconds"], 3),
            "qserve_speed_vs_vllm_alone": round(row["vllm_alone_prefill_seconds"] / row["prefill_seconds"], 3),
        }
    return {"task": TASK, "limit": limit, "prompt_tokens": tokens, "flops_per_token": flops, "dtypes": rows}


def _warm_up(path: Path, args: VllmArgs, device: detect.Device, config: dict) -> None:
    """One untimed evaluation first: the task's dataset is converted and cached on first use, which
    would otherwise be charged to whichever side runs first. It runs lm-eval's own class, as the raw
    side does, so that vLLM's compiled rank kernel, which only that side uses (qserve's engines count
    ranks without it), is built before any timed run."""
    import lm_eval

    with engine.open_engine(path, args, device, "the warm-up", as_shipped=True) as lm:
        lm_eval.simple_evaluate(model=lm, tasks=[config], limit=2, bootstrap_iters=0)


def prompt_tokens(model_dir: Path, documents: list[str]) -> dict[str, float]:
    """The tokens lm-eval scores on the documents (the task's own text, from `_documents`, plus the one
    token lm-eval's rolling windows start from)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    counts = [len(tokenizer(text).input_ids) + 1 for text in documents]
    return {"total": sum(counts), "documents": len(counts), "mean_context": sum(counts) / len(counts) / 2}


def _documents(config: dict, ids: tuple[int, ...]) -> list[str]:
    """The documents `ids` of the task's test split as it scores them (its doc_to_target, rendered by
    lm-eval's own template function)."""
    from lm_eval.utils import apply_template

    lines = Path(config["dataset_kwargs"]["data_files"][config["test_split"]]).read_text().splitlines()
    return [apply_template(config["doc_to_target"], json.loads(lines[i])) for i in ids]


def _measure(
    path: Path, args: VllmArgs, device: detect.Device, config: dict, window: Any, documents: list[str], tokens: int
) -> dict[str, Any]:
    """Prefill through qserve's lm-eval run, through raw lm-eval's VLLM model with the same keyword
    arguments and through vLLM alone, in turns for ROUNDS rounds, each run on an engine of its own and
    timed around the scoring alone (engine start excluded); the median of each side is its figure.
    Decode is timed once, on the first round's qserve engine."""
    from qserve.evaluate.lm_eval_run import Subject, run_lm_eval

    label = f"{args.dtype} {args.quantization or 'unquantized'}"
    runs, decode = {"qserve": [], "raw": [], "alone": []}, None
    for turn in range(ROUNDS):
        run = run_lm_eval(
            Subject(path, args, label), device, [config], window, during=None if turn else throughput.decode_throughput
        )
        decode = decode or run.extra
        runs["qserve"].append(run.seconds)
        runs["raw"].append(_raw_lm_eval(path, args, device, label, config, window.lm_eval([config["task"]])))
        runs["alone"].append(_vllm_alone(path, args, device, label, documents))
    seconds = {side: statistics.median(times) for side, times in runs.items()}
    return {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "prefill_seconds": round(seconds["qserve"], 2),
        "prefill_tokens_per_second": round(tokens / seconds["qserve"], 1),
        "raw_prefill_seconds": round(seconds["raw"], 2),
        "raw_prefill_tokens_per_second": round(tokens / seconds["raw"], 1),
        "vllm_alone_prefill_seconds": round(seconds["alone"], 2),
        "vllm_alone_prefill_tokens_per_second": round(tokens / seconds["alone"], 1),
        "prefill_runs_seconds": {side: [round(t, 2) for t in times] for side, times in runs.items()},
        "decode": decode,
    }


def _raw_lm_eval(path: Path, args: VllmArgs, device: detect.Device, label: str, config: dict, items: dict[str, Any]) -> float:
    """Seconds raw lm-eval's own VLLM class takes over the task's `items` (simple_evaluate's keywords), with
    qserve's engine settings."""
    import lm_eval

    with engine.open_engine(path, args, device, f"raw lm-eval, {label}", as_shipped=True) as lm:
        start = time.perf_counter()
        lm_eval.simple_evaluate(model=lm, tasks=[config], log_samples=True, bootstrap_iters=1000, **items)
        return time.perf_counter() - start


def _vllm_alone(path: Path, args: VllmArgs, device: detect.Device, label: str, documents: list[str], around: Any = None) -> float:
    """Seconds vLLM takes to score the documents' tokens (each after lm-eval's prefix token, as its
    rolling windows give them) in one `generate` call with qserve's scoring parameters: qserve's lm-eval
    model class's own `_model_generate`, without lm-eval's requests, windows and sorting around it.
    `around` is a context manager the scoring runs in (the profiler)."""
    with engine.open_engine(path, args, device, f"vLLM alone, {label}") as lm:
        requests = [[lm.prefix_token_id, *lm.tok_encode(text)] for text in documents]
        start = time.perf_counter()
        with around or nullcontext():
            lm._model_generate(requests)
        return time.perf_counter() - start


def _vllm_alone_profile(path: Path, args: VllmArgs, device: detect.Device, label: str, documents: list[str]) -> dict[str, Any]:
    """Where vLLM alone's scoring of the documents spends its time: each op's own (self) CPU seconds
    under torch.profiler, the PROFILE_TOP largest by name, and the wall time no op accounts for
    (Python in vLLM's scheduler and model runner)."""
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU])
    wall = _vllm_alone(path, args, device, label, documents, around=profiler)
    ops = sorted(profiler.key_averages(), key=lambda op: op.self_cpu_time_total, reverse=True)
    in_ops = sum(op.self_cpu_time_total for op in ops) / 1e6
    top = [{"op": op.key, "seconds": round(op.self_cpu_time_total / 1e6, 3), "calls": op.count} for op in ops[:PROFILE_TOP]]
    return {
        "wall_seconds": round(wall, 2),
        "top": top,
        "other_ops_seconds": round(in_ops - sum(t["seconds"] for t in top), 3),
        "outside_ops_seconds": round(wall - in_ops, 3),
    }


def markdown(result: dict[str, Any]) -> list[str]:
    """The table for the benchmarks page."""
    flops = result["flops_per_token"]
    if isinstance(flops, dict):
        total = sum(flops.values())
        how = (
            "bound = FLOPs per token at the measured matmul rate of the dtype each part runs in "
            "(W8A8: its layers in int8, LM head and attention in bfloat16)"
        )
    else:  # recorded before the FLOPs were split by part
        total, how = flops, "bound = measured matmul rate / FLOPs per token"
    return [
        f"Eval throughput ({result['task']}, {result['limit']} documents, {result['prompt_tokens']['total']} prompt tokens; "
        f"{total / 1e9:.3f} GFLOP per token): {how}; goal: qserve's prefill at least "
        f"{GOAL_VS_VLLM_ALONE:.0%} of vLLM alone's, per dtype. vLLM alone: the same tokens scored in one "
        "`generate` call with qserve's scoring parameters and engine settings, no lm-eval around it." + _rounds(result),
        "",
        "| dtype | matmul GFLOP/s | bound tok/s | qserve prefill tok/s | share | vLLM alone prefill tok/s (share) | "
        f"qserve / vLLM alone (goal >= {GOAL_VS_VLLM_ALONE}) | raw lm-eval prefill tok/s | qserve / raw time | decode tok/s | decode share |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(_markdown_row(dtype, r) for dtype, r in result["dtypes"].items()),
        *_profile_markdown(result["dtypes"]),
    ]


def _profile_markdown(rows: dict[str, Any]) -> list[str]:
    """Where vLLM alone's time goes, a line per dtype (recorded since the benchmark profiles)."""
    if not all("profile" in r for r in rows.values()):
        return []
    named = len(next(iter(rows.values()))["profile"]["top"])
    lines = [
        "",
        f"Where vLLM alone's scoring time goes (one more run per dtype under torch.profiler, which slows it; "
        f"each op's own CPU seconds, the {named} largest, then the other ops and the time outside any op):",
        "",
        "| dtype | profiled wall s | largest ops, own seconds (calls) | other ops s | outside ops s |",
        "|---|---|---|---|---|",
    ]
    for dtype, r in rows.items():
        p = r["profile"]
        ops = ", ".join(f"`{t['op']}` {t['seconds']:.2f} ({t['calls']})" for t in p["top"])
        lines.append(f"| {dtype} | {p['wall_seconds']} | {ops} | {p['other_ops_seconds']:.2f} | {p['outside_ops_seconds']:.2f} |")
    return lines


def _rounds(result: dict[str, Any]) -> str:
    runs = next(iter(result["dtypes"].values())).get("prefill_runs_seconds")  # recorded since sides are repeated
    if not runs:
        return " Prefill: one run per side."
    return f" Prefill: the median of {len(runs['qserve'])} runs per side, in turns, each on an engine of its own."


def _markdown_row(dtype: str, r: dict[str, Any]) -> str:
    by_kernel = r.get("matmul_gflops_by_kernel")  # recorded since both kernel libraries are timed
    rate = f"{r['matmul_gflops']} ({', '.join(f'{k} {v}' for k, v in by_kernel.items())})" if by_kernel else r["matmul_gflops"]
    alone, versus = "not measured", "not measured"
    if "vllm_alone_prefill_tokens_per_second" in r:  # recorded since vLLM alone is timed
        alone = f"{r['vllm_alone_prefill_tokens_per_second']} ({r['vllm_alone_share_of_bound']:.1%})"
        speed = r.get("qserve_speed_vs_vllm_alone") or round(1 / r["qserve_vs_vllm_alone"], 3)
        versus = f"{speed} ({'met' if speed >= GOAL_VS_VLLM_ALONE else 'NOT met'})"
    return (
        f"| {dtype} | {rate} | {r['bound_tokens_per_second']} | {r['prefill_tokens_per_second']} | "
        f"{r['prefill_share_of_bound']:.1%} | {alone} | {versus} | {r['raw_prefill_tokens_per_second']} | "
        f"{r['qserve_vs_raw_lm_eval']} | {r['decode']['tokens_per_second']} | {r['decode_share_of_bound']:.1%} |"
    )
