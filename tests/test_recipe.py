"""Recipe parsing and validation: every user mistake gets a message naming the field and line."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, run_qserve

from qserve.errors import QserveError
from qserve.schemes.catalog import SCHEMES
from qserve.spec.recipe import load_recipe, parse_recipe

VALID = """\
name: t
scheme: W4A16
group_size: 64
calibration:
  path: gsm8k/train.jsonl
  text: "{question}"
"""


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_parse(path: Path) -> None:
    recipe, digest = load_recipe(path)
    assert recipe.name == path.stem
    assert len(digest) == 64
    assert (recipe.scheme is None) == (recipe.modifiers is not None)


def test_valid_recipe() -> None:
    r = parse_recipe(VALID)
    assert (r.scheme, r.group_size, r.calibration.samples) == ("W4A16", 64, 64)


def test_unknown_scheme_lists_choices() -> None:
    with pytest.raises(QserveError) as e:
        parse_recipe(VALID.replace("W4A16", "W3A3"), "r.yaml")
    assert str(e.value) == f"r.yaml:2: scheme: unknown scheme 'W3A3'; choose one of: {', '.join(SCHEMES)}"
    assert "FP8_DYNAMIC, FP8, W8A8, W4A16" in str(e.value)  # the registry's order


def test_unknown_nested_field_names_line_and_valid_fields() -> None:
    with pytest.raises(QserveError) as e:
        parse_recipe(VALID + "  sample: 3\n", "r.yaml")
    assert str(e.value).startswith(
        "r.yaml:7: calibration.sample: unknown field; valid fields: source, description, path, dataset, subset, split, text, messages"
    )


def test_malformed_yaml_names_line() -> None:
    with pytest.raises(QserveError) as e:
        parse_recipe("name: t\nscheme: [W4A16\n", "r.yaml")
    assert str(e.value).startswith("r.yaml:3: malformed YAML")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("scheme: W4A16\nalgorithm: gptq\n", "algorithm gptq need"),
        ("scheme: W4A16\nalgorithm: awq\n", "algorithm awq need"),
        ("scheme: FP8\n", "FP8's static activation scales need"),
        ("scheme: W4A16\nkv_cache: {dtype: fp8}\n", "kv_cache scales need"),
        ("backend: quark\nscheme: FP8\n", "FP8's static activation scales need"),
    ],
)
def test_data_hungry_recipe_without_calibration(body: str, reason: str) -> None:
    with pytest.raises(QserveError, match=f"{reason} a calibration section"):
        parse_recipe("name: t\n" + body)


def test_data_free_recipes_need_no_calibration() -> None:
    assert parse_recipe("name: t\nscheme: MXFP4\n").calibration is None
    assert parse_recipe("name: t\nbackend: quark\nscheme: mxfp4\n").scheme == "MXFP4"


def test_scheme_not_offered_by_backend_lists_what_is() -> None:
    with pytest.raises(QserveError) as e:
        parse_recipe("name: t\nbackend: quark\nscheme: W8A8\n", "r.yaml")
    assert str(e.value) == "r.yaml:1: recipe: scheme W8A8 is not available with backend quark; it offers: FP8, W4A16, MXFP4"


def test_unknown_backend_lists_choices() -> None:
    with pytest.raises(QserveError) as e:
        parse_recipe("name: t\nbackend: gguf\nscheme: W8A8\n", "r.yaml")
    assert str(e.value).startswith("r.yaml:2: backend: Input should be 'llmcompressor' or 'quark'")


def test_every_registered_backend_implements_the_runner_interface_and_names_its_schemes() -> None:
    import inspect

    from qserve.quantize.backends import BackendRunner, runner
    from qserve.schemes.backends import BACKENDS
    from qserve.schemes.catalog import SCHEMES

    wanted = {name: inspect.signature(getattr(BackendRunner, name)) for name in ("quantize", "exported_scheme")}
    for name in BACKENDS:
        module = runner(name)
        # the module's functions take the Protocol's parameters (the Protocol's `self` aside)
        got = {f: list(inspect.signature(getattr(module, f)).parameters) for f in wanted}
        assert got == {f: list(sig.parameters)[1:] for f, sig in wanted.items()}, name
    assert {b for s in SCHEMES.values() for b in s.backends} == set(BACKENDS)


def test_a_backend_registered_twice_is_refused() -> None:
    from qserve.schemes.backends import BACKENDS, register_backend

    with pytest.raises(ValueError, match="^backend 'quark' is registered twice$"):
        register_backend(BACKENDS["quark"])


def test_quark_takes_no_llmcompressor_algorithms() -> None:
    with pytest.raises(QserveError, match="with backend quark, qserve runs Quark's plain"):
        parse_recipe("name: t\nbackend: quark\nscheme: FP8\nalgorithm: gptq\ncalibration: {source: gsm8k-train}\n")


def test_awq_is_for_weight_only_schemes() -> None:
    with pytest.raises(QserveError, match="awq is offered for weight-only schemes; W8A8 quantizes activations too"):
        parse_recipe("name: t\nscheme: W8A8\nalgorithm: awq\ncalibration: {source: gsm8k-train}\n")
    with pytest.raises(QserveError, match="autoround is offered for weight-only schemes; FP8_DYNAMIC quantizes"):
        parse_recipe("name: t\nscheme: FP8_DYNAMIC\nalgorithm: autoround\ncalibration: {source: gsm8k-train}\n")


def test_scheme_and_modifiers_are_exclusive() -> None:
    with pytest.raises(QserveError, match="give either scheme or modifiers"):
        parse_recipe("name: t\nscheme: W8A8\nmodifiers: {QuantizationModifier: {scheme: W8A8}}\n")
    with pytest.raises(QserveError, match="give either scheme or modifiers"):
        parse_recipe("name: t\n")


PLAIN = """\
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: ["lm_head"]
      config_groups:
        group_0:
          targets: ["Linear"]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 64}
"""


def test_plain_llmcompressor_recipe_is_accepted_as_is() -> None:
    r = parse_recipe(PLAIN, "recipes/my-gptq.yaml")
    assert (r.name, r.backend, r.scheme) == ("my-gptq", "llmcompressor", None)
    assert r.modifiers["quant_stage"]["quant_modifiers"]["GPTQModifier"]["ignore"] == ["lm_head"]
    assert r.calibration is None  # quantize adds the default only if the modifiers calibrate


def test_plain_recipe_gets_default_calibration_only_when_its_modifiers_calibrate() -> None:
    from qserve.quantize.pipeline import with_default_calibration

    gptq = with_default_calibration(parse_recipe(PLAIN))
    assert (gptq.calibration.source, gptq.calibration.samples, gptq.calibration.seq_len) == ("gsm8k-train", 32, 256)
    dynamic = parse_recipe((REPO / "recipes" / "llmcompressor-fp8-dynamic.yaml").read_text())
    assert with_default_calibration(dynamic).calibration is None  # FP8 dynamic is data-free
    static = parse_recipe(
        PLAIN.replace("GPTQModifier", "QuantizationModifier")
        .replace("num_bits: 4, type: int", "num_bits: 8, type: float")
        .replace(
            "strategy: group, group_size: 64",
            "strategy: tensor}\n          input_activations: {num_bits: 8, type: float, strategy: tensor, dynamic: false",
        )
    )
    assert with_default_calibration(static).calibration is not None  # static activation scales need data


def test_plain_recipe_modifiers_are_checked_by_llmcompressor() -> None:
    from qserve.quantize.backends.llmcompressor import build_modifiers

    assert "GPTQModifier" in build_modifiers(parse_recipe(PLAIN))
    with pytest.raises(QserveError, match="llm-compressor rejected the recipe's modifiers"):
        build_modifiers(parse_recipe(PLAIN.replace("GPTQModifier", "GPTQModifer")))


def test_calibration_mix_and_generate_parse() -> None:
    r = parse_recipe(
        "name: t\nscheme: W4A16\nalgorithm: gptq\ncalibration:\n  samples: 10\n  mix:\n"
        "    - {source: gsm8k-train, weight: 3}\n    - {source: self-generated, weight: 1}\n"
    )
    kinds = [s.kind for s in r.calibration.sources()]
    assert kinds == ["file", "generate"] and r.calibration.mix[1].generate.prompts


@pytest.mark.parametrize(
    ("calibration", "error"),
    [
        ("{path: a.jsonl, dataset: x/y}", "give one of path, dataset or generate, not path and dataset"),
        ("{path: a.jsonl, text: '{q}', messages: m}", "give text or messages, not both"),
        ("{samples: 4}", "needs a source, path, dataset, generate or mix"),
        ("{source: nope}", "unknown calibration source 'nope'; available: gsm8k-train"),
        ("{mix: [{path: a.jsonl}], path: b.jsonl}", "a mix lists its sources under mix"),
    ],
)
def test_calibration_mistakes(calibration: str, error: str) -> None:
    with pytest.raises(QserveError, match=error.replace("(", r"\(")):
        parse_recipe(f"name: t\nscheme: W4A16\nalgorithm: gptq\ncalibration: {calibration}\n")


def test_group_size_on_per_channel_scheme() -> None:
    with pytest.raises(QserveError, match="group_size does not apply to W8A8"):
        parse_recipe(VALID.replace("W4A16", "W8A8"))


def test_yaml_is_parsed_safely() -> None:
    with pytest.raises(QserveError, match="malformed YAML"):
        parse_recipe("name: !!python/object/apply:os.system ['true']\nscheme: W4A16\n")


def test_cli_bad_recipe_is_one_line_and_nonzero(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: t\nscheme: NOPE\nalgorithm: rtn\n")
    proc = run_qserve("quantize", bad, "--output", tmp_path / "out")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: {bad}:2: scheme: unknown scheme 'NOPE'; choose one of: {', '.join(SCHEMES)}"
    ]
    assert not (tmp_path / "out").exists()


def test_cli_missing_recipe(tmp_path: Path) -> None:
    proc = run_qserve("quantize", tmp_path / "nope.yaml")
    assert proc.returncode == 1
    assert "does not exist" in proc.stderr


def test_cli_missing_calibration_file(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(VALID.replace("gsm8k/train.jsonl", "nowhere/train.jsonl"))
    proc = run_qserve("quantize", recipe, "--output", tmp_path / "out")
    assert proc.returncode == 1
    assert "calibration data" in proc.stderr and "nowhere/train.jsonl does not exist" in proc.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
