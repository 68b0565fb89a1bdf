"""`qserve bench --suite`: what qserve costs, as ratios measured side by side in one run.

Each comparison runs both sides on this machine, now, with the same inputs; the ratios are
the result (absolute figures depend on the machine). Separate from the tests: nothing here
asserts, it measures and reports against the goals.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from qserve import paths
from qserve.checkpoint.tensors import quantized_layer_bytes
from qserve.device import detect, engine, throughput
from qserve.errors import QserveError
from qserve.progress import info, step

GOALS = {
    "help_seconds": ("<=", 0.5),
    "quantize_wall_ratio": ("<=", 1.05),
    "quantize_rss_ratio": ("<=", 1.10),
    "W4A16_bytes_vs_bf16": ("<=", 0.30),
    "W8A8_bytes_vs_bf16": ("<=", 0.52),
    "FP8_DYNAMIC_bytes_vs_bf16": ("<=", 0.52),
    "serve_throughput_ratio": (">=", 0.98),
}

# Runs one command as this process's only child and reports its wall time and peak RSS.
_MEASURE = """
import json, resource, subprocess, sys, time
t = time.perf_counter()
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
print(json.dumps({"code": code, "seconds": time.perf_counter() - t,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""

# The same quantization qserve runs, written directly against llm-compressor.
_RAW_ONESHOT = """
import json, sys
from compressed_tensors.quantization import preset_name_to_scheme
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
from transformers import AutoModelForCausalLM, AutoTokenizer
model_path, texts_file, group_size, seq_len, out = sys.argv[1:6]
texts = json.load(open(texts_file))
tokenizer = AutoTokenizer.from_pretrained(model_path)
model = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto")
enc = tokenizer(texts, truncation=True, max_length=int(seq_len), add_special_tokens=False)
scheme = preset_name_to_scheme("W4A16", ["Linear"])
scheme.weights.group_size = int(group_size)
oneshot(model=model, recipe=[GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])],
        dataset=Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}),
        num_calibration_samples=len(texts), max_seq_length=int(seq_len), shuffle_calibration_samples=False,
        pipeline="sequential")
model.save_pretrained(out, save_compressed=True)
tokenizer.save_pretrained(out)
"""


def measure(cmd: list[str]) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    if result["code"] != 0:
        raise QserveError(f"benchmark command failed ({result['code']}): {' '.join(cmd)}")
    return result


def help_cold_start(repeats: int = 5) -> dict[str, float]:
    """`qserve --help` in a fresh interpreter, against a bare interpreter start."""

    def median(cmd: list[str]) -> float:
        return statistics.median(measure(cmd)["seconds"] for _ in range(repeats))

    bare = median([sys.executable, "-c", "pass"])
    qhelp = median([sys.executable, "-m", "qserve.cli", "--help"])
    return {
        "help_seconds": round(qhelp, 3),
        "python_start_seconds": round(bare, 3),
        "help_minus_python_seconds": round(qhelp - bare, 3),
    }


def quantize_vs_oneshot(recipe: Path, work: Path, data_dir: Path) -> dict[str, Any]:
    """qserve quantize (shape check, hashing, manifest, card included) against bare oneshot."""
    from qserve.checkpoint.models import resolve_model
    from qserve.quantize.calibration import load_texts
    from qserve.quantize.recipe import load_recipe

    rec, _ = load_recipe(recipe)
    if (rec.scheme, rec.algorithm, rec.smoothquant) != ("W4A16", "gptq", None):
        raise QserveError(
            f"{recipe}: the raw llm-compressor script mirrors W4A16 GPTQ without SmoothQuant; this recipe is not that"
        )
    model = resolve_model(None).path
    texts, _ = load_texts(rec.calibration, data_dir, model)
    texts_file = work / "calibration_texts.json"
    texts_file.write_text(json.dumps(texts))
    qserve_cmd = [sys.executable, "-m", "qserve.cli", "quantize", str(recipe), "--output", str(work / "qserve-out"), "--force"]
    raw_cmd = [
        sys.executable,
        "-c",
        _RAW_ONESHOT,
        str(model),
        str(texts_file),
        str(rec.group_size),
        str(rec.calibration.seq_len),
        str(work / "raw-out"),
    ]
    runs = {"qserve": [], "raw": []}
    for side, cmd in (("raw", raw_cmd), ("qserve", qserve_cmd), ("raw", raw_cmd), ("qserve", qserve_cmd)):  # interleaved
        with step(f"quantize benchmark: {side}"):
            runs[side].append(measure(cmd))
    q = {k: min(r[k] for r in runs["qserve"]) for k in ("seconds", "peak_rss_mib")}
    r = {k: min(r[k] for r in runs["raw"]) for k in ("seconds", "peak_rss_mib")}
    return {
        "quantize_qserve": q,
        "quantize_raw_oneshot": r,
        "quantize_wall_ratio": round(q["seconds"] / r["seconds"], 3),
        "quantize_rss_ratio": round(q["peak_rss_mib"] / r["peak_rss_mib"], 3),
    }


def serve_vs_vllm(ckpt: Path) -> dict[str, Any]:
    """The same load through `qserve serve` and through `vllm serve` with the same arguments."""
    from qserve.checkpoint.manifest import read_manifest
    from qserve.serve.bench import Load, run_load
    from qserve.serve.plan import plan
    from qserve.serve.server import free_port, running

    manifest = read_manifest(ckpt)
    device = detect.detect_device()
    load = Load()
    results: dict[str, list[dict]] = {"qserve": [], "vllm": []}
    for side in ("vllm", "qserve", "vllm", "qserve"):  # interleaved, so drift hits both sides
        p = plan(ckpt, manifest, device, "127.0.0.1", free_port())
        port = p.url.rsplit(":", 1)[1]
        command = (
            p.command
            if side == "vllm"
            else [sys.executable, "-m", "qserve.cli", "serve", str(ckpt), "--port", port, "--skip-gate"]
        )
        with running(p, command):
            with step(f"serving benchmark through {side}"):
                results[side].append(run_load(p.url, p.model_name, ckpt, load))
    q = max(r["output_throughput"] for r in results["qserve"])
    v = max(r["output_throughput"] for r in results["vllm"])
    return {"serve_qserve": results["qserve"], "serve_vllm": results["vllm"], "serve_throughput_ratio": round(q / v, 3)}


def decode_vs_baseline(ckpts: dict[str, Path]) -> dict[str, Any]:
    """Offline decode throughput in vLLM, each quantized checkpoint against the baseline."""
    from qserve.checkpoint.manifest import read_manifest
    from qserve.checkpoint.models import baseline_model

    device = detect.detect_device()
    first = read_manifest(next(iter(ckpts.values())))
    base = baseline_model(first)
    out: dict[str, Any] = {}
    with engine.open_engine(base.path, engine.baseline_args(device), device, "the baseline (decode speed)") as lm:
        out["baseline"] = throughput.decode_throughput(lm)
    for name, ckpt in ckpts.items():
        manifest = read_manifest(ckpt)
        with engine.open_engine(ckpt, manifest.vllm_args, device, f"{name} (decode speed)") as lm:
            out[name] = throughput.decode_throughput(lm) | {"dtype": manifest.vllm_args.dtype}
        out[f"{name}_decode_ratio"] = round(out[name]["tokens_per_second"] / out["baseline"]["tokens_per_second"], 3)
    return out


def run_suite(recipes_dir: Path, work: Path, data_dir: str | Path | None = None) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    data = paths.data_dir(data_dir)
    result: dict[str, Any] = {"machine": _machine()}
    with step("benchmark: qserve --help cold start"):
        result |= help_cold_start()
    result |= quantize_vs_oneshot(recipes_dir / "w4a16-gptq.yaml", work, data)
    ckpts = {"W4A16": work / "qserve-out"}
    for name, scheme in (("fp8", "FP8_DYNAMIC"), ("w8a8-int8", "W8A8")):
        out = work / f"out-{name}"
        if not out.is_dir():
            measure([sys.executable, "-m", "qserve.cli", "quantize", str(recipes_dir / f"{name}.yaml"), "--output", str(out)])
        ckpts[scheme] = out
    for scheme, ckpt in ckpts.items():
        layers = quantized_layer_bytes(ckpt)
        result[f"{scheme}_layers"] = layers
        result[f"{scheme}_bytes_vs_bf16"] = layers["ratio"]
    result |= serve_vs_vllm(ckpts["W8A8"])
    result["decode"] = decode_vs_baseline(ckpts)
    result["goals"] = {k: _goal(k, result.get(k)) for k in GOALS}
    (work / "bench_suite.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _goal(key: str, value: float | None) -> dict[str, Any]:
    op, target = GOALS[key]
    met = value is not None and (value <= target if op == "<=" else value >= target)
    return {"value": value, "goal": f"{op} {target}", "met": met}


def _machine() -> dict[str, Any]:
    import os
    import platform

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def format_suite(result: dict[str, Any]) -> str:
    lines = ["benchmark                          value     goal      met"]
    for key, g in result["goals"].items():
        lines.append(f"{key:<34} {g['value']!s:<9} {g['goal']:<9} {'yes' if g['met'] else 'NO'}")
    dec = result["decode"]
    lines.append(f"decode tok/s in vLLM: baseline {dec['baseline']['tokens_per_second']}")
    lines += [f"  {k.removesuffix('_decode_ratio')}: {dec[k]}x baseline" for k in dec if k.endswith("_decode_ratio")]
    info("(full figures in bench_suite.json)")
    return "\n".join(lines)
