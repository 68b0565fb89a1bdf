"""`qserve eval --until-decided`: rounds of `--limit N` on growing prefixes of each task's seeded
order, stopping at the first decision (qserve/workflows/run.py, evaluate_until_decided)."""

from __future__ import annotations

import hashlib
import json
import math
import re
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import DATA_DIR, copy_checkpoint, run_qserve_in_process

from qserve.checkpoint.manifest import ITEMS_NAME
from qserve.errors import QserveError
from qserve.evaluate.evaluation import EvalOptions, evaluate_round
from qserve.evaluate.lm_eval_run import EngineRun, join, unjoinable
from qserve.gate import betting
from qserve.gate.order import FIRST_ROUND, rounds
from qserve.spec.gates import GateSpec
from qserve.workflows.run import evaluate_until_decided


def test_rounds_double_up_to_the_ceiling() -> None:
    assert [n for n, _ in zip(rounds(100, None), range(4))] == [100, 200, 400, 800]
    assert list(rounds(100, 250)) == [100, 200, 250] and list(rounds(100, 50)) == [50] and list(rounds(100, 200)) == [100, 200]
    assert FIRST_ROUND == 100


def test_an_offset_is_refused_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(QserveError, match=r"^--until-decided takes each task's seeded order from its first document"):
        evaluate_until_decided(tmp_path / "missing", EvalOptions(offset=10))


def _run(acc: dict[str, float], words: dict[str, list[float]], acc_score: float | None = None) -> EngineRun:
    """An lm-eval run in its own shape: acc per item (a mean, with lm-eval's stderr) and word perplexity
    per document ([loglikelihood, words], no stderr), scores stated as lm-eval states them."""
    lls, counts = (sum(v[i] for v in words.values()) for i in (0, 1))
    result = {
        "alias": "t",
        "acc,none": statistics.mean(acc.values()) if acc_score is None else acc_score,
        "acc_stderr,none": statistics.stdev(acc.values()) / math.sqrt(len(acc)),
        "word_perplexity,none": math.exp(-lls / counts),
        "word_perplexity_stderr,none": "N/A",
    }
    raw = {
        "results": {"t": result},
        "n-samples": {"t": {"original": 10, "effective": len(acc)}},
        "task_hashes": {"t": f"hash of {sorted(acc)}"},
        "config": {"random_seed": 0},
    }
    return EngineRun(raw, {"t": {"acc,none": acc, "word_perplexity,none": words}}, seconds=2.0)


def test_a_join_rebuilds_each_score_from_the_joined_items() -> None:
    first = _run({"0": 1.0, "1": 0.0, "2": 1.0}, {"0": [-10.0, 4.0], "1": [-3.0, 2.0], "2": [-7.0, 5.0]})
    later = _run({"3": 1.0, "4": 1.0}, {"3": [-20.0, 6.0], "4": [-1.0, 1.0]})
    joined = join(first, later)
    result = joined.raw["results"]["t"]
    assert result["acc,none"] == pytest.approx(4 / 5, rel=1e-12)
    assert result["acc_stderr,none"] == pytest.approx(math.sqrt(0.2 * 0.8 * 5 / 4 / 5), rel=1e-12)
    assert result["word_perplexity,none"] == pytest.approx(math.exp(41 / 18), rel=1e-12)
    assert result["word_perplexity_stderr,none"] == "N/A"
    assert joined.raw["n-samples"]["t"] == {"original": 10, "effective": 5} and joined.seconds == 4.0
    assert sorted(joined.items["t"]["acc,none"]) == ["0", "1", "2", "3", "4"]
    assert joined.raw["task_hashes"]["t"] not in (first.raw["task_hashes"]["t"], later.raw["task_hashes"]["t"])


def test_a_score_that_is_not_the_mean_of_its_items_is_not_joined() -> None:
    """lambada's perplexity (exp of minus the mean log-likelihood), a corpus BLEU: no per-item mean gives
    the score, so each round scores its whole prefix."""
    stated = _run({"0": 1.0, "1": 0.0}, {"0": [-1.0, 1.0]}, acc_score=0.7)
    assert unjoinable(stated) == "t's acc,none is not the mean (or ratio of sums) of the per-item values lm-eval logged"
    with pytest.raises(ValueError, match=r"^the runs cannot be joined: t's acc,none is not the mean"):
        join(stated, _run({"2": 1.0, "3": 1.0}, {"2": [-1.0, 1.0]}))
    assert unjoinable(_run({"0": 1.0, "1": 0.0}, {"0": [-1.0, 1.0]})) is None


def test_a_document_scored_in_both_runs_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^t: documents 1 were scored in both runs$"):
        join(_run({"0": 1.0, "1": 0.0}, {"0": [-1.0, 1.0]}), _run({"1": 0.0, "2": 1.0}, {"2": [-1.0, 1.0]}))


@pytest.fixture(scope="module")
def fp8_checkpoint(checkpoints, tmp_path_factory) -> Path:
    """The embedded model in FP8 dynamic (which every CPU met serves), a copy of its own: each eval
    writes its record and looks into it."""
    return copy_checkpoint(checkpoints["fp8"], tmp_path_factory.mktemp("until-decided") / "ckpt")


# A word-perplexity rise of up to 50 %: within the log 2 cap, at most ~1.07 nats of evidence per document
# (the largest bet, 0.5 / (log 2 - log 1.5), times the largest payoff, log 1.5 + log 2).
ALLOWANCE = 0.5
# What each lm-eval run on the quantized checkpoint scored, as its step line names it
QUANTIZED_RUNS = r"> lm-eval on the quantized checkpoint: gsm8k_ppl \((.*?)\) \.\.\."


@pytest.mark.matrix  # three rounds, six engine starts: make test-matrix, which CI runs after make test
def test_rounds_stop_at_the_first_decision(fp8_checkpoint: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Rounds of 2, 4 and 8 documents of gsm8k_ppl. Two documents cannot reach log 20 nats of evidence
    (2 x 1.07 < 3.0) nor fail (the fail bet gains at most 0.12 nats a document), so the first round is
    INCONCLUSIVE by construction. How soon an FP8 model passes depends on how far the CPU's kernels move
    its per-word loss: measured, at 8 documents where it barely moves (about 0.53 nats of evidence a
    document; the hosts of this test's first CI runs), at 16 on an EPYC with a bfloat16 kernel (0.063
    nats a word over these 16 documents, 2026-12-07); four documents have passed on neither. Each round
    is one look at a prefix of the same order, recorded with its verdict, and the rounds stop at the first
    that holds the deciding document. The first command stops at its ceiling of 4; a second without one
    goes on from its record: rounds 2 and 4 are in it, round 8 scores 4-7, and so on."""
    lo, hi, delta = betting.Spec("perplexity", ALLOWANCE).bet_range()
    assert 2 * math.log1p(0.5 / (hi - delta) * (delta - lo)) < math.log(20)
    options = EvalOptions(tasks=["gsm8k_ppl"], gates={"gsm8k_ppl": [GateSpec(max_increase=ALLOWANCE)]}, check_parity=False)
    assert evaluate_until_decided(fp8_checkpoint, replace(options, limit=4), first=2).verdict == "inconclusive"
    record = evaluate_until_decided(fp8_checkpoint, options, first=2)
    (gate,) = record.gates
    assert (record.verdict, gate.status) == ("pass", "pass") and record.limit in (8, 16), gate.reason
    looked = [2**k for k in range(1, record.limit.bit_length())]  # 2, 4, ..., the last round
    history = [(look["limit"], look["verdict"]) for look in record.look.history]
    assert history == [(n, "inconclusive") for n in looked[:-1]] + [(record.limit, "pass")]
    deciding = int(re.search(r"reached 1/alpha = 20 after (\d+) items", gate.reason)[1])
    assert record.limit // 2 < deciding <= record.limit
    assert gate.test.endswith(
        "size-biased by words, on each document's loss change per word (within ±0.693 nats), at 5 % over every look"
    )
    # Each later round scored its new documents alone, one engine per model, and joined the earlier ones.
    said = capfd.readouterr().err
    for line in (
        "until decided: --limit 4 (items 2-3 scored now, the first 2 carried)",
        "until decided: --limit 2: in the checkpoint's record already (its --limit 4, inconclusive)",
        "until decided: --limit 4: in the checkpoint's record already (its --limit 4, inconclusive)",
        "continuing the record of --limit 4: items 4-7 of each task scored now",
    ):
        assert line in said
    scored = re.findall(QUANTIZED_RUNS, said)
    assert scored == ["limit 2, a seeded sample"] + [f"items {n // 2}-{n - 1} of the seeded order" for n in looked[1:]]


@pytest.mark.matrix  # two rounds, four engine starts
def test_rounds_whose_scores_do_not_join_score_their_whole_prefix(
    fp8_checkpoint: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A lambada-shaped task (each passage's last word given the rest; lm-eval's perplexity and acc) on
    GSM8K's questions: lm-eval bootstraps the perplexity's stderr, which the items do not give again, so
    the second round scores documents 0-3 whole. Its acc gate (0/1 items, a bet) cannot decide on 4 items:
    at max_drop 0.5 the largest bet gains log 1.5 an item, and 4 log 1.5 < log 20."""
    assert 4 * math.log(1.5) < math.log(20)
    folder, data = tmp_path / "tasks", tmp_path / "passages.jsonl"
    folder.mkdir()
    lines = (DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()[:20]
    data.write_text("".join(json.dumps({"text": json.loads(line)["question"]}) + "\n" for line in lines))
    task = {
        "task": "last_word",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "loglikelihood",
        "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
        "doc_to_target": "{{' '+text.split(' ')[-1]}}",
        "metric_list": [
            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        ],
    }
    (folder / "last_word.yaml").write_text(yaml.safe_dump(task))
    gates = {"last_word": [GateSpec(metric="acc,none", max_drop=0.5)]}
    options = EvalOptions(tasks=["last_word"], gates=gates, check_parity=False, include_path=folder, limit=4)
    record = evaluate_until_decided(copy_checkpoint(fp8_checkpoint, tmp_path / "ckpt"), options, first=2)
    assert (record.verdict, record.limit) == ("inconclusive", 4)
    said = capfd.readouterr().err
    why = "last_word's perplexity_stderr,none is lm-eval's bootstrap, which the items do not give again"
    assert f"until decided: each round scores its whole prefix: {why}" in said
    runs = re.findall(r"> lm-eval on the quantized checkpoint: last_word \((.*?)\) \.\.\.", said)
    assert runs == ["limit 2, a seeded sample", "limit 4, a seeded sample"]


def test_the_cli_names_its_rounds(fp8_checkpoint: Path, tmp_path: Path) -> None:
    """The command line's flag, with --limit as the ceiling: one round of 2 documents, inconclusive by construction."""
    ckpt = copy_checkpoint(fp8_checkpoint, tmp_path / "ckpt")
    proc = run_qserve_in_process(
        "eval",
        ckpt,
        "--tasks",
        "gsm8k_ppl",
        "--gate",
        "gsm8k_ppl:max_increase=0.5",
        "--no-parity",
        "--until-decided",
        "--limit",
        "2",
    )
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "until decided: --limit 2" in proc.stderr + proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("verdict: INCONCLUSIVE on 2 items per task")


@pytest.mark.matrix  # three evals, six engine starts
def test_a_larger_limit_continues_the_record(fp8_checkpoint: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """--limit 4 after --limit 2 on the same request scores documents 2-3 alone and joins them to the
    record's 0-1 (its items file): the same documents, words and log-likelihoods per document, and the
    same corpus word perplexity, as one run of --limit 4 whose baseline is scored afresh."""
    options = EvalOptions(tasks=["gsm8k_ppl"], gates={"gsm8k_ppl": [GateSpec(max_increase=ALLOWANCE)]}, check_parity=False)
    ckpt = copy_checkpoint(fp8_checkpoint, tmp_path / "rounds")
    evaluate_round(ckpt, replace(options, limit=2))
    record, joined = evaluate_round(ckpt, replace(options, limit=4))
    _, whole = evaluate_round(
        copy_checkpoint(fp8_checkpoint, tmp_path / "whole"), replace(options, limit=4, refresh_baseline=True)
    )
    said = capfd.readouterr().err
    assert "continuing the record of --limit 2: items 2-3 of each task scored now" in said
    assert re.findall(QUANTIZED_RUNS, said) == [
        "limit 2, a seeded sample",
        "items 2-3 of the seeded order",
        "limit 4, a seeded sample",
    ]
    key = "word_perplexity,none"
    for side in ("quant", "base"):
        got, want = (getattr(run, side).items["gsm8k_ppl"][key] for run in (joined, whole))
        assert sorted(got) == sorted(want) and len(got) == 4
        # Equal to the last bit on the AVX2 EPYC: vLLM scores each document as a sequence of its own.
        assert got == want
        words = sum(v[1] for v in want.values())
        ppl = math.exp(-sum(v[0] for v in want.values()) / words)
        assert math.isclose(getattr(joined, side).raw["results"]["gsm8k_ppl"][key], ppl, rel_tol=1e-12)
    assert record.limit == 4 and record.doc_ids == {"gsm8k_ppl": sorted(int(d) for d in whole.quant.items["gsm8k_ppl"][key])}
    assert record.items_sha256 == hashlib.sha256((ckpt / ITEMS_NAME).read_bytes()).hexdigest()


@pytest.mark.matrix  # two evals, four engine starts
def test_an_items_file_changed_after_its_record_is_not_continued(
    fp8_checkpoint: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A record's items file edited afterwards (a document's log-likelihood raised by 50 nats) is not the
    one the record names: --limit 4 scores all four documents again, and says why."""
    options = EvalOptions(tasks=["gsm8k_ppl"], gates={"gsm8k_ppl": [GateSpec(max_increase=ALLOWANCE)]}, check_parity=False)
    ckpt = copy_checkpoint(fp8_checkpoint, tmp_path / "edited")
    evaluate_round(ckpt, replace(options, limit=2))
    runs = json.loads((ckpt / ITEMS_NAME).read_text())
    scored = runs["quantized"]["items"]["gsm8k_ppl"]["word_perplexity,none"]
    scored[min(scored)][0] += 50.0
    (ckpt / ITEMS_NAME).write_text(json.dumps(runs))
    capfd.readouterr()
    record, _ = evaluate_round(ckpt, replace(options, limit=4))
    said = capfd.readouterr().err
    assert "note: qserve_eval_items.json is not the one the record of --limit 2 names; every item is scored again" in said
    assert re.findall(QUANTIZED_RUNS, said) == ["limit 4, a seeded sample"] and record.limit == 4
