"""`qserve compare` and `qserve bench` on real checkpoints, the real vLLM and vLLM's own benchmark."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import BASELINE_DTYPE, CACHE_DIR, FAIL_LIMIT, copy_checkpoint, needs_vllm, run_qserve, run_qserve_in_process

from qserve.checkpoint.manifest import EVAL_NAME
from qserve.checkpoint.tensors import quantized_layer_bytes
from qserve.errors import EXIT_GATE_FAILED


@pytest.mark.slow
def test_quantized_layers_shrink_as_the_scheme_says(checkpoints) -> None:
    # Read from the safetensors headers: INT4 in groups of 64 with bf16 scales, INT8/FP8 per channel.
    w4 = quantized_layer_bytes(checkpoints["w4a16-gptq"])
    w8 = quantized_layer_bytes(checkpoints["w8a8-int8"])
    assert w4["layers"] == w8["layers"] == 30 * 7  # 30 decoder layers x q,k,v,o,gate,up,down
    assert 0.25 <= w4["ratio"] <= 0.30
    assert 0.50 <= w8["ratio"] <= 0.52


@pytest.mark.matrix  # make test-matrix (CI runs it after make test): keeps make test within 30 minutes
@pytest.mark.slow
@needs_vllm("w4a16-gptq", "w8a8-int8")
def test_compare_shares_one_cached_baseline_and_writes_table_plot_json(checkpoints, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    # W4A16 rather than FP8: FP8 decodes at 0.11x on this CPU, and the decode measurement is the slow part.
    for name in ("w4a16-gptq", "w8a8-int8"):
        copy_checkpoint(checkpoints[name], out / f"out-{name}")
    recipes = [checkpoints.recipe("w4a16-gptq"), checkpoints.recipe("w8a8-int8")]  # what the copies were made from
    # An empty baseline cache of its own (the converted model shared): the first recipe's eval runs
    # the baseline, the second reuses it.
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    for model in (CACHE_DIR / "models").iterdir():
        (cache / "models" / model.name).symlink_to(model)
    args = ("--tasks", "gsm8k_ppl", "--limit", str(FAIL_LIMIT), "--out-dir", out)
    proc = run_qserve_in_process("compare", *recipes, *args, env={"QSERVE_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The chain `qserve run` uses, with its reuse rule: the copies are what their recipes would make.
    for name in ("w4a16-gptq", "w8a8-int8"):
        assert (
            f"reusing checkpoint {out / f'out-{name}'}: same recipe, model, calibration data and libraries; files intact"
            in proc.stderr
        )
    assert "quantizing" not in proc.stderr
    result = json.loads((out / "compare.json").read_text())
    rows = {r["recipe"]: r for r in result["recipes"]}
    assert set(rows) == {"w4a16-gptq", "w8a8-int8"}
    for r in rows.values():
        assert r["gates"][0]["task"] == "gsm8k_ppl" and r["gates"][0]["recovery"] > 0.5
        assert r["decode_tokens_per_second"] > 0 and 0 < r["size_vs_bf16"] < 1
    assert result["baseline"]["decode_tokens_per_second"] > 0
    # The baseline is the source model as vLLM serves it by default (dtype auto: its own bfloat16), in
    # float32 on a CPU without a bfloat16 kernel, for the gate's engine (a cache miss: a fresh cache)
    # and for the decode row.
    asked, runs_in = BASELINE_DTYPE
    assert result["baseline"]["dtype"] == runs_in
    started = f"starting vLLM for the baseline HuggingFaceTB/SmolLM2-135M-Instruct (dtype={asked}, quantization=None, kv_cache_dtype=auto)"
    assert f"> {started} ..." in proc.stderr.splitlines()
    records = {name: json.loads((out / f"out-{name}" / EVAL_NAME).read_text()) for name in rows}
    assert records["w4a16-gptq"]["baseline_cache"]["misses"] == ["gsm8k_ppl"]
    assert records["w8a8-int8"]["baseline_cache"]["hits"] == ["gsm8k_ppl"]  # one baseline engine, not two
    w4 = records["w4a16-gptq"]
    assert records["w8a8-int8"]["gates"][0]["baseline"] == w4["gates"][0]["baseline"]
    # 4-bit weights cost a 135M model about a quarter of its perplexity: the recipe's 0.95 gate catches it,
    # and the engine is faithful (parity passes): this is quantization error.
    assert (w4["verdict"], w4["gates"][0]["status"], w4["parity"]["status"]) == ("fail", "fail", "pass")
    assert w4["gates"][0]["recovery"] < 0.95 and "degradation > allowance" in w4["gates"][0]["reason"]
    # The table shows every recipe with the numbers in the JSON.
    lines = proc.stdout.splitlines()
    for name, r in rows.items():
        row = next(line for line in lines if line.startswith(name))
        assert f"{r['gates'][0]['recovery']:.3f}" in row and f"{r['decode_tokens_per_second']:.0f}" in row
    png = (out / "compare.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    # --refresh-baseline runs the baseline again although it is cached, gets the cached number, and
    # the same decision: W4A16 fails the recipe's gate by betting (exit 3).
    ckpt = out / "out-w4a16-gptq"
    proc = run_qserve_in_process(
        "eval", ckpt, *args[:4], "--no-parity", "--refresh-baseline", env={"QSERVE_CACHE_DIR": str(cache)}
    )
    assert proc.returncode == EXIT_GATE_FAILED, proc.stdout + proc.stderr[-3000:]
    assert "starting vLLM for the baseline" in proc.stderr
    refreshed = json.loads((ckpt / EVAL_NAME).read_text())
    assert refreshed["baseline_cache"] == {"hits": [], "misses": ["gsm8k_ppl"], "refresh": True}
    assert refreshed["gates"][0]["baseline"] == pytest.approx(w4["gates"][0]["baseline"], rel=1e-4)


@pytest.mark.slow
def test_bench_serves_and_measures_latency(passed_eval) -> None:
    proc = run_qserve("bench", passed_eval[0], "--num-prompts", "4", "--output-len", "8", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["completed"] == 4 and result["total_output_tokens"] == 4 * 8
    # vLLM's throughputs are its counts over its duration: recomputed here from the same record.
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / result["duration"], rel=1e-9)
    assert result["request_throughput"] == pytest.approx(4 / result["duration"], rel=1e-9)
    assert 0 < result["mean_ttft_ms"] <= result["p99_ttft_ms"] and 0 < result["mean_tpot_ms"] <= result["p99_tpot_ms"]
    assert result["mean_ttft_ms"] / 1000 < result["duration"]  # a first token comes before the run ends
    assert result["load"]["num_prompts"] == 4


def test_bench_needs_a_checkpoint_or_suite() -> None:
    proc = run_qserve("bench")
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: pass CHECKPOINT to benchmark, or --suite"


def test_a_failing_benchmark_command_names_itself_and_its_last_line() -> None:
    """The suite's measured commands run without a terminal: a failure says what failed and why."""
    import sys

    from qserve.bench.suite import measure
    from qserve.errors import QserveError

    with pytest.raises(QserveError) as failed:
        measure([sys.executable, "-c", "import sys\nprint('a library line', file=sys.stderr)\nsys.exit('boom: the cause')"])
    assert str(failed.value) == f"benchmark command failed (1): {sys.executable} -c <script>: boom: the cause"
    assert set(measure([sys.executable, "-c", "pass"])) == {"code", "seconds", "peak_rss_mib"}
