"""`qserve gate --checkpoint`: a PASS on lm-eval runs made outside qserve lets `qserve serve` start.

The runs are real: lm-eval's own command line (`python -m lm_eval run`, its transformers backend, as
someone would run it on another machine) on the demo's INT8 checkpoint and on its source model, with
`--log_samples`, over a gsm8k_ppl task written here in lm-eval's YAML. Serve's acceptance is its own
check (serve.server.Checks, what `qserve serve` runs before it copies and starts vLLM).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import DATA_DIR, copy_checkpoint, run_qserve_in_process, shell_environment

from qserve.checkpoint.manifest import EVAL_NAME, MANIFEST_NAME, read_manifest
from qserve.errors import QserveError
from qserve.serve.server import Checks

# Two lm-eval runs through transformers (a minute or two): CI's second phase (make test-matrix);
# tests/test_gate_cli.py checks the same bindings on runs written in lm-eval's layout within make test.
pytestmark = [pytest.mark.slow, pytest.mark.matrix]
# lm-eval's --limit takes the first documents in file order, so the gate bets on those alone (a claim
# about them, which their last document decides exactly), at the look's share of 5 % (the demo's weights
# were looked at before); 80 is over the serve policy's minimum of 69 items. On these 80 the word
# perplexity moved -0.67 % where +5.26 % is allowed, and the bet passed at the 2nd look's 0.76 % after 57
# of them (both runs in bfloat16 through transformers, 2026-12-07, AMD EPYC with AVX-512 BF16).
LIMIT = 80
# The demo recipe's gated task, as an lm-eval task file (the same text as qserve's evals/gsm8k_ppl.yaml).
TASK = {
    "task": "gsm8k_ppl",
    "dataset_path": "json",
    "dataset_kwargs": {"data_files": {"test": str(DATA_DIR / "gsm8k" / "test.jsonl")}},
    "test_split": "test",
    "output_type": "loglikelihood_rolling",
    "doc_to_text": "",
    "doc_to_target": "Question: {{question}}\nAnswer: {{answer}}",
    "metric_list": [{"metric": "word_perplexity"}],
    "metadata": {"version": 1.0},
}


@dataclass(frozen=True)
class Outside:
    ckpt: Path
    base: Path
    quant: Path
    base_args: str
    quant_args: str


def _lm_eval(model_args: str, tasks: Path, out: Path, scratch: Path) -> Path:
    """lm-eval's command line, run as a user runs it: the transformers backend, offline, on CPU."""
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args", model_args, "--tasks", "gsm8k_ppl"]
    cmd += ["--include_path", str(tasks), "--limit", str(LIMIT), "--batch_size", "8", "--device", "cpu"]
    cmd += ["--log_samples", "--output_path", str(out)]
    env = shell_environment() | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(scratch)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def outside(passed_eval, tmp_path_factory) -> Outside:
    """A copy of the demo checkpoint without its own eval record, and lm-eval's runs on it and on its source."""
    root = tmp_path_factory.mktemp("outside")
    ckpt = copy_checkpoint(passed_eval[0], root / "out-w8a8-int8")
    (ckpt / EVAL_NAME).unlink()  # qserve's own PASS: what lets it serve must be the outside runs
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "gsm8k_ppl.yaml").write_text(yaml.safe_dump(TASK))
    source = read_manifest(ckpt).source_model["path"]
    base_args, quant_args = f"pretrained={source},dtype=bfloat16", f"pretrained={ckpt},dtype=bfloat16"
    base = _lm_eval(base_args, tasks, root / "runs" / "base", root / "hf-datasets")
    quant = _lm_eval(quant_args, tasks, root / "runs" / "quant", root / "hf-datasets")
    return Outside(ckpt, base, quant, base_args, quant_args)


def _results(run: Path) -> dict:
    return json.loads(next(run.rglob("results_*.json")).read_text())


def _state(ckpt: Path) -> bytes | None:
    """The checkpoint's eval record as bytes (None: there is none), to show a refusal wrote nothing."""
    path = ckpt / EVAL_NAME
    return path.read_bytes() if path.is_file() else None


def test_a_pass_on_outside_runs_lets_serve_start(outside: Outside) -> None:
    ckpt = outside.ckpt
    with pytest.raises(QserveError) as refused:  # no record yet (the others here only refuse): serve refuses
        Checks().run(ckpt)
    assert str(refused.value) == f"{ckpt} has no accuracy gate result; run `qserve eval {ckpt}` first (or pass --skip-gate)"
    proc = run_qserve_in_process("gate", outside.base, outside.quant, "--checkpoint", ckpt)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "verdict: PASS"
    record = json.loads((ckpt / EVAL_NAME).read_text())
    assert record["manifest_sha256"] == hashlib.sha256((ckpt / MANIFEST_NAME).read_bytes()).hexdigest()
    assert (record["verdict"], record["engine"], record["emulated"]) == ("pass", "transformers", True)
    (gate,) = record["gates"]
    # The scores are lm-eval's, as its results files state them; the criteria the recipe's own gate.
    base_score, quant_score = (_results(r)["results"]["gsm8k_ppl"]["word_perplexity,none"] for r in (outside.base, outside.quant))
    assert (gate["task"], gate["metric"], gate["items"], gate["criteria"]) == (
        "gsm8k_ppl",
        "word_perplexity,none",
        LIMIT,
        {"min_recovery": 0.95},
    )
    assert gate["test"].startswith(
        f"betting without replacement (Waudby-Smith and Ramdas 2020) on the {LIMIT} scored items (a claim about them), "
        "in the seeded order size-biased by words"
    )
    assert (gate["evidence"]["population"], gate["evidence"]["whole"]) == (LIMIT, False)
    assert (gate["baseline"], gate["quantized"]) == (base_score, quant_score)
    runs = record["outside_runs"]
    for side, run, args in (("baseline", outside.base, outside.base_args), ("quantized", outside.quant, outside.quant_args)):
        pretrained = args.split(",")[0].removeprefix("pretrained=")
        assert runs[side]["model_args"] == {"pretrained": pretrained, "dtype": "bfloat16"}  # lm-eval's CLI writes a dict
        assert (runs[side]["model"], runs[side]["lm_eval_version"]) == ("hf", importlib.metadata.version("lm_eval"))
        assert Path(runs[side]["results"]).parent.parent == run.resolve()  # <output_path>/<model>/results_<date>.json
    notes = Checks().run(ckpt)  # what `qserve serve` checks before it starts vLLM
    assert notes == [f"accuracy gate passed (decided {record['decided_at']}, look {record['look']['number']} at these weights)"]


def test_runs_of_another_model_cannot_authorize_the_checkpoint(outside: Outside) -> None:
    """The source model's run given as the quantized one (a perfect "recovery"), and the checkpoint's as
    the baseline: each refused in one line, before deciding, nothing written."""
    ckpt, before = outside.ckpt, _state(outside.ckpt)
    base_results, quant_results = (next(r.rglob("results_*.json")) for r in (outside.base, outside.quant))
    source = read_manifest(ckpt).source_model
    proc = run_qserve_in_process("gate", outside.base, outside.base, "--checkpoint", ckpt)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"error: the quantized run {base_results} evaluated {source['path']}, not the checkpoint {ckpt.resolve()}: "
        "its gate cannot authorize this checkpoint"
    )
    proc = run_qserve_in_process("gate", outside.quant, outside.quant, "--checkpoint", ckpt)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"error: the baseline run {quant_results} evaluated {ckpt}, not {ckpt}'s source model {source['id']} "
        f"({source['path']}): the gate would compare the checkpoint with another model"
    )
    assert _state(ckpt) == before


def test_a_swapped_checkpoint_file_is_refused(outside: Outside) -> None:
    """The source model's weights put in place of the checkpoint's: its runs no longer vouch for it."""
    ckpt, before = outside.ckpt, _state(outside.ckpt)
    weights = ckpt / "model.safetensors"
    kept = ckpt.parent / "kept.safetensors"
    weights.replace(kept)
    try:
        shutil.copy(Path(read_manifest(ckpt).source_model["path"]) / "model.safetensors", weights)
        proc = run_qserve_in_process("gate", outside.base, outside.quant, "--checkpoint", ckpt)
    finally:
        kept.replace(weights)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"error: checkpoint {ckpt} does not match its manifest (changed model.safetensors): it was modified after quantization"
    )
    assert proc.stdout == "" and _state(ckpt) == before
