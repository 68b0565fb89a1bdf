"""docs/benchmark-power.md: the items a 0/1 gate needs, checked against the exact test by simulation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qserve.gate import looks, paired_binary, power

REPO = Path(__file__).resolve().parents[1]
DRAWS = 4000  # Monte-Carlo SE of a power near 0.8: 0.0063


def test_the_page_is_what_the_module_makes() -> None:
    text = (REPO / "docs" / "benchmark-power.md").read_text()
    assert text == power.page(), "docs/benchmark-power.md is stale: python -m qserve.gate.power > docs/benchmark-power.md"


@pytest.mark.parametrize(("flip", "allowance"), [(0.02, 0.01), (0.05, 0.04), (0.10, 0.03), (0.05, 0.02)])
def test_the_items_needed_give_the_exact_test_its_power(flip: float, allowance: float) -> None:
    # The page's figure is the score test's normal approximation; the exact test, simulated at that n,
    # passed 0.792-0.805 of the time at these four cells (4,000 draws): 0.03 allows 4.7 SE and
    # the approximation's measured error.
    n = power.items_needed(flip, allowance)
    counts = np.random.default_rng([7, n]).multinomial(n, [flip, flip, 1 - 2 * flip], size=DRAWS)
    rate = float(np.mean(paired_binary.passes(counts[:, 0], counts[:, 1], n, allowance, looks.level(1))))
    assert abs(rate - power.POWER) <= 0.03, (n, rate)


def test_a_benchmark_too_small_for_a_gate_rarely_passes_it() -> None:
    # IFEval's 541 prompts at 10 % flips against a 1-point allowance: the page says no, and the exact
    # test passes such a model far below 80 % (0.084 in a seeded run).
    assert (
        "| ifeval (train, the only split) | 541 | no | no | yes | yes | no | no | no | yes | no | no | no | no |" in power.page()
    )
    counts = np.random.default_rng(7).multinomial(541, [0.1, 0.1, 0.8], size=DRAWS)
    assert float(np.mean(paired_binary.passes(counts[:, 0], counts[:, 1], 541, 0.01, looks.level(1)))) < 0.2


@pytest.mark.parametrize("path", sorted((REPO / "recipes" / "gpu").glob("*.yaml")), ids=lambda p: p.stem)
def test_a_gpu_example_recipe_gates_what_its_benchmarks_can_decide(path: Path) -> None:
    """The shipped GPU example parses, lm-eval resolves every task it gates (mmlu as its group), and each
    0/1 gate's allowance is one its benchmark holds the items to pass at 5 % of items flipping each way."""
    from qserve.evaluate.tasks import resolve_tasks
    from qserve.spec.recipe import load_recipe

    recipe, _ = load_recipe(path)
    resolved = resolve_tasks(list(recipe.gates))
    assert resolved.units == list(recipe.gates) and set(resolved.groups) == {"mmlu"}
    sizes = {name.split(" ")[0]: n for name, n in power.BENCHMARKS.items()}
    for task, specs in recipe.gates.items():
        for spec in specs:
            assert spec.max_drop is not None and sizes[task] >= power.items_needed(0.05, spec.max_drop), (task, spec)
