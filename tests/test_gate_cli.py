"""`qserve gate`: the same paired gate on two lm-eval `--log_samples` outputs made elsewhere.

The runs are written here in lm-eval's own layout (results_<date>.json beside
samples_<task>_<date>.jsonl, under a folder per model), with per-item values drawn from a seed;
the bounds are recomputed from their definition, not read back from qserve.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
from conftest import expected_order, run_qserve_in_process, small_manifest
from scipy.stats import t as t_dist

from qserve.checkpoint.manifest import EVAL_NAME, MANIFEST_NAME, hash_files, write_manifest
from qserve.errors import EXIT_GATE_INCONCLUSIVE, QserveError


def _run(
    root: Path,
    name: str,
    lls: list[float],
    words: list[int],
    exact: list[float],
    qa_size: int | None = None,
    ppl_size: int | None = None,
) -> Path:
    """`qa_size`: qa_task has that many documents and the run scored the first of its seeded order (as
    `qserve eval --limit` picks them), lm-eval's n-samples saying so; else every document, ids 0, 1, ...
    `ppl_size`: ppl_task has that many documents and the run scored the first in file order (lm-eval's
    own --limit)."""
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
    qa_ids = list(range(len(exact))) if qa_size is None else expected_order("qa_task", qa_size)[: len(exact)]
    if qa_size is not None:
        results["n-samples"] = {"qa_task": {"original": qa_size, "effective": len(exact)}}
    if ppl_size is not None:
        results.setdefault("n-samples", {})["ppl_task"] = {"original": ppl_size, "effective": len(lls)}
    (folder / "results_2026-11-24T10-00-00.json").write_text(json.dumps(results))
    ppl_lines = [{"doc_id": i, "filter": "none", "word_perplexity": [ll, w]} for i, (ll, w) in enumerate(zip(lls, words))]
    qa_lines = [{"doc_id": i, "filter": "strict-match", "exact_match": v} for i, v in zip(qa_ids, exact)]
    for task, lines in (("ppl_task", ppl_lines), ("qa_task", qa_lines)):
        (folder / f"samples_{task}_2026-11-24T10-00-00.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root / name


def _pair(
    tmp_path: Path, n: int = 120, qa_size: int | None = None, ppl_size: int | None = None
) -> tuple[Path, Path, np.ndarray, np.ndarray, np.ndarray]:
    rng = random.Random(0)
    words = [rng.randint(20, 200) for _ in range(n)]
    base = [-2.0 * w + rng.gauss(0, 3) for w in words]
    quant = [b - 0.02 * w + rng.gauss(0, 2) for b, w in zip(base, words)]  # about +2 % perplexity
    exact_b = [float(i < 0.6 * n) for i in range(n)]
    exact_q = [0.0 if i in (3, 9, 27, 40) else 1.0 if i == n - 1 else v for i, v in enumerate(exact_b)]  # 4 lost, 1 gained
    b = _run(tmp_path, "base", base, words, exact_b, qa_size, ppl_size)
    q = _run(tmp_path, "quant", quant, words, exact_q, qa_size, ppl_size)
    return b, q, np.array(base), np.array(quant), np.array(words, dtype=float)


def test_gate_on_a_file_order_prefix_of_a_perplexity_task_bets_on_the_scored_documents_alone(tmp_path: Path) -> None:
    """Word perplexity on lm-eval's own --limit (the first 120 of 1,319 documents in file order): not a
    sample qserve drew, so no claim about the task; the bet is on those 120 documents, a claim about them,
    at the first look's share of 5 % (another look at other documents is another test). Their ratio,
    computed here, is +1.7 % against +5 % allowed: a fact once all 120 are counted, so the bet passes."""
    b, q, ll_b, ll_q, w = _pair(tmp_path, ppl_size=1319)
    out = tmp_path / "gate.json"
    proc = run_qserve_in_process("gate", b, q, "--tasks", "ppl_task", "--gate", "ppl_task:max_increase=0.05", "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    (gate,) = record["gates"]
    assert math.expm1((ll_b - ll_q).sum() / w.sum()) == pytest.approx(0.0174, abs=5e-4)
    first_look = 0.05 * 6 / math.pi**2
    assert gate["test"] == (
        BETTING + "the 120 scored items (a claim about them), in the seeded order size-biased by words, on each "
        f"document's loss change per word (within ±0.693 nats), at {first_look:.2%}, this look's share of 5 %"
    )
    assert (gate["evidence"]["population"], gate["evidence"]["whole"]) == (120, False)
    assert gate["evidence"]["threshold"] == pytest.approx(1 / first_look)
    assert (record["verdict"], gate["status"], gate["items"], gate["higher_is_better"]) == ("pass", "pass", 120, False)
    assert proc.stdout.strip().splitlines()[-1] == "verdict: PASS"


BETTING = "betting without replacement (Waudby-Smith and Ramdas 2020) on "


def test_gate_on_every_document_of_a_perplexity_task_bets_in_the_size_biased_order(tmp_path: Path) -> None:
    """Runs that scored every document: the gate bets on them in qserve eval's order, size-biased by the
    words lm-eval counted, and the whole corpus is the population. Its ratio, computed here, is +1.7 %
    against +5 % allowed: a fact once every document is scored, so the bet passes by the last one."""
    b, q, ll_b, ll_q, w = _pair(tmp_path)
    proc = run_qserve_in_process("gate", b, q, "--tasks", "ppl_task", "--gate", "ppl_task:max_increase=0.05", "--json")
    assert proc.returncode == 0, proc.stderr
    (gate,) = json.loads(proc.stdout)["gates"]
    assert math.expm1((ll_b - ll_q).sum() / w.sum()) == pytest.approx(0.0174, abs=5e-4)
    assert gate["test"] == (
        BETTING + "120 items of the task, in the seeded order size-biased by words, on each document's loss change "
        "per word (within ±0.693 nats), at 5 % over every look"
    )
    assert (gate["status"], gate["evidence"]["population"], gate["evidence"]["whole"]) == ("pass", 120, True)
    assert gate["evidence"]["criteria"]["max_increase"]["items"] <= 120


def test_gate_refuses_runs_that_count_other_words_for_a_document(tmp_path: Path) -> None:
    b, q, *_ = _pair(tmp_path)
    samples = next(q.rglob("samples_ppl_task_*.jsonl"))
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    lines[7]["word_perplexity"][1] += 1
    samples.write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc = run_qserve_in_process("gate", b, q, "--tasks", "ppl_task")
    assert (proc.returncode, proc.stderr.strip()) == (
        1,
        "error: ppl_task: the runs count different words for document 7: they scored other texts",
    )


def test_gate_on_every_item_of_a_0_1_task_decides_exactly(tmp_path: Path) -> None:
    """Runs that scored every document (no n-samples limit) are the whole test set: 72 of 120 right on the
    baseline, 4 lost and 1 gained, so recovery is 69 / 72 = 0.958 > 0.95, a fact once every item is scored."""
    b, q, *_ = _pair(tmp_path)
    proc = run_qserve_in_process("gate", b, q, "--tasks", "qa_task", "--json")
    assert proc.returncode == 0, proc.stderr
    (gate,) = json.loads(proc.stdout)["gates"]
    assert (gate["flips"], gate["status"], gate["recovery"]) == ({"lost": 4, "gained": 1}, "pass", pytest.approx(69 / 72))
    assert gate["test"] == BETTING + "120 items of the task, in the seeded order, at 5 % over every look"
    assert (gate["evidence"]["population"], gate["evidence"]["whole"]) == (120, True)


def test_gate_on_a_seeded_sample_of_a_0_1_task_is_inconclusive_when_too_close(tmp_path: Path) -> None:
    """The same 120 scores as the first 120 of a 1,319-document task's seeded order (lm-eval's n-samples):
    a sample, 0.958 against 0.95 is too close to call on it, and the evidence is of 120 items of 1,319."""
    b, q, *_ = _pair(tmp_path, qa_size=1319)
    proc = run_qserve_in_process("gate", b, q, "--tasks", "qa_task", "--json")
    assert proc.returncode == EXIT_GATE_INCONCLUSIVE, proc.stderr
    (gate,) = json.loads(proc.stdout)["gates"]
    assert gate["test"] == BETTING + "1319 items of the task, in the seeded order, at 5 % over every look"
    assert gate["evidence"]["criteria"]["min_recovery"]["items"] == 120
    assert gate["reason"].startswith(
        "degradation 0.025 vs allowed 0.03: min_recovery: neither bettor reached 1/alpha = 20 after 120 items"
    )


def _instruction_run(root: Path, name: str, followed: list[list[bool]]) -> Path:
    """An IFEval-like run: each item logs one value per instruction; the stated score is their mean over
    all of them (lm-eval's agg_inst_level_acc flattens the lists)."""
    folder = root / name / "org__model"
    folder.mkdir(parents=True)
    flat = [x for item in followed for x in item]
    results = {
        "results": {"inst_task": {"alias": "inst_task", "inst_level_loose_acc,none": sum(flat) / len(flat)}},
        "higher_is_better": {"inst_task": {"inst_level_loose_acc": True}},
    }
    (folder / "results_2026-11-24T10-00-00.json").write_text(json.dumps(results))
    lines = [{"doc_id": i, "filter": "none", "inst_level_loose_acc": v} for i, v in enumerate(followed)]
    (folder / "samples_inst_task_2026-11-24T10-00-00.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root / name


def test_a_metric_with_several_values_per_item_is_gated_per_item_as_a_ratio(tmp_path: Path) -> None:
    """Instruction-level accuracy: items are prompts with 1-3 instructions each; the gate's degradation is
    the change of the mean over all instructions, and its bound the ratio estimator's over the prompts
    (recomputed here from the definition: per prompt, instructions followed minus the rate times its count)."""
    rng = random.Random(1)
    base = [[rng.random() < 0.8 for _ in range(rng.randint(1, 3))] for _ in range(300)]
    quant = [[x != (rng.random() < 0.1) for x in item] for item in base]  # 10 % of instructions flip, either way
    proc = run_qserve_in_process(
        "gate",
        _instruction_run(tmp_path, "b", base),
        _instruction_run(tmp_path, "q", quant),
        "--gate",
        "inst_task:max_drop=0.1",
        "--json",
    )
    (gate,) = json.loads(proc.stdout)["gates"]
    c_b, c_q = (np.array([sum(v) for v in side], dtype=float) for side in (base, quant))
    n = np.array([len(v) for v in base], dtype=float)
    rate_b, rate_q = c_b.sum() / n.sum(), c_q.sum() / n.sum()
    assert (gate["items"], gate["baseline"], gate["quantized"]) == (300, pytest.approx(rate_b), pytest.approx(rate_q))
    assert gate["degradation"] == pytest.approx(rate_b - rate_q, abs=1e-12)
    e = ((c_b - rate_b * n) - (c_q - rate_q * n)) / n.mean()  # per prompt, the degradation's linearized term
    se = math.sqrt((e**2).sum() / (len(e) - 1) / len(e))
    centre = rate_b - rate_q + (e**3).mean() / (6 * (e**2).mean() * len(e))
    t_crit = t_dist.ppf(1 - 0.05 * 6 / math.pi**2, len(e) - 1)  # a first look
    assert gate["bounds"]["upper"] == pytest.approx(centre + (t_crit + 0.3 * t_crit**2) * se, abs=1e-12)
    assert (proc.returncode, gate["status"]) == (0, "pass")


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
    assert proc.stderr.strip() == (
        f"error: {samples.parent} has no samples_ppl_task_2026-11-24T10-00-00.jsonl "
        "(the samples of results_2026-11-24T10-00-00.json): run lm-eval with --log_samples"
    )


def _results(run: Path) -> Path:
    return next(run.rglob("results_*.json"))


def _edit(path: Path, **sections) -> None:
    raw = json.loads(path.read_text())
    raw.update(sections)
    path.write_text(json.dumps(raw))


def test_a_task_reads_its_own_samples_not_those_of_a_task_whose_name_extends_it(tmp_path: Path) -> None:
    b, q, *_ = _pair(tmp_path)
    for run in (b, q):  # qa_task_cot: every item right, in a file the old glob samples_qa_task_*.jsonl picked
        folder = _results(run).parent
        lines = [{"doc_id": i, "filter": "strict-match", "exact_match": 1.0} for i in range(120)]
        (folder / "samples_qa_task_cot_2026-11-24T10-00-00.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc = run_qserve_in_process("gate", b, q, "--tasks", "qa_task", "--json")
    (gate,) = json.loads(proc.stdout)["gates"]
    assert gate["flips"] == {"lost": 4, "gained": 1} and gate["items"] == 120


def test_gate_refuses_runs_that_asked_another_question(tmp_path: Path) -> None:
    b, q, *_ = _pair(tmp_path)
    _edit(_results(b), **{"n-shot": {"qa_task": 0}})
    _edit(_results(q), **{"n-shot": {"qa_task": 5}})
    proc = run_qserve_in_process("gate", b, q, "--tasks", "qa_task")
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "error: qa_task: the runs differ in their few-shot count (n-shot in results_2026-11-24T10-00-00.json and "
        "results_2026-11-24T10-00-00.json): they did not ask the same question; run both with the same task, --num_fewshot and data"
    )
    _edit(_results(q), **{"n-shot": {"qa_task": 0}})
    samples = next(q.rglob("samples_qa_task_*.jsonl"))
    lines = [
        json.loads(x) | {"doc_hash": "d", "prompt_hash": "p" if i != 7 else "other"}
        for i, x in enumerate(samples.read_text().splitlines())
    ]
    samples.write_text("".join(json.dumps(x) + "\n" for x in lines))
    base_samples = next(b.rglob("samples_qa_task_*.jsonl"))
    base_lines = [json.loads(x) | {"doc_hash": "d", "prompt_hash": "p"} for x in base_samples.read_text().splitlines()]
    base_samples.write_text("".join(json.dumps(x) + "\n" for x in base_lines))
    proc = run_qserve_in_process("gate", b, q, "--tasks", "qa_task")
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "error: qa_task: 1 items have other documents or prompts in the two runs (doc_hash / prompt_hash, first doc_id 7); "
        "run both with the same task, --num_fewshot and data"
    )


@pytest.mark.parametrize(
    ("field", "base", "quant"),
    [
        ("chat_template_sha", {"chat_template_sha": "a1"}, {"chat_template_sha": "b2"}),
        ("fewshot_as_multiturn", {"fewshot_as_multiturn": True}, {"fewshot_as_multiturn": False}),
        ("gen_kwargs", {"config": {"gen_kwargs": {"max_gen_toks": 256}}}, {"config": {"gen_kwargs": None}}),
    ],
)
def test_gate_refuses_runs_made_with_other_lm_eval_options(tmp_path: Path, field: str, base: dict, quant: dict) -> None:
    b, q, *_ = _pair(tmp_path)
    _edit(_results(b), **base)
    _edit(_results(q), **quant)
    proc = run_qserve_in_process("gate", b, q, "--tasks", "qa_task")
    assert (proc.returncode, proc.stderr.strip()) == (
        1,
        f"error: the runs were made with other lm-eval options ({field} differ in results_2026-11-24T10-00-00.json and "
        "results_2026-11-24T10-00-00.json): run both with the same --apply_chat_template, --system_instruction, "
        "--fewshot_as_multiturn and --gen_kwargs",
    )


def test_gate_refuses_items_that_do_not_add_up_to_their_stated_score(tmp_path: Path) -> None:
    """A results file saying 60 % beside items that score 30 % is another run's items, or an edit."""
    b, q, *_ = _pair(tmp_path)
    raw = json.loads(_results(q).read_text())
    raw["results"]["qa_task"]["exact_match,strict-match"] = 0.6
    _results(q).write_text(json.dumps(raw))
    proc = run_qserve_in_process("gate", b, q, "--tasks", "qa_task")
    assert proc.returncode == 1
    mean = (72 - 4 + 1) / 120  # the quantized items: 72 right in the baseline, 4 lost, 1 gained
    assert proc.stderr.strip() == (
        f"error: qa_task: the 120 items in samples_qa_task_2026-11-24T10-00-00.jsonl give exact_match,strict-match {mean:.6g}, "
        "but results_2026-11-24T10-00-00.json states 0.6: they are not the items of that result"
    )


def test_gate_finds_output_path_json_runs_and_picks_the_newest_results_by_date(tmp_path: Path) -> None:
    b, q, *_ = _pair(tmp_path)
    # --output_path run.json: lm-eval writes run_<date>.json with the samples beside it.
    results = _results(q)
    results.rename(results.with_name("run_2026-11-24T10-00-00.json"))
    proc = run_qserve_in_process("gate", b, results.with_name("run_2026-11-24T10-00-00.json"), "--tasks", "qa_task", "--json")
    assert json.loads(proc.stdout)["gates"][0]["flips"] == {"lost": 4, "gained": 1}
    # An older run in a folder whose path sorts last is not the run: the date decides.
    old = q / "zz__older"
    old.mkdir()
    (old / "results_2026-01-01T00-00-00.json").write_text(_results(b).read_text())
    proc = run_qserve_in_process("gate", b, q, "--tasks", "qa_task", "--json")
    assert json.loads(proc.stdout)["gates"][0]["flips"] == {"lost": 4, "gained": 1}


def test_looks_from_an_earlier_record_continue_its_history(tmp_path: Path) -> None:
    """The same runs again are the same look; more items are look 2, at a smaller level; an edited
    history is refused."""
    from qserve.gate import looks

    b, q, *_ = _pair(tmp_path)
    first = tmp_path / "gate-1.json"
    run_qserve_in_process("gate", b, q, "--tasks", "ppl_task", "--out", first)
    again = tmp_path / "gate-again.json"
    run_qserve_in_process("gate", b, q, "--tasks", "ppl_task", "--looks-from", first, "--out", again)
    assert [json.loads(p.read_text())["look"]["number"] for p in (first, again)] == [1, 1]
    assert len(json.loads(again.read_text())["look"]["history"]) == 1
    larger_b, larger_q, *_ = _pair(tmp_path / "larger", n=200)
    second = tmp_path / "gate-2.json"
    proc = run_qserve_in_process("gate", larger_b, larger_q, "--tasks", "ppl_task", "--looks-from", first, "--out", second)
    look = json.loads(second.read_text())["look"]
    assert (look["number"], look["level"], len(look["history"])) == (2, looks.level(2), 2), proc.stderr
    record = json.loads(second.read_text())
    record["look"]["history"] = record["look"]["history"][1:]
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(record))
    proc = run_qserve_in_process("gate", b, q, "--tasks", "ppl_task", "--looks-from", edited)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"error: the look history in {edited} was edited: look 1 does not follow the one before it "
        "(an entry was removed, reordered or changed); the gate cannot count the looks at these weights"
    )


def test_eval_and_gate_decide_alike_on_the_same_outputs(tmp_path: Path) -> None:
    """`qserve gate` on two lm-eval output folders, and `qserve eval`'s engine runs holding the same
    results and per-item values: the same gates, field for field (both decide through gate.core)."""
    from dataclasses import asdict

    from qserve.evaluate.lm_eval_run import EngineRun
    from qserve.gate import looks, stats
    from qserve.gate.core import decide_gates
    from qserve.gate.external import gate_runs
    from qserve.spec.gates import GateSpec

    b, q, _, _, w = _pair(tmp_path)
    specs = {"ppl_task": [GateSpec(max_increase=0.05)], "qa_task": [GateSpec(min_recovery=0.95), GateSpec(max_drop=0.2)]}
    from_gate = gate_runs(b, q, specs, ["ppl_task", "qa_task"])["gates"]
    metrics = {"ppl_task": "word_perplexity,none", "qa_task": "exact_match,strict-match"}

    def engine_run(run: Path) -> EngineRun:
        items = {}
        for task, metric in metrics.items():
            lines = next(run.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()
            items[task] = {metric: stats.item_values([json.loads(line) for line in lines], metric)}
        return EngineRun(json.loads(_results(run).read_text()), items)

    counts = {"ppl_task": {"word_perplexity": dict(enumerate(w.tolist()))}}  # qserve eval counts them from the task's texts
    from_eval = decide_gates(specs, metrics, engine_run(b), engine_run(q), looks.level(1), counts=counts)
    assert [asdict(g) for g in from_eval] == from_gate
    assert [g["status"] for g in from_gate] == ["pass", "pass", "pass"]


# `qserve gate --checkpoint`: the runs above bound to a small checkpoint (a real manifest over one file),
# as lm-eval records a run's model (config.model_args; its Python API writes the "k=v,k=v" string) and start.
RECIPE = {"name": "r", "gates": {"ppl_task": {"max_increase": 0.05}}}
MADE = "2026-11-24T09:00:00+00:00"
RAN = datetime(2026, 11, 24, 10, tzinfo=UTC).timestamp()  # an hour after the checkpoint was made


def _bound(tmp_path: Path, recipe: dict = RECIPE) -> tuple[Path, Path, Path]:
    """A checkpoint of its own weights (no other test's look history), and a pair of runs that name it
    (qa_task a seeded sample, whose gate is too close to call)."""
    b, q, *_ = _pair(tmp_path, qa_size=1319)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(f"weights of {tmp_path.name}".encode())
    source = {"id": "org/base", "path": "/models/base", "source": "hub"}
    manifest = small_manifest(recipe=recipe, source_model=source, created_at=MADE, dtype="bfloat16", files=hash_files(ckpt))
    write_manifest(ckpt, manifest)
    lm_eval = {"date": RAN, "lm_eval_version": "0.4.13"}
    _edit(_results(b), config={"model": "vllm", "model_args": "pretrained=org/base"}, **lm_eval)
    _edit(_results(q), config={"model": "vllm", "model_args": f"pretrained={ckpt},dtype=bfloat16"}, **lm_eval)
    return ckpt, b, q


def test_a_checkpoints_outside_pass_serves_and_its_inconclusive_gate_does_not(tmp_path: Path) -> None:
    """The recipe's gate (ppl_task max_increase 0.05) decides when --gate names none; the record serve reads
    names the runs; a later inconclusive gate replaces it, as the checkpoint's second look, and serve refuses."""
    from qserve.serve.server import Checks

    ckpt, b, q = _bound(tmp_path)
    proc = run_qserve_in_process("gate", b, q, "--checkpoint", ckpt)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((ckpt / EVAL_NAME).read_text())
    (gate,) = record["gates"]
    assert (gate["task"], gate["criteria"], gate["status"], record["verdict"]) == (
        "ppl_task",
        {"max_increase": 0.05},
        "pass",
        "pass",
    )
    assert record["manifest_sha256"] == hashlib.sha256((ckpt / MANIFEST_NAME).read_bytes()).hexdigest()
    quantized = record["outside_runs"]["quantized"]
    assert (quantized["model_args"], quantized["date"], quantized["results"]) == (
        f"pretrained={ckpt},dtype=bfloat16",
        RAN,
        str(_results(q).resolve()),
    )
    assert quantized["results_sha256"] == hashlib.sha256(_results(q).read_bytes()).hexdigest()
    assert Checks().run(ckpt) == [f"accuracy gate passed (decided {record['decided_at']}, look 1 at these weights)"]
    proc = run_qserve_in_process("gate", b, q, "--checkpoint", ckpt, "--tasks", "qa_task")
    assert proc.returncode == EXIT_GATE_INCONCLUSIVE, proc.stderr
    record = json.loads((ckpt / EVAL_NAME).read_text())
    assert (record["verdict"], record["look"]["number"]) == ("inconclusive", 2)
    with pytest.raises(QserveError) as refused:
        Checks().run(ckpt)
    assert str(refused.value) == (
        f"{ckpt} did not pass its accuracy gate (verdict: inconclusive); see `qserve eval {ckpt}` (or pass --skip-gate)"
    )


def test_a_record_made_without_the_lm_eval_options_the_recipe_names_does_not_serve(tmp_path: Path) -> None:
    """A recipe that names lm-eval options (its eval section) is met only by a record made with them."""
    from qserve.serve.server import Checks

    ckpt, b, q = _bound(tmp_path, RECIPE | {"eval": {"num_fewshot": 5}})
    assert run_qserve_in_process("gate", b, q, "--checkpoint", ckpt).returncode == 0
    with pytest.raises(QserveError) as refused:
        Checks().run(ckpt)
    assert str(refused.value) == (
        "the gate record was made with other lm-eval options than recipe r names: the record does not say which "
        f"lm-eval options it was made with (the recipe names num_fewshot) (run `qserve eval {ckpt}` without overriding "
        "them, or pass --accept-gate-difference)"
    )
    record = json.loads((ckpt / EVAL_NAME).read_text())
    record["request"] = {"lm_eval": {"num_fewshot": 0}}
    (ckpt / EVAL_NAME).write_text(json.dumps(record))
    with pytest.raises(QserveError) as refused:
        Checks().run(ckpt)
    assert "num_fewshot: the record was made with 0, the recipe names 5 (run" in str(refused.value)
    record["request"] = {"lm_eval": {"num_fewshot": 5}}
    (ckpt / EVAL_NAME).write_text(json.dumps(record))
    assert Checks().run(ckpt) == [f"accuracy gate passed (decided {record['decided_at']}, look 1 at these weights)"]


def _args(q: Path, args: str) -> None:
    _edit(_results(q), config={"model": "vllm", "model_args": args})


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        pytest.param(
            lambda ckpt, b, q: _args(q, "pretrained=/elsewhere/ckpt,dtype=bfloat16"),
            "the quantized run {q} evaluated /elsewhere/ckpt, not the checkpoint {real}: its gate cannot authorize this checkpoint",
            id="another-path",
        ),
        pytest.param(
            lambda ckpt, b, q: _args(q, "pretrained=ckpt"),
            "the quantized run {q} names the relative path ckpt, and lm-eval does not record where it ran; "
            "run it with an absolute pretrained= path",
            id="relative-path",
        ),
        pytest.param(
            lambda ckpt, b, q: _args(q, f"pretrained={ckpt},peft=/adapters/a"),
            "the quantized run {q} loaded peft=/adapters/a on top of the checkpoint: not what is served",
            id="adapter",
        ),
        pytest.param(
            lambda ckpt, b, q: _args(q, f"pretrained={ckpt},tokenizer=/models/base"),
            "the quantized run {q} used the tokenizer /models/base, not the checkpoint's: not what is served",
            id="tokenizer",
        ),
        pytest.param(
            lambda ckpt, b, q: _args(q, f"pretrained={ckpt},kv_cache_dtype=fp8"),
            "the quantized run {q} ran with kv_cache_dtype=fp8, and `qserve serve` runs the checkpoint with kv_cache_dtype=auto: "
            "its scores are not those of what is served",
            id="kv-cache-dtype",
        ),
        pytest.param(
            lambda ckpt, b, q: _edit(_results(q), date=RAN - 7200),
            "the quantized run {q} started 2026-11-24T08:00:00+00:00, before the checkpoint {ckpt} was made "
            "(2026-11-24T09:00:00+00:00): it evaluated other weights at that path",
            id="ran-before",
        ),
        pytest.param(
            lambda ckpt, b, q: _edit(_results(q), config={"model": "vllm"}),
            "{q} does not record the model it evaluated (lm-eval's config.model_args); it cannot vouch for a checkpoint",
            id="no-model-args",
        ),
        pytest.param(
            lambda ckpt, b, q: _args(b, "pretrained=org/other"),
            "the baseline run {b} evaluated org/other, not {ckpt}'s source model org/base (/models/base): "
            "the gate would compare the checkpoint with another model",
            id="other-baseline",
        ),
    ],
)
def test_runs_not_of_the_checkpoint_are_refused_before_deciding(tmp_path: Path, edit, expected: str) -> None:
    ckpt, b, q = _bound(tmp_path)
    edit(ckpt, b, q)
    files = sorted(p.name for p in ckpt.iterdir())
    proc = run_qserve_in_process("gate", b, q, "--checkpoint", ckpt, "--out", tmp_path / "gate.json")
    assert proc.returncode == 1
    where = {"q": _results(q), "b": _results(b), "ckpt": ckpt, "real": ckpt.resolve()}
    assert proc.stderr.strip() == "error: " + expected.format(**where)
    assert sorted(p.name for p in ckpt.iterdir()) == files and not (tmp_path / "gate.json").exists()  # nothing written


def _one_metric_run(root: Path, name: str, scores: list[float], task: str = "crows", metric: str = "pct_stereotype") -> Path:
    """A run in lm-eval's layout of a task with one per-item metric: by default lower-is-better (crows_pairs'
    pct_stereotype); another `metric` is higher-is-better."""
    folder = root / name / "org__model"
    folder.mkdir(parents=True)
    results = {
        "results": {task: {"alias": task, f"{metric},none": sum(scores) / len(scores), f"{metric}_stderr,none": 0.02}},
        "higher_is_better": {task: {metric: metric != "pct_stereotype"}},
    }
    (folder / "results_2026-12-07T10-00-00.json").write_text(json.dumps(results))
    lines = [{"doc_id": i, "filter": "none", metric: v} for i, v in enumerate(scores)]
    (folder / f"samples_{task}_2026-12-07T10-00-00.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root / name


@pytest.mark.parametrize(("newly", "code", "verdict"), [(6, 0, "PASS"), (16, 3, "FAIL")])
def test_a_lower_is_better_score_is_bet_on_and_decided_exactly_on_every_item(
    tmp_path: Path, newly: int, code: int, verdict: str
) -> None:
    """400 pairs, 240 stereotyped on the baseline; the quantized model stereotypes `newly` more of the
    others (and 10 fewer of the 240, 10 more besides). At max_increase 0.05 the rate may rise to 252: 246
    is below (+2.5 %), 256 above (+6.7 %), facts once every item is scored, so the bet decides them."""
    base = [1.0] * 240 + [0.0] * 160
    quant = [0.0] * 10 + [1.0] * 230 + [1.0] * (10 + newly) + [0.0] * (150 - newly)
    assert (sum(base), sum(quant)) == (240, 240 + newly)
    b, q = _one_metric_run(tmp_path, "base", base), _one_metric_run(tmp_path, "quant", quant)
    proc = run_qserve_in_process("gate", b, q, "--tasks", "crows", "--gate", "crows:max_increase=0.05", "--json")
    assert proc.returncode == code, proc.stderr
    (gate,) = json.loads(proc.stdout)["gates"]
    assert gate["test"] == BETTING + "400 items of the task, in the seeded order, at 5 % over every look"
    assert (gate["status"], gate["higher_is_better"], gate["evidence"]["whole"]) == (verdict.lower(), False, True)
    # What was bet on, recomputed: q - 1.05 b per item, mean below 0 exactly when the rate rose by less than 5 %.
    assert (sum(quant) - 1.05 * sum(base) < 0) == (verdict == "PASS")


@pytest.mark.parametrize(("drop", "code", "verdict"), [(1, 0, "PASS"), (3, 3, "FAIL")])
def test_a_score_in_a_declared_range_is_bet_on_from_the_cli(tmp_path: Path, drop: int, code: int, verdict: str) -> None:
    """truthfulqa_gen-like BLEU in [0, 100] on 400 answers: the quantized model `drop` points lower on 200 of
    them (a mean drop of drop / 2, recomputed), max_drop 1.25 points. Declared with score_range it is bet on and
    decided exactly on every answer; without it, stats.py's bound decides (not a bet)."""
    base = [float(v % 101) for v in range(0, 400 * 37, 37)]
    quant = [v - drop if k % 2 == 0 and v >= drop else v for k, v in enumerate(base)]
    mean_drop = (sum(base) - sum(quant)) / 400
    assert (mean_drop < 1.25) == (verdict == "PASS")
    b, q = (_one_metric_run(tmp_path, n, s, "truthful", "bleu_max") for n, s in (("base", base), ("quant", quant)))
    gate = ("--gate", "truthful@bleu_max:max_drop=1.25")
    proc = run_qserve_in_process(
        "gate", b, q, "--tasks", "truthful", *gate, "--gate", "truthful@bleu_max:score_range=0,100", "--json"
    )
    assert proc.returncode == code, proc.stderr
    (found,) = json.loads(proc.stdout)["gates"]
    assert found["test"] == BETTING + (
        "400 items of the task, in the seeded order, each item's score within the declared score_range [0, 100], at 5 % over every look"
    )
    assert (found["status"], found["higher_is_better"], found["degradation"]) == (verdict.lower(), True, pytest.approx(mean_drop))
    plain = run_qserve_in_process("gate", b, q, "--tasks", "truthful", *gate, "--json")
    assert not json.loads(plain.stdout)["gates"][0]["test"].startswith(BETTING)


def test_a_score_range_on_the_cli_is_two_numbers() -> None:
    proc = run_qserve_in_process("gate", "a", "b", "--gate", "truthful@bleu_max:score_range=100", "--json")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: --gate 'truthful@bleu_max:score_range=100': score_range is two numbers, the lowest score and the highest, e.g. 0,100"
    ]
