"""The gate policy serve and sign enforce: the recipe's gates (or the operator's file) on enough items.

The checkpoint is a small directory with a real manifest and an eval record bound to it, so the
real `qserve sign` and its policy check run; `qserve serve`'s refusal on a real checkpoint is in
test_serve.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import gate_record as _gate
from conftest import make_keys, run_qserve_in_process, small_manifest

from qserve.checkpoint.manifest import CARD_NAME, EVAL_NAME, hash_files, manifest_digest, write_manifest
from qserve.errors import QserveError
from qserve.gate.decisions import Gate
from qserve.gate.policy import MIN_ITEMS, Policy, read_policy, recipe_policy
from qserve.gate.records import differences
from qserve.spec.recipe import Recipe

RECIPE = Recipe(name="r", scheme="W8A8", gates={"gsm8k_ppl": 0.95, "gsm8k": 0.95})


def _differences(gates: list[dict], policy: Policy) -> list[str]:
    """The policy's differences from a record holding these gates, as `qserve eval` writes them."""
    return differences([Gate(**g) for g in gates], policy)


def _checkpoint(root: Path, gates: list[dict]) -> Path:
    ckpt = root / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights")
    manifest = small_manifest(recipe=RECIPE, source_model={"id": "m"}, files=hash_files(ckpt))
    write_manifest(ckpt, manifest)
    record = {
        "verdict": "pass",
        "manifest_sha256": manifest_digest(ckpt),
        "decided_at": "2026-11-24T00:00:00+00:00",
        "gates": gates,
        "parity": {"status": "pass"},
    }
    (ckpt / EVAL_NAME).write_text(json.dumps(record))
    return ckpt


def test_a_record_that_meets_the_recipe_has_no_difference() -> None:
    assert _differences([_gate(), _gate("gsm8k")], recipe_policy(RECIPE)) == []
    # A stricter gate meets a looser policy.
    assert _differences([_gate(criteria={"min_recovery": 0.99}), _gate("gsm8k")], recipe_policy(RECIPE)) == []


def test_every_task_the_recipe_gates_is_required_and_a_gate_without_signal_is_a_difference() -> None:
    """`qserve eval --tasks gsm8k_ppl` alone does not meet a recipe that gates gsm8k too; a no-signal
    gsm8k gate (a tiny model's ~1 %) is shown as such and needs the operator's acceptance."""
    assert _differences([_gate()], recipe_policy(RECIPE)) == ["no gate on gsm8k (the policy requires {'min_recovery': 0.95})"]
    silent = _gate("gsm8k", status="inconclusive", signal=False, reason="all 100 items scored 0 on both models")
    assert _differences([_gate(), silent], recipe_policy(RECIPE)) == [
        "gsm8k was gated without signal (all 100 items scored 0 on both models): it decided nothing"
    ]
    one = Policy(gates=RECIPE.gates, require_all_tasks=False)
    assert _differences([_gate()], one) == []
    assert _differences([_gate("arc_easy")], one) == ["no gate on any task the policy names (gsm8k_ppl, gsm8k)"]


@pytest.mark.parametrize(
    ("gates", "expected"),
    [
        (
            [_gate(criteria={"max_increase": 1.0}), _gate("gsm8k")],
            "gsm8k_ppl word_perplexity,none was gated at {'max_increase': 1.0}, looser than the policy's {'min_recovery': 0.95}",
        ),
        (
            [_gate(items=20), _gate("gsm8k")],
            f"gsm8k_ppl word_perplexity,none passed on 20 items, below the policy's minimum of {MIN_ITEMS}",
        ),
        ([_gate(status="inconclusive"), _gate("gsm8k")], "gsm8k_ppl word_perplexity,none did not pass (inconclusive)"),
        ([_gate("arc_easy"), _gate("gsm8k")], "no gate on gsm8k_ppl (the policy requires {'min_recovery': 0.95})"),
        # The criteria say 0.95, the stated allowance was edited to +100 %: the looser of the two counts.
        (
            [_gate(allowed_degradation=10.0), _gate("gsm8k")],
            "gsm8k_ppl word_perplexity,none was gated at {'min_recovery': 0.95}, looser than the policy's {'min_recovery': 0.95}",
        ),
    ],
)
def test_each_shortfall_is_named(gates: list[dict], expected: str) -> None:
    assert _differences(gates, recipe_policy(RECIPE)) == [expected]


def test_a_policy_gate_without_a_metric_is_met_only_by_the_headline_metric() -> None:
    """flexible-extract in place of strict-match (gsm8k's headline) does not meet `gsm8k: 0.95`."""
    policy = Policy(gates={"gsm8k": 0.95})
    other = _gate("gsm8k", metric="exact_match,flexible-extract", headline=False)
    assert _differences([other], policy) == ["no gate on gsm8k (the policy requires {'min_recovery': 0.95})"]
    assert _differences([other | {"headline": True}], policy) == []
    named = Policy(gates={"gsm8k": {"metric": "exact_match,strict-match", "min_recovery": 0.95}})
    assert _differences([other | {"headline": True}], named) == [
        "no gate on gsm8k@exact_match,strict-match (the policy requires {'min_recovery': 0.95})"
    ]


def test_an_operator_policy_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("gates:\n  gsm8k_ppl: {max_increase: 0.02}\n  gsm8k: 0.95\nmin_items: 200\nrequire_all_tasks: true\n")
    policy = read_policy(path)
    assert policy == Policy(
        gates={"gsm8k_ppl": {"max_increase": 0.02}, "gsm8k": 0.95}, min_items=200, require_all_tasks=True, source=str(path)
    )
    assert _differences([_gate()], policy) == [
        "gsm8k_ppl word_perplexity,none passed on 100 items, below the policy's minimum of 200",
        "no gate on gsm8k (the policy requires {'min_recovery': 0.95})",
    ]
    path.write_text("gates: {gsm8k: {max_dorp: 1}}\n")
    with pytest.raises(QserveError, match=r"^policy file .*policy.yaml is invalid: "):
        read_policy(path)


def _sign(ckpt: Path, *extra: str) -> tuple[int, str]:
    """`qserve sign` with a fresh key: its exit code and last stderr line."""
    private, _ = make_keys(ckpt.parent, "owner")
    proc = run_qserve_in_process("sign", ckpt, "--private-key", private, *extra)
    return proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1]


def test_sign_refuses_a_looser_gate_and_records_an_accepted_difference(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, [_gate(items=20), _gate("gsm8k")])
    assert _sign(ckpt) == (
        1,
        f"error: the gate record does not meet the policy of recipe r: gsm8k_ppl word_perplexity,none passed on 20 items, "
        f"below the policy's minimum of {MIN_ITEMS} (re-run `qserve eval` with the policy's gates and --limit, or pass --accept-gate-difference)",
    )
    assert not (ckpt / "qserve_signature.sig").exists()
    assert _sign(ckpt, "--accept-gate-difference")[0] == 0
    record = json.loads((ckpt / EVAL_NAME).read_text())
    assert record["waivers"] == [
        {
            "accepted_by": "sign",
            "override": "--accept-gate-difference",
            "policy": "recipe r",
            "differences": [f"gsm8k_ppl word_perplexity,none passed on 20 items, below the policy's minimum of {MIN_ITEMS}"],
        }
    ]
    assert (
        "**Gate below its policy, accepted by the operator** (`qserve sign --accept-gate-difference`"
        in (ckpt / CARD_NAME).read_text()
    )


def test_a_policy_file_below_the_recipe_leaves_a_trace_in_the_record_and_the_card(tmp_path: Path) -> None:
    """`--policy FILE` that the record meets, where the recipe's own policy would refuse it: signed,
    and the record and the card say which policy stood in for the recipe's and what it let through."""
    ckpt = _checkpoint(tmp_path, [_gate()])
    loose = tmp_path / "loose.yaml"
    loose.write_text("gates:\n  gsm8k_ppl: 0.95\n")
    assert _sign(ckpt, "--policy", str(loose))[0] == 0
    (waiver,) = json.loads((ckpt / EVAL_NAME).read_text())["waivers"]
    assert waiver == {
        "accepted_by": "sign",
        "override": f"--policy {loose}",
        "policy": "recipe r",
        "differences": ["no gate on gsm8k (the policy requires {'min_recovery': 0.95})"],
    }
    assert (
        f"**Gate below its policy, accepted by the operator** (`qserve sign --policy {loose}`, policy of recipe r)"
        in (ckpt / CARD_NAME).read_text()
    )


def test_a_tune_search_record_is_no_gate(tmp_path: Path) -> None:
    """The search keeps the best of several candidates on the same items: its record is not a gate."""
    ckpt = _checkpoint(tmp_path, [_gate()])
    record = json.loads((ckpt / EVAL_NAME).read_text())
    # as the search writes it: no look at the weights (number None), so the record must still load
    search_look = {"number": None, "level": 0.0304, "earlier": [], "counted": False}
    (ckpt / EVAL_NAME).write_text(json.dumps(record | {"purpose": "tune search", "look": search_look}))
    assert _sign(ckpt) == (
        1,
        f"error: {ckpt}'s gate record is from a `qserve tune` search, which kept the best of several candidates on the same "
        f"items; its gate is the tune's confirmation on held-out items, or `qserve eval {ckpt}`",
    )


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"verdict": "passed"}, "(verdict: Input should be 'pass', 'fail' or 'inconclusive')"),
        ({"verdikt": "pass"}, "(verdikt: Extra inputs are not permitted)"),
        ({"gates": "all"}, "(gates: Input should be a valid list)"),
        ({"schema_version": 2}, "was written by a newer qserve (schema 2); upgrade qserve"),
    ],
)
def test_an_eval_record_outside_its_schema_is_refused_in_one_line(tmp_path: Path, edit: dict, message: str) -> None:
    from qserve.gate.records import check_gate

    ckpt = _checkpoint(tmp_path, [_gate("gsm8k_ppl"), _gate("gsm8k")])
    record = json.loads((ckpt / EVAL_NAME).read_text())
    (ckpt / EVAL_NAME).write_text(json.dumps(record | edit))
    with pytest.raises(QserveError) as e:
        check_gate(ckpt)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(f"{ckpt / EVAL_NAME} ")
