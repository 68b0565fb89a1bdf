"""Gate arithmetic: recovery for scores and losses, zero baselines, the overall verdict."""

from __future__ import annotations

import pytest

from qserve.evaluation import decide, recovery, verdict
from qserve.tasks import get_tasks


def test_recovery_directions() -> None:
    assert recovery(0.5, 0.45, higher_is_better=True) == pytest.approx(0.9)
    assert recovery(10.0, 12.5, higher_is_better=False) == pytest.approx(0.8)


def test_zero_baseline_is_inconclusive_not_a_pass() -> None:
    gsm8k = get_tasks(["gsm8k"])[0]
    gate = decide(gsm8k, (0.0, 0.0), (0.0, 0.0), 0.95)
    assert gate.status == "inconclusive" and gate.recovery is None
    assert verdict([gate]) == "inconclusive"


def test_verdict_needs_a_real_pass_and_no_failure() -> None:
    gsm8k, ppl = get_tasks(["gsm8k", "gsm8k_ppl"])
    ok = decide(ppl, (10.0, None), (10.5, None), 0.9)
    bad = decide(ppl, (10.0, None), (20.0, None), 0.9)
    empty = decide(gsm8k, (0.0, 0.0), (0.0, 0.0), 0.95)
    assert ok.status == "pass" and bad.status == "fail"
    assert verdict([ok, empty]) == "pass"
    assert verdict([ok, bad]) == "fail"


def test_unknown_task() -> None:
    from qserve.errors import QserveError

    with pytest.raises(QserveError, match="unknown task mmlu; available: gsm8k, gsm8k_ppl"):
        get_tasks(["mmlu"])
