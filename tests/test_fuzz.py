"""Bad input, at scale: property-based fuzzing (hypothesis) of recipes, gate specs and vLLM
pass-through arguments through the real CLI (in process). Every input either works or ends in one
`error:` line with exit 1 (click's own usage errors: one `Error:` line, exit 2, as documented);
never a traceback, never an output directory. The model is an empty directory, so an input that
is valid ends at the model check, before any work: what is fuzzed is everything checked before it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_qserve_in_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("QSERVE_FUZZ_EXAMPLES", "250"))  # more for a long run
TRIED: dict[str, int] = {}

SHIPPED = [yaml.safe_load(p.read_text()) for p in sorted((REPO / "recipes").glob("*.yaml"))]
WORDS = [
    "W8A8",
    "W4A16",
    "FP8_DYNAMIC",
    "NVFP4A16",
    "MXFP4",
    "gptq",
    "awq",
    "autoround",
    "llmcompressor",
    "quark",
    "bfloat16",
    "float16",
    "lm_head",
    "re:.*mlp.*",
    "gsm8k",
    "gsm8k_ppl",
    "auto",
    "fp8",
    "offload",
    "-1",
    "1e309",
]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**9), 10**9), st.floats(), st.text(max_size=16), st.sampled_from(WORDS)
)
values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8) | st.sampled_from(WORDS), c, max_size=4),
    max_leaves=10,
)
RECIPE_KEYS = [
    "name",
    "backend",
    "scheme",
    "algorithm",
    "algorithm_options",
    "group_size",
    "smoothquant",
    "sparsity",
    "ignore",
    "overrides",
    "calibration",
    "kv_cache",
    "gates",
    "dtype",
    "execution",
    "modifiers",
]
CALIBRATION_KEYS = [
    "source",
    "path",
    "dataset",
    "split",
    "text",
    "messages",
    "generate",
    "weight",
    "mix",
    "samples",
    "seq_len",
    "seed",
]


@st.composite
def recipe_texts(draw) -> str:
    kind = draw(st.sampled_from(["mutated", "built", "text"]))
    if kind == "text":
        return draw(st.text(max_size=300))
    doc = dict(draw(st.sampled_from(SHIPPED))) if kind == "mutated" else {}
    for key in draw(st.lists(st.sampled_from(RECIPE_KEYS) | st.text(max_size=8), min_size=1, max_size=4)):
        doc[key] = draw(values)
    if draw(st.booleans()):
        doc["calibration"] = draw(st.dictionaries(st.sampled_from(CALIBRATION_KEYS), values, max_size=4))
    return yaml.safe_dump(doc)


gate_specs = st.one_of(
    st.text(max_size=40),
    st.builds(
        lambda task, criterion, number: f"{task}{criterion}={number}",
        st.sampled_from(["gsm8k", "gsm8k_ppl", "arc_easy", "", "x y", "gsm8k@acc"]),
        st.sampled_from(["", ":max_drop", ":min_recovery", ":max_increase", ":bogus", ":", "::"]),
        st.one_of(st.floats().map(repr), st.integers().map(str), st.text(max_size=6)),
    ),
)


def _assert_one_error_and_nothing_written(proc, out: Path) -> None:
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr + proc.stdout
    if proc.returncode == 2:  # click's usage error
        assert [ln for ln in lines if ln.startswith("Error: ")] == [lines[-1]], proc.stderr
    else:
        assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
        assert [ln for ln in lines if ln.startswith("error:")] == [lines[-1]], proc.stderr
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    (root / "empty-model").mkdir()
    return root


FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], database=None)


@FUZZ
@given(text=recipe_texts())
def _fuzzed_recipes(work: Path, text: str) -> None:
    TRIED["recipes"] = TRIED.get("recipes", 0) + 1
    recipe, out = work / "recipe.yaml", work / "out"
    recipe.write_text(text)
    proc = run_qserve_in_process("quantize", recipe, "--model", work / "empty-model", "--output", out)
    _assert_one_error_and_nothing_written(proc, out)


@FUZZ
@given(specs=st.lists(gate_specs, min_size=1, max_size=3))
def _fuzzed_gate_specs(work: Path, specs: list[str]) -> None:
    TRIED["gate specs"] = TRIED.get("gate specs", 0) + 1
    out = work / "out"
    gates = [t for spec in specs for t in ("--gate", spec)]
    proc = run_qserve_in_process(
        "run", REPO / "recipes" / "w8a8-int8.yaml", "--model", work / "empty-model", "--output", out, *gates
    )
    _assert_one_error_and_nothing_written(proc, out)


def _vllm_flags() -> list[str]:
    from qserve.engines.flags import _serve_parser

    return sorted({s for a in _serve_parser()._actions for s in a.option_strings})


@FUZZ
@given(data=st.data())
def _fuzzed_pass_through_arguments(work: Path, data) -> None:
    TRIED["pass-through argument lists"] = TRIED.get("pass-through argument lists", 0) + 1
    token = st.one_of(
        st.sampled_from(_vllm_flags()), st.text(max_size=12), st.sampled_from(["1", "0", "true", "auto", "fp8", "{}", "[]"])
    )
    tokens = data.draw(st.lists(token, min_size=1, max_size=6))
    out = work / "out"
    proc = run_qserve_in_process(
        "run", REPO / "recipes" / "w8a8-int8.yaml", "--model", work / "empty-model", "--output", out, "--", *tokens
    )
    _assert_one_error_and_nothing_written(proc, out)


@pytest.mark.parametrize(
    ("kind", "fuzz"),
    [
        ("recipes", _fuzzed_recipes),
        ("gate specs", _fuzzed_gate_specs),
        ("pass-through argument lists", _fuzzed_pass_through_arguments),
    ],
)
def test_fuzzed_inputs_end_in_one_error_line(work: Path, kind: str, fuzz) -> None:
    """Each kind of input, EXAMPLES of them: every one ends in one error line and writes nothing, and
    at least that many were really run (a strategy that drew fewer would prove less than it says;
    hypothesis may run more, as interactive draws that overran its buffer are not counted as examples)."""
    TRIED[kind] = 0
    fuzz(work)
    print(f"\nfuzz: {TRIED[kind]} {kind} tried")
    assert TRIED[kind] >= EXAMPLES
