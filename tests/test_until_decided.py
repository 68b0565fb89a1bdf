"""`qserve eval --until-decided`: rounds of `--limit N` on growing prefixes of each task's seeded
order, stopping at the first decision (qserve/workflows/run.py, evaluate_until_decided)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import copy_checkpoint, run_qserve_in_process

from qserve.errors import QserveError
from qserve.evaluate.evaluation import EvalOptions
from qserve.gate import betting
from qserve.spec.gates import GateSpec
from qserve.workflows.run import FIRST_ROUND, evaluate_until_decided, rounds


def test_rounds_double_up_to_the_ceiling() -> None:
    assert [n for n, _ in zip(rounds(100, None), range(4))] == [100, 200, 400, 800]
    assert list(rounds(100, 250)) == [100, 200, 250] and list(rounds(100, 50)) == [50] and list(rounds(100, 200)) == [100, 200]
    assert FIRST_ROUND == 100


def test_an_offset_is_refused_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(QserveError, match=r"^--until-decided takes each task's seeded order from its first document"):
        evaluate_until_decided(tmp_path / "missing", EvalOptions(offset=10))


@pytest.fixture(scope="module")
def fp8_checkpoint(checkpoints, tmp_path_factory) -> Path:
    """The embedded model in FP8 dynamic (which every CPU met serves), a copy of its own: each eval
    writes its record and looks into it."""
    return copy_checkpoint(checkpoints["fp8"], tmp_path_factory.mktemp("until-decided") / "ckpt")


# A word-perplexity rise of up to 50 %: within the log 2 cap, at most ~1.07 nats of evidence per document
# (the largest bet, 0.5 / (log 2 - log 1.5), times the largest payoff, log 1.5 + log 2).
ALLOWANCE = 0.5


@pytest.mark.matrix  # three rounds, six engine starts: make test-matrix, which CI runs after make test
def test_rounds_stop_at_the_first_decision(fp8_checkpoint: Path) -> None:
    """Rounds of 2, 4 and 8 documents of gsm8k_ppl. Two documents cannot reach log 20 nats of evidence
    (2 x 1.07 < 3.0) nor fail (the fail bet gains at most 0.12 nats a document), so the first round is
    INCONCLUSIVE by construction; an FP8 model, whose per-word loss barely moves, gains about 0.53 nats a
    document at the largest bet, so four documents do not pass (2.1) and eight do (4.2). Each round is one
    look at a prefix of the same order, recorded with its verdict."""
    lo, hi, delta = betting.Spec("perplexity", ALLOWANCE).bet_range()
    assert 2 * math.log1p(0.5 / (hi - delta) * (delta - lo)) < math.log(20)
    options = EvalOptions(tasks=["gsm8k_ppl"], gates={"gsm8k_ppl": [GateSpec(max_increase=ALLOWANCE)]}, check_parity=False)
    record = evaluate_until_decided(fp8_checkpoint, options, first=2)
    (gate,) = record.gates
    assert (record.verdict, record.limit, gate.status) == ("pass", 8, "pass"), gate.reason
    assert [(look["limit"], look["verdict"]) for look in record.look.history] == [
        (2, "inconclusive"),
        (4, "inconclusive"),
        (8, "pass"),
    ]
    assert gate.test.endswith(
        "size-biased by words, on each document's loss change per word (within ±0.693 nats), at 5 % over every look"
    )


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
