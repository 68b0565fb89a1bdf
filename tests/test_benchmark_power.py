"""docs/benchmark-power.md: the items a 0/1 gate needs, checked through the gate's own decision."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from qserve.gate import power
from qserve.gate.betting import Population
from qserve.gate.evidence import decide_gate
from qserve.spec.gates import GateSpec

REPO = Path(__file__).resolve().parents[1]
RUNS = 300  # binomial SE of a share near 0.8: 0.023


def test_the_page_is_what_the_module_makes() -> None:
    text = (REPO / "docs" / "benchmark-power.md").read_text()
    assert text == power.page(), "docs/benchmark-power.md is stale: python -m qserve.gate.power > docs/benchmark-power.md"


@pytest.mark.parametrize(("size", "flip", "allowance"), [(1319, 0.05, 0.03), (541, 0.10, 0.01), (1172, 0.02, 0.05)])
def test_at_the_items_the_page_gives_the_gate_passes_4_runs_in_5(size: int, flip: float, allowance: float) -> None:
    """Fresh orders (not the page's seed) of a test set with round(flip * size) items lost and as many
    gained, scored 0/1 and bet on by evidence.decide_gate up to the page's figure: about 80 % pass. The
    page's figure is an 80th percentile of 400 runs (its rank +-2 % of runs) and this share has SE 0.023
    over 300 runs: 0.09 allows about 3 SE of both."""
    n = int(power.items_needed(flip, allowance, size))
    k = round(flip * size)
    base = {i: 1.0 if i < k else 0.0 for i in range(size)}  # items 0..k-1 lost, k..2k-1 gained
    quant = {i: 1.0 if k <= i < 2 * k else 0.0 for i in range(size)}
    for i in range(2 * k, size):
        base[i] = quant[i] = float(i % 2)
    rng, passed = random.Random(11), 0
    for _ in range(RUNS):
        order = rng.sample(range(size), size)
        got = decide_gate(base, quant, GateSpec(max_drop=allowance), "acc,none", True, Population.in_order(order), limit=n)
        passed += got.status == "pass"
    assert abs(passed / RUNS - power.SHARE) <= 0.09, (n, passed / RUNS)


def test_a_whole_test_set_decides_a_model_that_loses_nothing() -> None:
    """Taken without replacement, the last item decides exactly: no cell exceeds its benchmark's size."""
    for size in (541, 1319):
        assert power.items_needed(0.10, 0.01, size) <= size
        assert power.items_needed(0.10, 0.01) > size  # while a sample of that size rarely would


@pytest.mark.parametrize("path", sorted((REPO / "recipes" / "gpu").glob("*.yaml")), ids=lambda p: p.stem)
def test_a_gpu_example_recipe_gates_what_its_benchmarks_can_decide(path: Path) -> None:
    """The shipped GPU example parses, lm-eval resolves every task it gates (mmlu as its group), and each
    0/1 gate's allowance is one its benchmark's seeded order decides before its last item 4 runs in 5
    at 5 % of items flipping each way."""
    from qserve.evaluate.tasks import resolve_tasks
    from qserve.spec.recipe import load_recipe

    recipe, _ = load_recipe(path)
    resolved = resolve_tasks(list(recipe.gates))
    assert resolved.units == list(recipe.gates) and set(resolved.groups) == {"mmlu"}
    sizes = {name.split(" ")[0]: n for name, n in power.BENCHMARKS.items()}
    for task, specs in recipe.gates.items():
        for spec in specs:
            assert spec.max_drop is not None and power.items_needed(0.05, spec.max_drop, sizes[task]) < sizes[task], (task, spec)
