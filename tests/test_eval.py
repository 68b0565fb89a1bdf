"""`qserve eval`: real lm-eval through the real vLLM on local GSM8K, gates deciding both ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import EVAL_LIMIT, copy_checkpoint, run_qserve

from qserve.manifest import EVAL_NAME


@pytest.mark.slow
def test_eval_writes_results_and_passes(passed_eval) -> None:
    ckpt, summary = passed_eval
    on_disk = json.loads((ckpt / EVAL_NAME).read_text())
    assert on_disk == summary and summary["verdict"] == "pass"
    raw = json.loads((ckpt / "lm_eval_results.json").read_text())
    gates = {g["task"]: g for g in summary["gates"]}
    ppl = gates["gsm8k_ppl"]
    # The gate's numbers are lm-eval's numbers.
    assert ppl["baseline"] == raw["baseline"]["results"]["gsm8k_ppl"]["word_perplexity,none"]
    assert ppl["quantized"] == raw["quantized"]["results"]["gsm8k_ppl"]["word_perplexity,none"]
    assert ppl["baseline"] > 1 and abs(ppl["quantized"] / ppl["baseline"] - 1) < 0.1  # 8-bit: close either way
    assert ppl["recovery"] == pytest.approx(ppl["baseline"] / ppl["quantized"]) and ppl["status"] == "pass"
    assert raw["quantized"]["n-samples"]["gsm8k"]["effective"] == EVAL_LIMIT
    gsm = gates["gsm8k"]
    if gsm["baseline"] == 0:
        assert gsm["status"] == "inconclusive" and gsm["recovery"] is None
    else:
        assert gsm["status"] in ("pass", "fail")
    assert summary["engine_args"]["quantized"] == {
        "quantization": "compressed-tensors",
        "kv_cache_dtype": "auto",
        "dtype": "bfloat16",
        "trust_remote_code": False,
    }
    assert summary["engine_args"]["baseline"]["dtype"] == "float32"


@pytest.mark.slow
def test_eval_gate_fails_and_exits_nonzero(checkpoints, tmp_path: Path) -> None:
    # 4-bit weights cost a 135M model about a quarter of its perplexity: the recipe's 0.95 gate catches it.
    ckpt = copy_checkpoint(checkpoints["w4a16-gptq"], tmp_path / "ckpt")
    proc = run_qserve("eval", ckpt, "--tasks", "gsm8k_ppl", "--limit", str(EVAL_LIMIT))
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "verdict: FAIL" in proc.stdout
    summary = json.loads((ckpt / EVAL_NAME).read_text())
    gate = summary["gates"][0]
    assert summary["verdict"] == "fail" and gate["status"] == "fail" and gate["recovery"] < 0.95
    # ... and the same numbers pass a gate set below them: the decision follows the threshold.
    proc = run_qserve(
        "eval", ckpt, "--tasks", "gsm8k_ppl", "--limit", str(EVAL_LIMIT), "--gate", f"gsm8k_ppl={gate['recovery'] * 0.9:.3f}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((ckpt / EVAL_NAME).read_text())["gates"][0]["recovery"] == pytest.approx(gate["recovery"])


@pytest.mark.slow
def test_eval_defaults_to_last_quantized(checkpoints) -> None:
    # The session's last `qserve quantize` wrote the marker; an unknown task fails before any engine.
    proc = run_qserve("eval", "--tasks", "nope")
    assert proc.returncode == 1
    assert "using the most recent checkpoint" in proc.stderr
    assert "unknown task nope; available: gsm8k, gsm8k_ppl" in proc.stderr
