"""Bad input, at scale: property-based fuzzing (hypothesis) of recipes, gate specs and vLLM
pass-through arguments through the real CLI (in process). Every input either works or ends in one
`error:` line with exit 1 (click's own usage errors: one `Error:` line, exit 2, as documented);
never a traceback, never an output directory. The model is an empty directory, so an input that
is valid ends at the model check, before any work: what is fuzzed is everything checked before it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_qserve_in_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("QSERVE_FUZZ_EXAMPLES", "250"))  # more for a long run
ENDED: dict[str, list[str]] = {}  # kind -> the error line each example ended in

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
LINKED_KEYS = RECIPE_KEYS[1:8] + ["kv_cache", "calibration"]  # the fields checked against each other
YAML_PUNCTUATION = "{}[]:,-?'\"\t\n #&*!|>%@`ab1"
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
    kind = draw(st.sampled_from(["mutated", "crossed", "built", "text"]))
    if kind == "text":  # anything, YAML's own punctuation, or YAML that is not a mapping of fields
        return draw(st.text(max_size=300) | st.text(YAML_PUNCTUATION, max_size=40) | values.map(yaml.safe_dump))
    if kind == "crossed":  # well-typed fields from two shipped recipes: what the checks across fields see
        doc, other = (dict(draw(st.sampled_from(SHIPPED))) for _ in range(2))
        for key in draw(st.lists(st.sampled_from(LINKED_KEYS), max_size=3)):
            doc.pop(key, None)
            if key in other:
                doc[key] = other[key]
        return yaml.safe_dump(doc)
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
well_formed_gate_specs = st.builds(  # what the checks after the syntax see
    lambda task, criterion, number: f"{task}{criterion}={number:g}",
    st.sampled_from(["gsm8k", "gsm8k_ppl", "gsm8k@acc", "arc_easy"]),
    st.sampled_from(["", ":max_drop", ":min_recovery", ":max_increase"]),
    st.floats(0, 2),
)


def _one_error_and_nothing_written(proc, out: Path) -> str:
    """Asserts the run ended in one error line and wrote nothing; returns that line."""
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr + proc.stdout
    if proc.returncode == 2:  # click's usage error
        assert [ln for ln in lines if ln.startswith("Error: ")] == [lines[-1]], proc.stderr
    else:
        assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
        assert [ln for ln in lines if ln.startswith("error:")] == [lines[-1]], proc.stderr
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    return lines[-1]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    (root / "empty-model").mkdir()
    return root


FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], database=None)


@FUZZ
@given(text=recipe_texts())
def _fuzzed_recipes(work: Path, text: str) -> None:
    recipe, out = work / "recipe.yaml", work / "out"
    recipe.write_text(text)
    proc = run_qserve_in_process("quantize", recipe, "--model", work / "empty-model", "--output", out)
    ENDED["recipes"].append(_one_error_and_nothing_written(proc, out))


@FUZZ
@given(specs=st.lists(gate_specs, min_size=1, max_size=3) | st.lists(well_formed_gate_specs, min_size=1, max_size=2))
def _fuzzed_gate_specs(work: Path, specs: list[str]) -> None:
    out = work / "out"
    gates = [t for spec in specs for t in ("--gate", spec)]
    proc = run_qserve_in_process("run", REPO / "recipes" / "fp8.yaml", "--model", work / "empty-model", "--output", out, *gates)
    ENDED["gate specs"].append(_one_error_and_nothing_written(proc, out))


def _vllm_flags() -> list[str]:
    from qserve.engines.flags import _serve_parser

    return sorted({s for a in _serve_parser()._actions for s in a.option_strings})


def _well_formed_options() -> list[list[str]]:
    """vLLM's switches alone and its options with a choice each: what its parser accepts, so what
    qserve's own checks after it see."""
    from qserve.engines.flags import _serve_parser

    actions = [a for a in _serve_parser()._actions if a.option_strings]
    switches = [[a.option_strings[0]] for a in actions if a.nargs == 0]
    return switches + [[a.option_strings[0], str(c)] for a in actions if a.choices for c in a.choices]


@FUZZ
@given(data=st.data())
def _fuzzed_pass_through_arguments(work: Path, data) -> None:
    token = st.one_of(
        st.sampled_from(_vllm_flags()), st.text(max_size=12), st.sampled_from(["1", "0", "true", "auto", "fp8", "{}", "[]"])
    )
    well_formed = st.lists(st.sampled_from(_well_formed_options()), min_size=1, max_size=2).map(lambda o: sum(o, []))
    tokens = data.draw(st.lists(token, min_size=1, max_size=6) | well_formed)
    out = work / "out"
    proc = run_qserve_in_process(
        "run", REPO / "recipes" / "fp8.yaml", "--model", work / "empty-model", "--output", out, "--", *tokens
    )
    ENDED["pass-through argument lists"].append(_one_error_and_nothing_written(proc, out))


# The checks each kind of input must reach, by the error line it ends in: a fuzzer stuck at the first
# of them would prove less than it says; the last is the model check, reached by a valid input. Named
# here: the checks each of 5 measured runs of 250 (recipes 3) reached at least 13 times, so missing one
# is not chance. Rarer ends (YAML syntax, a scalar, an unknown field, a clash across fields) are
# printed, not required.
MODEL = r"model directory \S+ has no config\.json"
CHECKS = {
    "recipes": {"missing field": r": Field required", "field type": r": Input should be", "valid": MODEL},
    "gate specs": {
        "syntax": r"expected TASK\[@METRIC\]\[:CRITERION\]=VALUE",
        "range": r"Input should be greater than",
        "recovery above 1": r"min_recovery \S+ is above",
        "task not run": r"which this eval does not run",
        "valid": MODEL,
    },
    "pass-through argument lists": {
        "unknown flag": r"unrecognized arguments",
        "bad value": r"argument --[\w-]+: ",
        "refused flag": r"cannot be passed to vLLM",
        "valid": MODEL,
    },
}


def unreached(kind: str, ended: list[str]) -> list[str]:
    """The checks of `kind` no example ended at."""
    return [check for check, pattern in CHECKS[kind].items() if not any(re.search(pattern, line) for line in ended)]


def test_a_fuzzer_stuck_at_the_first_check_is_caught() -> None:
    ended = ["error: /tmp/r.yaml: malformed YAML: unacceptable character #x0000"] * EXAMPLES
    assert unreached("recipes", ended) == ["missing field", "field type", "valid"]
    assert unreached("recipes", [*ended, "error: /tmp/r.yaml:1: name: Field required"]) == ["field type", "valid"]


@pytest.mark.parametrize(
    ("kind", "fuzz"),
    [
        ("recipes", _fuzzed_recipes),
        ("gate specs", _fuzzed_gate_specs),
        ("pass-through argument lists", _fuzzed_pass_through_arguments),
    ],
)
def test_fuzzed_inputs_end_in_one_error_line(work: Path, kind: str, fuzz) -> None:
    """Each kind of input, EXAMPLES of them: every one ends in one error line and writes nothing, at
    least that many were really run (hypothesis may run more, as interactive draws that overran its
    buffer are not counted as examples), and they reached every check CHECKS names, valid inputs
    included."""
    ENDED[kind] = []
    fuzz(work)
    reached = {check: sum(bool(re.search(p, line)) for line in ENDED[kind]) for check, p in CHECKS[kind].items()}
    print(f"\nfuzz: {len(ENDED[kind])} {kind} tried, ending at {reached}, elsewhere {len(ENDED[kind]) - sum(reached.values())}")
    assert len(ENDED[kind]) >= EXAMPLES
    assert unreached(kind, ENDED[kind]) == []
