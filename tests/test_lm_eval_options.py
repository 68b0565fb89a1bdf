"""lm-eval's evaluation options (--num-fewshot, --apply-chat-template, --fewshot-as-multiturn,
--system-instruction, --gen-kwargs, --seed) without an engine: each mistake is one `error:` line
before any work, the recipe's eval section under the command line's, the baseline cache key and the
serve-side comparison. The run on both models is tests/test_registered_tasks.py's."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from conftest import REPO, free_port, run_qserve_in_process
from test_before_work import _one_error
from test_registered_tasks import _checkpoint

from qserve.errors import QserveError
from qserve.evaluate import baselines
from qserve.evaluate.evaluation import EvalOptions, plan_lm_eval
from qserve.spec.lm_eval_args import LmEvalArgs, lm_eval_differences
from qserve.spec.recipe import parse_recipe

GEN_KWARGS_HINT = "lm-eval splits on every comma, so give pairs such as temperature=0,max_gen_toks=256 (no lists)"
MULTITURN = (
    "error: --fewshot-as-multiturn needs --apply-chat-template: lm-eval lays few-shot examples out as chat turns "
    "only through a chat template (it refuses the one without the other)"
)


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--num-fewshot", "-1"], "error: --num-fewshot takes a number of examples, 0 or more; got -1"),
        (
            ["--gen-kwargs", "max_gen_toks"],
            f"error: --gen-kwargs 'max_gen_toks': 'max_gen_toks' is not KEY=VALUE; {GEN_KWARGS_HINT}",
        ),
        (["--gen-kwargs", "until=[a,b]"], f"error: --gen-kwargs 'until=[a,b]': 'b]' is not KEY=VALUE; {GEN_KWARGS_HINT}"),
        (["--gen-kwargs", "=0"], f"error: --gen-kwargs '=0': '=0' is not KEY=VALUE; {GEN_KWARGS_HINT}"),
        (
            ["--seed", "1,2"],
            "error: --seed '1,2': Argument requires 4 integers or None, separated by ',' "
            "(one value for all four, or python,numpy,torch,fewshot)",
        ),
        (
            ["--seed", "x"],
            "error: --seed 'x': x is not an integer or None (one value for all four, or python,numpy,torch,fewshot)",
        ),
        (["--fewshot-as-multiturn"], MULTITURN),
    ],
)
def test_a_bad_option_is_one_error_line_before_any_work(tmp_path: Path, args: list[str], line: str) -> None:
    ckpt = _checkpoint(tmp_path)
    before = _files(ckpt)
    _one_error(run_qserve_in_process("eval", ckpt, "--tasks", "gsm8k", *args), line)
    assert _files(ckpt) == before  # no record, no log


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_run_refuses_multiturn_without_a_template_before_it_quantizes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_qserve_in_process(
        # FP8_DYNAMIC: every CPU met serves it, so no hardware refusal comes before this check
        "run",
        REPO / "recipes" / "fp8.yaml",
        "--output",
        out,
        "--port",
        str(free_port()),
        "--fewshot-as-multiturn",
    )
    _one_error(proc, MULTITURN)
    assert "quantizing" not in proc.stderr and not out.exists()


def test_a_bare_apply_chat_template_leaves_the_checkpoint_argument_alone(tmp_path: Path) -> None:
    """lm-eval's flag takes an optional template name; qserve's takes one only as =NAME, so the word after a
    bare flag stays CHECKPOINT, and the flag satisfies --fewshot-as-multiturn (the next check fails instead)."""
    ckpt = _checkpoint(tmp_path)
    for flag in ("--apply-chat-template", "--apply-chat-template=default"):
        proc = run_qserve_in_process("eval", flag, ckpt, "--fewshot-as-multiturn", "--tasks", "zzqqxx")
        _one_error(proc, "error: unknown task zzqqxx")


RECIPE = "name: t\nscheme: W8A8\ncalibration: {source: gsm8k-train}\n"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("eval:\n  num_fewshot: -1\n", "r.yaml:5: eval.num_fewshot: Input should be greater than or equal to 0"),
        (
            "eval:\n  fewshot_as_multiturn: true\n",
            "r.yaml:4: eval: fewshot_as_multiturn needs apply_chat_template: lm-eval lays few-shot examples out as chat "
            "turns only through a chat template (it refuses the one without the other)",
        ),
        (
            "eval:\n  gen_kwargs: temperature\n",
            f"r.yaml:4: eval: gen_kwargs 'temperature': 'temperature' is not KEY=VALUE; {GEN_KWARGS_HINT}",
        ),
        (
            "eval:\n  nshot: 3\n",
            "r.yaml:5: eval.nshot: unknown field; valid fields: num_fewshot, apply_chat_template, fewshot_as_multiturn, "
            "system_instruction, gen_kwargs, seed",
        ),
    ],
)
def test_a_recipe_eval_section_is_checked_with_its_line(section: str, message: str) -> None:
    with pytest.raises(QserveError) as e:
        parse_recipe(RECIPE + section, "r.yaml")
    assert str(e.value) == message


def test_the_command_line_wins_over_the_recipe_field_by_field() -> None:
    recipe = parse_recipe(RECIPE + "eval:\n  num_fewshot: 5\n  apply_chat_template: true\n  seed: 7\n").eval
    assert recipe is not None
    section = recipe.args()
    cli = LmEvalArgs.parse(num_fewshot=2, fewshot_as_multiturn=False, gen_kwargs="max_gen_toks=64,do_sample=false")
    merged = plan_lm_eval(section, EvalOptions(lm_eval=cli)).resolved()
    assert merged == {
        "num_fewshot": 2,  # the command line's
        "apply_chat_template": True,  # the recipe's
        "fewshot_as_multiturn": False,  # the command line's, over the template's default
        "system_instruction": None,
        "gen_kwargs": {"max_gen_toks": 64, "do_sample": False},  # typed as lm-eval's parser types them
        "random_seed": 7,
        "numpy_random_seed": 7,
        "torch_random_seed": 7,
        "fewshot_random_seed": 7,
    }
    # the recipe's template lets the command line ask for multi-turn few-shot
    assert plan_lm_eval(section, EvalOptions(lm_eval=LmEvalArgs.parse(fewshot_as_multiturn=True))).resolved()[
        "fewshot_as_multiturn"
    ]


def test_defaults_are_lm_evals_own_and_every_keyword_is_simple_evaluates() -> None:
    import lm_eval
    from lm_eval.config.evaluate_config import DEFAULT_SEED

    resolved = LmEvalArgs().resolved()
    assert set(resolved) <= set(inspect.signature(lm_eval.simple_evaluate).parameters)
    seeds = [resolved[k] for k in ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")]
    assert seeds == list(DEFAULT_SEED) == [0, 1234, 1234, 1234]
    assert (resolved["apply_chat_template"], resolved["fewshot_as_multiturn"], resolved["num_fewshot"]) == (False, False, None)
    # lm-eval's CLI: with a chat template, few-shot examples become turns unless told otherwise
    assert LmEvalArgs.parse(apply_chat_template="").resolved()["fewshot_as_multiturn"] is True


def _key(args: LmEvalArgs) -> dict:
    config = {"task": "t", "num_fewshot": 5, "output_type": "generate_until"}
    return baselines.task_key("m", config, 10, {}, "cpu", scoring=None, lm_eval=args.resolved())


def test_a_baseline_made_with_other_options_is_another_cache_entry() -> None:
    default = _key(LmEvalArgs())
    others = [
        LmEvalArgs(num_fewshot=0),
        LmEvalArgs(apply_chat_template=True),
        LmEvalArgs(apply_chat_template=True, fewshot_as_multiturn=False),
        LmEvalArgs(apply_chat_template="tool_use"),
        LmEvalArgs(system_instruction="Be brief."),
        LmEvalArgs.parse(gen_kwargs="max_gen_toks=64"),
        LmEvalArgs.parse(seed="1"),
        LmEvalArgs.parse(seed="0,1234,1234,None"),
    ]
    keys = [_key(a) for a in others]
    paths = {baselines.entry_path(k) for k in [default, *keys]}
    assert len(paths) == len(others) + 1  # all different, from the default and from each other
    # lm-eval's defaults given explicitly are the same measurement
    assert _key(LmEvalArgs.parse(seed="0,1234,1234,1234", fewshot_as_multiturn=False)) == default


def test_a_record_made_with_other_options_does_not_meet_a_recipe_that_names_them() -> None:
    section = LmEvalArgs.from_recipe({"num_fewshot": 5, "apply_chat_template": True})
    made_so = {
        "num_fewshot": 5,
        "apply_chat_template": True,
        "fewshot_as_multiturn": True,
        "system_instruction": "Be brief.",  # not named by the recipe: free
        "gen_kwargs": None,
        "random_seed": 1,
        "numpy_random_seed": 1,
        "torch_random_seed": 1,
        "fewshot_random_seed": 1,
    }
    assert lm_eval_differences(section, {"lm_eval": made_so}) == []
    otherwise = made_so | {"num_fewshot": 0, "fewshot_as_multiturn": False}
    assert lm_eval_differences(section, {"lm_eval": otherwise}) == [
        "num_fewshot: the record was made with 0, the recipe names 5",
        "fewshot_as_multiturn: the record was made with False, the recipe names True",
    ]
    assert lm_eval_differences(section, {"tasks": ["gsm8k"]}) == [
        "the record does not say which lm-eval options it was made with (the recipe names num_fewshot, apply_chat_template)"
    ]
    assert lm_eval_differences(LmEvalArgs(), {"lm_eval": otherwise}) == []
