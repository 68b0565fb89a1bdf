"""`qserve gate`: the same paired gate on two lm-eval `--log_samples` outputs made elsewhere.

The runs are written here in lm-eval's own layout (results_<date>.json beside
samples_<task>_<date>.jsonl, under a folder per model), with per-item values drawn from a seed;
the bounds are recomputed from their definition, not read back from qserve.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
from conftest import run_qserve_in_process
from scipy.stats import t as t_dist

from qserve.errors import EXIT_GATE_INCONCLUSIVE


def _run(root: Path, name: str, lls: list[float], words: list[int], exact: list[float]) -> Path:
    folder = root / name / "org__model"
    folder.mkdir(parents=True)
    ppl = math.exp(-sum(lls) / sum(words))
    results = {
        "results": {
            "ppl_task": {"alias": "ppl_task", "word_perplexity,none": ppl, "word_perplexity_stderr,none": "N/A"},
            "qa_task": {
                "alias": "qa_task",
                "exact_match,strict-match": sum(exact) / len(exact),
                "exact_match_stderr,strict-match": 0.03,
            },
        },
        "higher_is_better": {"ppl_task": {"word_perplexity": False}, "qa_task": {"exact_match": True}},
    }
    (folder / "results_2026-11-24T10-00-00.json").write_text(json.dumps(results))
    ppl_lines = [{"doc_id": i, "filter": "none", "word_perplexity": [ll, w]} for i, (ll, w) in enumerate(zip(lls, words))]
    qa_lines = [{"doc_id": i, "filter": "strict-match", "exact_match": v} for i, v in enumerate(exact)]
    for task, lines in (("ppl_task", ppl_lines), ("qa_task", qa_lines)):
        (folder / f"samples_{task}_2026-11-24T10-00-00.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root / name


def _pair(tmp_path: Path, n: int = 120) -> tuple[Path, Path, np.ndarray, np.ndarray, np.ndarray]:
    rng = random.Random(0)
    words = [rng.randint(20, 200) for _ in range(n)]
    base = [-2.0 * w + rng.gauss(0, 3) for w in words]
    quant = [b - 0.02 * w + rng.gauss(0, 2) for b, w in zip(base, words)]  # about +2 % perplexity
    exact_b = [float(i < 0.6 * n) for i in range(n)]
    exact_q = [0.0 if i in (3, 9, 27, 40) else 1.0 if i == n - 1 else v for i, v in enumerate(exact_b)]  # 4 lost, 1 gained
    b = _run(tmp_path, "base", base, words, exact_b)
    q = _run(tmp_path, "quant", quant, words, exact_q)
    return b, q, np.array(base), np.array(quant), np.array(words, dtype=float)


def test_gate_on_two_lm_eval_runs_matches_the_definition(tmp_path: Path) -> None:
    b, q, ll_b, ll_q, w = _pair(tmp_path)
    out = tmp_path / "gate.json"
    proc = run_qserve_in_process("gate", b, q, "--tasks", "ppl_task", "--gate", "ppl_task:max_increase=0.05", "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    (gate,) = record["gates"]
    d = ll_b - ll_q
    r = d.sum() / w.sum()
    e = (d - r * w) / w.mean()
    n = len(d)
    centre = r + (e**3).mean() / (6 * (e**2).mean() * n)
    half = t_dist.ppf(1 - 0.05 * 6 / math.pi**2, n - 1) * math.sqrt((e**2).sum() / (n - 1) / n)  # a first look
    assert abs(gate["bounds"]["upper"] - math.expm1(centre + half)) < 1e-12
    assert abs(gate["bounds"]["lower"] - math.expm1(centre - half)) < 1e-12
    assert (record["verdict"], gate["status"], gate["items"], gate["higher_is_better"]) == ("pass", "pass", 120, False)
    assert proc.stdout.strip().splitlines()[-1] == "verdict: PASS"


def test_gate_on_0_1_items_reports_flips_and_is_inconclusive_when_too_close(tmp_path: Path) -> None:
    b, q, *_ = _pair(tmp_path)
    proc = run_qserve_in_process("gate", b, q, "--tasks", "qa_task", "--json")
    assert proc.returncode == EXIT_GATE_INCONCLUSIVE, proc.stderr
    (gate,) = json.loads(proc.stdout)["gates"]
    assert gate["flips"] == {"lost": 4, "gained": 1}
    assert gate["test"] == "exact unconditional score test on discordant items (4 lost, 1 gained of 120)"
    assert gate["reason"].startswith("degradation 0.025 vs allowed 0.03: too close to call")


def test_gate_refuses_runs_on_different_items_and_runs_without_samples(tmp_path: Path) -> None:
    b, q, *_ = _pair(tmp_path)
    samples = next(q.rglob("samples_ppl_task_*.jsonl"))
    samples.write_text("".join(samples.read_text().splitlines(keepends=True)[:100]))
    proc = run_qserve_in_process("gate", b, q, "--tasks", "ppl_task")
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "error: ppl_task: the runs scored different items (120 in the baseline, 100 quantized, 100 in common); "
        "run both with the same --limit and data"
    )
    samples.unlink()
    proc = run_qserve_in_process("gate", b, q, "--tasks", "ppl_task")
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: {samples.parent} has no samples_ppl_task_*.jsonl: run lm-eval with --log_samples"
