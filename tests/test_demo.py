"""The newcomer's first run: `make demo`'s own command passes its gate with margin and serves; a
second run reuses every step; the terminal shows qserve's steps, the logs hold the libraries' output;
a checkpoint reproduces bit for bit."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    DATA_DIR,
    DEMO,
    DEMO_LIMIT,
    DEMO_RECIPE,
    DEMO_TASKS,
    EXPECTED,
    REPO,
    DemoRun,
    expected_weighted_order,
    free_port,
    gsm8k_ppl_words,
    run_qserve,
    runs_here,
    support_here,
)

from qserve.checkpoint.manifest import EVAL_NAME, read_manifest
from qserve.gate import looks

# What qserve itself prints on stderr; a library line (loguru, vLLM logging, tqdm, warnings) is none of these.
QSERVE_LINE = re.compile(
    r"^(> |ok |x |  \.\.\. |reusing |quantizing: |checkpoint written to |baseline for |accuracy gate passed |stopped by |"
    r"warning: |note: |log: |execution: )"
)


@pytest.mark.slow
def test_the_demo_passes_with_margin_and_serves(demo_run: DemoRun) -> None:
    assert demo_run.returncode == 143, demo_run.stderr[-3000:]  # served, then stopped by SIGTERM
    record = json.loads((demo_run.ckpt / EVAL_NAME).read_text())
    assert record["verdict"] == "pass" and record["limit"] == DEMO_LIMIT and record["tasks"] == DEMO_TASKS.split(",")
    assert record["parity"]["status"] == "pass"
    for gate in record["gates"]:
        assert gate["criteria"] == {"min_recovery": 0.95}  # the default: nothing loosened
        assert (gate["status"], gate["signal"]) == ("pass", True)
        # With margin: the bet passed with a quarter of the documents scored still to spare.
        assert gate["evidence"]["criteria"]["min_recovery"]["items"] <= 0.75 * DEMO_LIMIT, gate["reason"]
        assert gate["test"] == (
            "betting without replacement (Waudby-Smith and Ramdas 2020) on 1319 items of the task, in the seeded order "
            "size-biased by words, on each document's loss change per word (within ±0.693 nats), at 5 % over every look"
        )
    order = "sha256(0, task, doc id), size-biased by lm-eval's word counts on word-perplexity tasks"
    assert f"verdict: PASS on {DEMO_LIMIT} items per task, a seeded random sample ({order})" in demo_run.stdout
    # --limit scored the first DEMO_LIMIT documents of the race by words (the rule recomputed here), on both models
    assert record["tasks"] == ["gsm8k_ppl"]
    assert record["doc_ids"]["gsm8k_ppl"] == sorted(expected_weighted_order("gsm8k_ppl", gsm8k_ppl_words())[:DEMO_LIMIT])
    # One command, each file read once: the checkpoint hashed once, the source model only by quantize.
    steps = [line for line in demo_run.stderr.splitlines() if line.startswith("ok hashing")]
    assert [step.split(" (")[0] for step in steps] == ["ok hashing checkpoint files"], steps
    # Beside the verdict: the screening KL against the baseline, and which look at these weights this was.
    assert record["parity"]["kl_to_baseline"]["mean_nats"] > 0
    kl, look = record["parity"]["kl_to_baseline"], record["look"]
    assert (
        f"screening (not a gate): mean KL(baseline || checkpoint) {kl['mean_nats']:.4f} nats per token "
        f"over {kl['positions']} positions of the parity prompts"
    ) in demo_run.stdout
    assert (
        f"look {look['number']} at these weights ({len(look['earlier'])} earlier gate runs): gates on scores in [0, 1] "
        f"and perplexities bet on a prefix of the seeded order at 5 % over every look; other bets and bounds are one-sided {1 - look['level']:.2%}, so that all looks "
        "together pass a model at its allowance at most 5 % of the time (for scores in [0, 1], 0/1 included, by "
        "betting and Ville's inequality, for every pattern of item scores (in a gate's declared score_range the same, "
        "for every item within it); for word and byte perplexity and bits per byte "
        "the same, for every loss within the cap of log 2 nats per word (per byte) on a document, and for lambada's "
        "perplexity within log 100 nats on an item; for other means, for the "
        "class of loss shapes docs/gate-levels.md covers (tails up to Pareto index 2.5, a loss in at least 5 % of documents))"
    ) in demo_run.stdout
    assert re.fullmatch(r"serving out-w8a8-int8 at http://127\.0\.0\.1:\d+/v1", demo_run.stdout[-2])
    # The serve log says what passed the gate, and which look at these weights it was.
    passed = f"qserve: accuracy gate passed (decided {record['decided_at']}, look {look['number']} at these weights)"
    assert demo_run.serve_log.splitlines()[0] == passed  # first, before the warm server's own lines
    assert look["history"][-1]["previous"] == (looks.digest(look["history"][-2]) if len(look["history"]) > 1 else None)


@pytest.mark.skipif(runs_here(DEMO, serve=True), reason="this CPU serves the demo's scheme: the test above runs the demo")
def test_where_vllm_cannot_serve_the_demos_scheme_the_demo_says_so_before_any_work(tmp_path: Path) -> None:
    """On such a CPU (an AVX2-only one for INT8) `make demo` ends at once, in one line naming the hardware."""
    out = tmp_path / "out"
    proc = run_qserve("run", DEMO_RECIPE, "--output", out, "--tasks", DEMO_TASKS, "--limit", DEMO_LIMIT, "--port", free_port())
    claim = support_here(DEMO)
    assert proc.returncode == 1 and not out.exists(), proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {EXPECTED[DEMO][0]} cannot be served on this machine ({claim.evidence}); it needs {claim.needs}. "
        "`qserve quantize` and `qserve eval` still run it"
    )


@pytest.mark.slow
def test_the_terminal_shows_qserve_steps_and_the_logs_hold_the_libraries(demo_run: DemoRun) -> None:
    strays = [line for line in demo_run.stderr.splitlines() if line.strip() and not QSERVE_LINE.match(line)]
    assert strays == []
    logs = demo_run.ckpt / "logs"
    assert "Compression lifecycle" in (logs / "quantize.log").read_text()  # llm-compressor's loguru
    assert "Processed prompts" in (logs / "eval.log").read_text()  # vLLM's tqdm
    served = demo_run.serve_log
    assert "Application startup complete" in served  # vLLM's API server
    # its interpreter imported vLLM while the gate ran (serve.server.warm_server), then served
    assert "qserve: vLLM imported at idle priority while the gate ran; starting the server with qserve's command line" in served
    assert "(EngineCore pid=" in served and "(Worker pid=" not in served  # its worker runs in the engine core


@pytest.mark.slow
def test_a_second_run_goes_straight_to_serving_and_ctrl_c_stops_it(demo_run: DemoRun) -> None:
    import socket

    again = DemoRun(demo_run.ckpt, ctrl_c_twice=True)
    assert again.returncode == 130, again.stderr[-3000:]  # 128 + SIGINT, as a shell reports an interrupted command
    assert again.stderr.splitlines()[-1] == "stopped by SIGINT"
    with pytest.raises(ConnectionRefusedError):  # the whole server is gone, not just qserve
        socket.create_connection(("127.0.0.1", again.port), timeout=5)
    assert f"reusing checkpoint {demo_run.ckpt}" in again.stderr
    assert "reusing the eval" in again.stderr and "(verdict: pass)" in again.stderr
    assert "> quantizing" not in again.stderr and "> starting vLLM for" not in again.stderr  # no quantize, no eval engine
    assert again.stdout[-2].startswith("serving out-w8a8-int8 at ")


@pytest.mark.slow
def test_a_changed_recipe_or_gate_is_not_reused(demo_run: DemoRun, tmp_path: Path, monkeypatch) -> None:
    from qserve.evaluate import evaluation
    from qserve.evaluate.evaluation import EvalOptions, reusable_eval
    from qserve.spec.gates import parse_cli_gates
    from qserve.workflows.run import why_stale

    recipe = REPO / DEMO_RECIPE
    assert why_stale(demo_run.ckpt, recipe, None, DATA_DIR, False) is None
    edited = tmp_path / "w8a8-int8.yaml"
    edited.write_text(recipe.read_text() + "# a comment changes the file, not the calibration\n")
    assert why_stale(demo_run.ckpt, edited, None, DATA_DIR, False) == f"{demo_run.ckpt} was made with a different recipe file"
    edited.write_text(recipe.read_text().replace("samples: 32", "samples: 16"))
    assert why_stale(demo_run.ckpt, edited, None, DATA_DIR, False).endswith("a different recipe file, calibration data")
    # The eval record answers only the question it decided.
    asked = {"tasks": DEMO_TASKS.split(","), "limit": DEMO_LIMIT, "data_dir": DATA_DIR}
    assert reusable_eval(demo_run.ckpt, EvalOptions(**asked)).verdict == "pass"
    assert reusable_eval(demo_run.ckpt, EvalOptions(**(asked | {"limit": DEMO_LIMIT + 1}))) is None
    assert reusable_eval(demo_run.ckpt, EvalOptions(**asked, check_parity=False)) is None
    stricter = parse_cli_gates(["gsm8k_ppl:max_increase=0.01"])
    assert reusable_eval(demo_run.ckpt, EvalOptions(**asked, gates=stricter)) is None
    monkeypatch.setattr(evaluation, "_scoring", lambda plan: test_a_changed_recipe_or_gate_is_not_reused)
    assert reusable_eval(demo_run.ckpt, EvalOptions(**asked)) is None  # another way of scoring


@pytest.mark.slow
def test_reproduce_is_bit_exact_and_names_what_differs(tiny_model: Path, tmp_path: Path) -> None:
    """A GPTQ checkpoint of a tiny model calibrated on 100 GSM8K lines: re-run on the same lines, every file
    is bit-exact; re-run on 100 other lines, the weights differ. (On the embedded model, the tuned recipe
    re-run through raw llm-compressor makes the same weights file byte for byte: test_quantize.py.)"""
    for name, lines in (("a", slice(0, 100)), ("b", slice(100, 200))):
        (tmp_path / name / "gsm8k").mkdir(parents=True)
        rows = (DATA_DIR / "gsm8k" / "train.jsonl").read_text().splitlines()[lines]
        (tmp_path / name / "gsm8k" / "train.jsonl").write_text("\n".join(rows) + "\n")
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        "name: tiny\nscheme: W4A16\nalgorithm: gptq\ngroup_size: 64\n"
        "calibration: {source: gsm8k-train, samples: 4, seq_len: 64}\n"
    )
    ckpt = tmp_path / "ckpt"
    proc = run_qserve("quantize", recipe, "--model", tiny_model, "--output", ckpt, "--data-dir", tmp_path / "a")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_qserve("reproduce", ckpt, "--data-dir", tmp_path / "a")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    manifest = read_manifest(ckpt)
    assert proc.stdout.strip() == f"{ckpt}: bit-exact ({len(manifest.files)} files re-created with identical SHA-256)"
    env = manifest.environment
    assert env["torch_threads"] >= 1 and env["device"].startswith("cpu: ") and len(env["source_model_sha256"]) == 64
    proc = run_qserve("reproduce", ckpt, "--data-dir", tmp_path / "b", "--json")
    assert proc.returncode == 3, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["bit_exact"] is False and result["calibration_data_same"] is False
    assert result["files"]["model.safetensors"] == "differs" and result["files"]["config.json"] == "same"
    diffs = result["tensors"]["model.safetensors"]
    # GPTQ's packed int4 weights and their scales move; the embedding (not quantized) does not.
    assert any(k.endswith("weight_packed") for k in diffs) and "model.embed_tokens.weight" not in diffs
    assert all(isinstance(v, float) and v > 0 for v in diffs.values())


CAPTURED = r"""
import os, sys, subprocess
from pathlib import Path
from qserve.runtime.capture import library_output
from qserve.cli._common import user_errors
from qserve.progress import info

@user_errors
def main(mode, log):
    with library_output(Path(log), verbose=mode == "verbose"):
        print("python stdout"); print("python stderr", file=sys.stderr); sys.stdout.flush(); sys.stderr.flush()
        os.write(1, b"native fd 1\n"); os.write(2, b"native fd 2\n")
        subprocess.run([sys.executable, "-c", "print('child process')"])
        info("a qserve step")
        if mode == "raise":
            raise RuntimeError("int8_scaled_mm_with_quant: expect A to be bfloat16 or half.\nmore")
        if mode == "abort":
            os.abort()
    print("the result")

try:
    main(sys.argv[1], sys.argv[2])
except Exception as exc:  # typer.Exit, as the CLI would turn it into an exit code
    sys.exit(exc.exit_code)
"""
LIBRARY = ["python stdout", "python stderr", "native fd 1", "native fd 2", "child process"]


NESTED = r"""
import sys
from pathlib import Path
from qserve.runtime.capture import library_output
from qserve.progress import info

with library_output(Path(sys.argv[1]) / "outer.log"):
    print("outer library", flush=True)
    info("outer step")
    with library_output(Path(sys.argv[1]) / "inner.log"):
        print("inner library", flush=True)
        info("inner step")
    info("outer again")
"""


def test_a_nested_library_output_keeps_qserves_lines_on_the_terminal(tmp_path: Path) -> None:
    # `qserve compare` logs to compare.log, and each recipe's quantize and eval to its own log inside it.
    proc = subprocess.run([sys.executable, "-c", NESTED, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr.splitlines()) == (0, "", ["outer step", "inner step", "outer again"])
    assert (tmp_path / "outer.log").read_text() == "outer library\n"
    assert (tmp_path / "inner.log").read_text() == "inner library\n"


@pytest.mark.parametrize("mode", ["quiet", "verbose", "raise", "abort"])
def test_library_output_goes_to_the_log(tmp_path: Path, mode: str) -> None:
    log = tmp_path / "eval.log"
    proc = subprocess.run([sys.executable, "-c", CAPTURED, mode, str(log)], capture_output=True, text=True, timeout=60)
    assert log.read_text().splitlines()[:5] == LIBRARY  # everything, in order, even when the process aborts
    shown = proc.stderr.splitlines()
    if mode == "quiet":
        assert (proc.returncode, proc.stdout, shown) == (0, "the result\n", ["a qserve step"])
    elif mode == "verbose":
        # the library lines are copied as the log grows, so they may trail qserve's own line
        assert (proc.returncode, sorted(shown)) == (0, sorted(["a qserve step", *LIBRARY]))
    elif mode == "raise":
        assert proc.returncode == 1 and proc.stdout == ""
        assert shown == [
            "a qserve step",
            f"error: RuntimeError: int8_scaled_mm_with_quant: expect A to be bfloat16 or half. (traceback in {log})",
        ]
        assert "Traceback (most recent call last)" in log.read_text()
    else:
        assert (proc.returncode, shown) == (-6, ["a qserve step"])
