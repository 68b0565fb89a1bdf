"""`qserve eval`: real lm-eval through the real vLLM on local GSM8K; cached baselines, gates
deciding both ways, a damaged checkpoint caught, and reports that agree with lm-eval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import (
    BASELINE_DTYPE,
    DEMO_LIMIT,
    DEMO_TASKS,
    EVAL_LIMIT,
    FAIL_LIMIT,
    copy_checkpoint,
    free_port,
    run_qserve,
    run_qserve_in_process,
    small_manifest,
)

from qserve.checkpoint.manifest import EVAL_NAME, LM_EVAL_RESULTS_NAME, hash_files, read_manifest, write_manifest
from qserve.gate import looks
from qserve.gate.card import CARD_NAME, gate_rows
from qserve.gate.decisions import Gate
from qserve.gate.reports import REPORT_NAME


@pytest.mark.slow
def test_eval_writes_results_and_passes(passed_eval) -> None:
    ckpt, summary = passed_eval
    on_disk = json.loads((ckpt / EVAL_NAME).read_text())
    assert on_disk == summary and summary["verdict"] == "pass"
    raw = json.loads((ckpt / LM_EVAL_RESULTS_NAME).read_text())
    gates = {g["task"]: g for g in summary["gates"]}
    assert DEMO_TASKS == "gsm8k_ppl" and set(gates) == {"gsm8k_ppl"}
    for task, gate in gates.items():
        # The gate's numbers are lm-eval's numbers.
        assert gate["baseline"] == raw["baseline"]["results"][task][gate["metric"]]
        assert gate["quantized"] == raw["quantized"]["results"][task][gate["metric"]]
        assert raw["quantized"]["n-samples"][task]["effective"] == DEMO_LIMIT
    ppl = gates["gsm8k_ppl"]
    assert ppl["baseline"] > 1 and abs(ppl["quantized"] / ppl["baseline"] - 1) < 0.1  # 8-bit: close either way
    assert ppl["recovery"] == pytest.approx(ppl["baseline"] / ppl["quantized"]) and ppl["status"] == "pass"
    # lm-eval has no stderr for perplexity; qserve linearizes one, and the paired noise is tighter.
    assert ppl["baseline_stderr"] > 0 and 0 < ppl["degradation_stderr"] < ppl["baseline_stderr"]
    assert ppl["test"].startswith("betting without replacement (Waudby-Smith and Ramdas 2020) on 1319 items of the task")
    bet = ppl["evidence"]["criteria"]["min_recovery"]
    assert bet["decision"] == "pass" and bet["wealth_pass"] >= 20 == ppl["evidence"]["threshold"] and bet["items"] <= DEMO_LIMIT
    assert summary["parity"]["status"] == "pass" and summary["emulated"] is False
    assert summary["engine_args"]["quantized"] == {
        "quantization": "compressed-tensors",
        "kv_cache_dtype": "auto",
        "dtype": "bfloat16",
        "trust_remote_code": False,
    }
    # As vLLM serves the source model (auto: bfloat16), in float32 on a CPU without a bfloat16 kernel.
    assert summary["engine_args"]["baseline"]["dtype"] == BASELINE_DTYPE[0]
    # Both sides scored by qserve's lm-eval class, named with the hash of its source (as the baseline key is).
    name, source_sha = summary["scoring"].split(":")
    assert name == "qserve.engines.vllm.lm_eval_vllm_class" and len(source_sha) == 16


@pytest.mark.slow
def test_gsm8k_on_a_135m_model_has_no_signal(passed_eval, tmp_path: Path) -> None:
    """lm-eval's own 5-shot GSM8K on local data: SmolLM2-135M does not solve the first problem,
    quantized or not, so the gate has nothing to judge by: a warning, and never a pass on its own.
    (Why the demo gates on perplexity instead.)"""
    ckpt = copy_checkpoint(passed_eval[0], tmp_path / "ckpt")
    proc = run_qserve_in_process("eval", ckpt, "--tasks", "gsm8k", "--limit", "1", "--no-parity", "--json")
    assert proc.returncode == 4, proc.stderr[-3000:]
    gsm = json.loads(proc.stdout)["gates"][0]
    assert (gsm["baseline"], gsm["quantized"], gsm["recovery"]) == (0.0, 0.0, None)
    assert (gsm["status"], gsm["signal"]) == ("inconclusive", False)


@pytest.mark.slow
def test_reports_agree_with_the_summary(passed_eval) -> None:
    ckpt, summary = passed_eval
    report = (ckpt / REPORT_NAME).read_text()
    card = (ckpt / CARD_NAME).read_text()
    assert f"**Verdict: {summary['verdict'].upper()}**" in report
    for row in gate_rows([Gate(**g) for g in summary["gates"]])[1:]:
        line = "| " + " | ".join(row) + " |"
        assert line in report and line in card
    assert f"vllm serve {ckpt.resolve()} --quantization compressed-tensors --kv-cache-dtype auto --dtype bfloat16" in card
    assert "32 samples of 256 tokens" in card  # the calibration the manifest recorded


@pytest.mark.slow
def test_eval_without_evidence_is_inconclusive(passed_eval, tmp_path: Path) -> None:
    """gsm8k_mc at 10 items of the seeded order: the quantized model loses items the baseline answers
    (one or two, by the CPU's kernels), 10 points or more against the 3.5 a 0.95 recovery of the
    baseline's score (70 % here) allows: exceeded, but 10 items of the task are too few for the bettors to decide, so inconclusive,
    and at those flip rates more items would not pass it. The perplexity gate (+5 %) is too: at the log 2
    cap a document within +5 % of the baseline multiplies the pass wealth by at most 1.04 or so, and 10 of
    them cannot reach 20."""
    ckpt = copy_checkpoint(passed_eval[0], tmp_path / "ckpt")  # the shared one keeps its passing record
    earlier = looks.earlier(read_manifest(ckpt))  # the demo's gate, and any other eval of these weights so far
    tasks = "gsm8k_ppl,gsm8k_mc"
    wide = "gsm8k_ppl:max_increase=0.05"
    proc = run_qserve_in_process(
        "eval", ckpt, "--tasks", tasks, "--limit", str(EVAL_LIMIT), "--gate", wide, "--no-parity", "--json"
    )
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    # Another look at the same weights: counted, and decided at a smaller level (looks.py).
    assert len(earlier) >= 1 and summary["look"]["number"] == len(earlier) + 1
    assert summary["look"]["level"] == looks.level(len(earlier) + 1) < looks.level(1)
    assert len(looks.earlier(read_manifest(ckpt))) == len(earlier) + 1
    gates = {g["task"]: g for g in summary["gates"]}
    mc = gates["gsm8k_mc"]
    raw = json.loads((ckpt / LM_EVAL_RESULTS_NAME).read_text())
    assert mc["baseline_stderr"] == raw["baseline"]["results"]["gsm8k_mc"]["acc_stderr,none"]  # lm-eval's own
    assert (summary["verdict"], gates["gsm8k_ppl"]["status"], mc["status"], mc["signal"]) == (
        "inconclusive",
        "inconclusive",
        "inconclusive",
        True,
    )
    ppl = gates["gsm8k_ppl"]
    bet = ppl["evidence"]["criteria"]["max_increase"]
    assert (ppl["items"], bet["items"], bet["decision"]) == (EVAL_LIMIT, EVAL_LIMIT, "inconclusive") and bet["wealth_pass"] < 20
    assert ppl["items_needed"] > EVAL_LIMIT
    assert (
        mc["test"]
        == "betting without replacement (Waudby-Smith and Ramdas 2020) on 1319 items of the task, in the seeded order, at 5 % over every look"
    )
    scores = {side: raw[side]["results"]["gsm8k_mc"]["acc,none"] for side in ("baseline", "quantized")}
    # The flips are lm-eval's own scores item by item (how many depends on the CPU's INT8 kernels: 1 lost
    # on a VNNI host, 2 on an AMX one), and they exceed the 0.95 recovery's allowance.
    lost, gained = mc["flips"]["lost"], mc["flips"]["gained"]
    assert (lost - gained) / EVAL_LIMIT == pytest.approx(scores["baseline"] - scores["quantized"])
    assert (lost - gained) / EVAL_LIMIT > 0.05 * scores["baseline"] and mc["items_needed"] is None
    assert mc["reason"].endswith("fewer than 4 runs in 5 would pass, even on all 1319 items (simulated) (--limit)")
    assert mc["evidence"]["criteria"]["min_recovery"]["items"] == EVAL_LIMIT
    # ... and is not served.
    proc = run_qserve("serve", ckpt, "--port", str(free_port()))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {ckpt} did not pass its accuracy gate (verdict: inconclusive); see `qserve eval {ckpt}` (or pass --skip-gate)"
    )


@pytest.mark.slow
def test_parallel_flags_reach_vllms_engine_config(passed_eval, tmp_path: Path) -> None:
    """`qserve eval -tp 2` hands tensor_parallel_size=2 to vLLM: SmolLM2's 9 attention heads do not split
    in two, and vLLM's own config check says so, in one line; the checkpoint's gate record is untouched."""
    ckpt = copy_checkpoint(passed_eval[0], tmp_path / "ckpt")
    record = (ckpt / EVAL_NAME).read_bytes()
    proc = run_qserve_in_process("eval", ckpt, "-tp", "2", "--tasks", "gsm8k_ppl", "--limit", "1", "--no-parity")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: ValidationError: Value error, Total number of attention heads (9) must be divisible by tensor "
        f"parallel size (2). (traceback in {ckpt / 'logs' / 'eval.log'})"
    )
    assert (ckpt / EVAL_NAME).read_bytes() == record


def test_data_parallel_eval_on_a_cpu_is_refused_before_any_work(passed_eval, tmp_path: Path) -> None:
    """lm-eval places each `-dp` replica as a Ray task reserving a GPU (its vllm_causallms.py): on this CPU
    host Ray would wait for one forever (seen: its autoscaler repeating "No available node types can fulfill
    resource request {'GPU': 1.0, 'CPU': 1.0}" for 10 minutes). Refused before the checkpoint is hashed."""
    ckpt = copy_checkpoint(passed_eval[0], tmp_path / "ckpt")
    record, log = (ckpt / EVAL_NAME).read_bytes(), (ckpt / "logs" / "eval.log").read_bytes()
    proc = run_qserve_in_process("eval", ckpt, "-dp", "2", "--tasks", "gsm8k_ppl", "--limit", "1", "--no-parity")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: -dp 2: lm-eval runs each data-parallel replica as a Ray task that reserves 1 GPU, and this host has "
        "none (vLLM CPU build), so Ray would wait forever; evaluate with -dp 1 "
        "(`qserve serve CKPT -- --data-parallel-size 2` runs vLLM's own replicas on CPUs)"
    ]
    assert (ckpt / EVAL_NAME).read_bytes() == record and (ckpt / "logs" / "eval.log").read_bytes() == log


@pytest.mark.slow
def test_inspect_reports_size_args_and_gate(passed_eval) -> None:
    ckpt, summary = passed_eval
    proc = run_qserve("inspect", ckpt, "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["scheme"] == "W8A8" and info["integrity"] == "ok"
    assert info["gate"]["status"] == "pass" and info["gate"]["decided_at"] == summary["decided_at"]
    assert info["vllm_args"]["quantization"] == "compressed-tensors"
    # 106.2 M Linear weights at one byte (plus per-channel scales), the 28.3 M embedding and norms in
    # bfloat16 like the source: (106.2 + 2 * 28.3) / (2 * 134.5) = 0.605 of the bfloat16 source.
    assert 0.60 < info["size_vs_bf16"] < 0.62 and 0.60 < info["size_vs_baseline"] < 0.62
    text = run_qserve("inspect", ckpt).stdout
    assert "gate:         pass (decided" in text and "size_vs" not in text


def _damage_scales(ckpt: Path, spread: float = 0.05) -> None:
    """Perturb every weight scale (a quantizer bug, not tampering: the manifest is re-hashed)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if name.endswith("weight_scale"):
            noise = 1 + spread * torch.randn(t.shape, generator=gen)
            tensors[name] = (t.float() * noise.clamp(min=0.1)).to(t.dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    manifest = read_manifest(ckpt)
    write_manifest(ckpt, manifest.model_copy(update={"files": hash_files(ckpt)}))


@pytest.mark.slow
def test_damaged_checkpoint_fails_the_perplexity_gate(passed_eval, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(passed_eval[0], tmp_path / "ckpt")
    _damage_scales(ckpt)
    proc = run_qserve_in_process("eval", ckpt, "--tasks", "gsm8k_ppl", "--limit", str(FAIL_LIMIT), "--json")
    assert proc.returncode == 3, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    gate = summary["gates"][0]
    assert gate["status"] == "fail" and "degradation > allowance" in gate["reason"]
    assert gate["quantized"] > 1.1 * gate["baseline"]  # measured: +24% perplexity from 5% scale noise
    # vLLM still runs the damaged weights faithfully: parity passes, the gate is what catches it.
    assert summary["parity"]["status"] == "pass"
    assert json.loads(run_qserve("inspect", ckpt, "--json").stdout)["gate"]["status"] == "fail"


@pytest.mark.slow
def test_eval_defaults_to_last_quantized(checkpoints) -> None:
    # The session's last `qserve quantize` wrote the marker; an unknown task fails before any engine.
    proc = run_qserve("eval", "--tasks", "nope")
    assert proc.returncode == 1
    assert "using the most recent checkpoint" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: unknown task nope (closest names lm-eval and qserve know: ")


def test_model_card_metadata_is_what_the_hub_reads(tmp_path: Path) -> None:
    """The card's YAML block, read by huggingface_hub's own ModelCard: base model, library, tags,
    quantization, and each gate as a model-index result."""
    from conftest import gate_record
    from huggingface_hub import ModelCard

    from qserve.gate.card import model_card
    from qserve.gate.schema import EvalRecord

    source = {"id": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    manifest = small_manifest(recipe={"name": "w8a8-int8"}, source_model=source, kv_cache_dtype="auto", dtype="bfloat16")
    record = {
        "manifest_sha256": "m",
        "verdict": "pass",
        "decided_at": "d",
        "parity": {"status": "pass"},
        "gates": [gate_record(items=100)],
    }
    card = ModelCard(model_card(tmp_path / "out-w8a8-int8", manifest, EvalRecord.model_validate(record)))
    data = card.data
    assert (data.base_model, data.base_model_relation, data.library_name) == (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "quantized",
        "transformers",
    )
    assert data.tags == ["qserve", "quantized", "w8a8", "compressed-tensors", "llm-compressor", "vllm"]
    assert data.to_dict()["quantization"]["kv_cache_dtype"] == "auto"
    (result,) = data.eval_results
    assert (result.task_type, result.dataset_type, result.metric_type, result.metric_value) == (
        "text-generation",
        "gsm8k_ppl",
        "word_perplexity",
        10.1,
    )
    assert data.model_name == "out-w8a8-int8" and card.text.lstrip().startswith("# out-w8a8-int8")
    local = manifest.model_copy(update={"source_model": {"id": str(tmp_path)}})  # a local model: no base_model
    assert ModelCard(model_card(tmp_path / "x", local, None)).data.base_model is None
