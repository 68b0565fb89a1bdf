"""Every check before any work (issue "One typed path"): each mistake below ends in one `error:` line,
exit 1, writes nothing and deletes nothing; the ones that used to surface after minutes of work, or
as a traceback, or as a gate that could not fail."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, copy_checkpoint, run_qserve, run_qserve_in_process
from test_gate_cli import _pair

DEMO_RECIPE = REPO / "recipes" / "w8a8-int8.yaml"
# For `run`'s checks: FP8_DYNAMIC, which every CPU met serves, so no hardware refusal (W8A8 without VNNI)
# comes before the check a test is about.
SERVED_EVERYWHERE = REPO / "recipes" / "fp8.yaml"


def _one_error(proc, line: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == line
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("gate", "line"),
    [
        (
            "qa_task=1.01",
            "error: --gate for qa_task: min_recovery 1.01 is above 1, which asks the quantized model to beat the baseline; give at most 1",
        ),
        (
            "qa_task:max_drop=1",
            "error: gate on qa_task: max_drop=1 on exact_match, a proportion between 0 and 1, can never fail; give a drop below 1 (0.02 is 2 points)",
        ),
    ],
)
def test_an_allowance_the_metric_cannot_exceed_is_refused(tmp_path: Path, gate: str, line: str) -> None:
    base, quant, *_ = _pair(tmp_path)
    _one_error(run_qserve_in_process("gate", base, quant, "--tasks", "qa_task", "--gate", gate), line)


def test_a_zero_one_metric_by_another_name_cannot_get_an_allowance_of_one(tmp_path: Path) -> None:
    """The name list is a first filter; the decision itself refuses any 0/1 metric's allowance >= 1."""
    from qserve.errors import InvalidSpec
    from qserve.gate import stats
    from qserve.gate.decisions import decide
    from qserve.spec.gates import GateSpec

    base, quant = [1.0] * 60 + [0.0] * 40, [1.0] * 30 + [0.0] * 70
    items = {str(i): (b, q) for i, (b, q) in enumerate(zip(base, quant))}
    cmp = stats.compare(
        "pass_rate,none",
        True,
        (0.6, None, {k: v[0] for k, v in items.items()}),
        (0.3, None, {k: v[1] for k, v in items.items()}),
        0.05,
    )
    with pytest.raises(
        InvalidSpec, match=r"^gate on t: an allowed drop of 1 on pass_rate,none, whose items score 0 or 1, can never fail"
    ):
        decide("t", GateSpec(max_drop=1.0), cmp)


def test_a_task_typo_leaves_the_earlier_eval_log_as_it_was(passed_eval, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(passed_eval[0], tmp_path / "ckpt")
    log = ckpt / "logs" / "eval.log"
    before = log.read_bytes()
    for args in (["--tasks", "gsm8k_pp"], ["--tasks", "gsm8k_ppl", "--kv-cache-dtype", "bogus"]):
        proc = run_qserve_in_process("eval", ckpt, "--limit", "2", *args)
        # the last line (a first unknown name may build lm-eval's task index, a step line before it)
        assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("error: "), proc.stderr
        assert log.read_bytes() == before
        assert sorted(p.name for p in log.parent.iterdir()) == sorted(p.name for p in (passed_eval[0] / "logs").iterdir())


def test_run_finds_a_task_typo_before_it_quantizes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_qserve_in_process("run", SERVED_EVERYWHERE, "--tasks", "gsm8k_pp", "--output", out)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("error: unknown task gsm8k_pp"), proc.stderr
    assert "quantizing" not in proc.stderr and not out.exists()


def test_compare_checks_its_recipes_before_it_converts_or_writes(tmp_path: Path) -> None:
    proc = run_qserve("compare", "nope.yaml", DEMO_RECIPE, cwd=tmp_path, timeout=120)
    _one_error(proc, "error: recipe nope.yaml does not exist")
    assert list(tmp_path.iterdir()) == [] and "converting" not in proc.stderr


def test_quantize_refuses_an_output_under_a_file_before_any_work(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    proc = run_qserve_in_process("quantize", DEMO_RECIPE, "--output", tmp_path / "a-file" / "out")
    _one_error(proc, f"error: --output {tmp_path / 'a-file' / 'out'}: {tmp_path / 'a-file'} is a file, not a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"] and "converting" not in proc.stderr


def test_quantize_refuses_missing_calibration_data_before_any_work(tmp_path: Path) -> None:
    proc = run_qserve_in_process("quantize", DEMO_RECIPE, "--output", tmp_path / "out", "--data-dir", tmp_path)
    line = (
        f"error: calibration data {tmp_path / 'gsm8k' / 'train.jsonl'} does not exist "
        f"(relative paths resolve against --data-dir / QSERVE_DATA_DIR, now {tmp_path})"
    )
    _one_error(proc, line)
    assert list(tmp_path.iterdir()) == [] and "converting" not in proc.stderr


def test_a_cache_dir_that_is_a_file_is_named_as_the_variable(tmp_path: Path) -> None:
    (tmp_path / "cache").write_text("x")
    proc = run_qserve_in_process("eval", tmp_path / "nothing", env={"QSERVE_CACHE_DIR": str(tmp_path / "cache")})
    _one_error(
        proc, f"error: QSERVE_CACHE_DIR={tmp_path / 'cache'} is not a directory; point it at a directory qserve may create or use"
    )


def test_serve_checks_vllm_options_before_it_opens_the_checkpoint(tmp_path: Path) -> None:
    """The checkpoint does not even exist: the options after `--` are refused first."""
    proc = run_qserve_in_process("serve", tmp_path / "no-checkpoint", "--skip-gate", "--", "--bogus-flag", "1")
    _one_error(proc, "error: vLLM does not accept the options after `--`: unrecognized arguments: --bogus-flag 1")


@pytest.mark.parametrize("command", ["run", "quantize"])
def test_a_recipe_gate_on_an_unknown_task_is_found_before_quantizing(tmp_path: Path, command: str) -> None:
    recipe, out = tmp_path / "r.yaml", tmp_path / "out"
    text = SERVED_EVERYWHERE.read_text()
    assert "  gsm8k_ppl: 0.95" in text
    recipe.write_text(text.replace("  gsm8k_ppl: 0.95", "  gsm8k_pp: 0.95"))
    proc = run_qserve_in_process(command, recipe, "--output", out)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("error: unknown task gsm8k_pp"), proc.stderr
    assert "quantizing" not in proc.stderr and not out.exists()
