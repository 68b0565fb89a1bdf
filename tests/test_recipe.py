"""Recipe parsing and validation: every user mistake gets a message naming the field and line."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, run_qserve

from qserve.errors import QserveError
from qserve.recipe import load_recipe, parse_recipe

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


def test_valid_recipe() -> None:
    r = parse_recipe(VALID)
    assert (r.scheme, r.group_size, r.calibration.samples) == ("W4A16", 64, 64)


def test_unknown_scheme_lists_choices() -> None:
    with pytest.raises(QserveError) as e:
        parse_recipe(VALID.replace("W4A16", "W3A3"), "r.yaml")
    assert str(e.value).startswith("r.yaml:2: scheme: unknown scheme 'W3A3'; choose one of: FP8_DYNAMIC, W8A8, W4A16")


def test_unknown_nested_field_names_line_and_valid_fields() -> None:
    with pytest.raises(QserveError) as e:
        parse_recipe(VALID + "  sample: 3\n", "r.yaml")
    assert str(e.value).startswith("r.yaml:7: calibration.sample: unknown field; valid fields: source, path, text, samples")


def test_malformed_yaml_names_line() -> None:
    with pytest.raises(QserveError) as e:
        parse_recipe("name: t\nscheme: [W4A16\n", "r.yaml")
    assert str(e.value).startswith("r.yaml:3: malformed YAML")


def test_gptq_without_calibration() -> None:
    with pytest.raises(QserveError, match="needs a calibration section"):
        parse_recipe("name: t\nscheme: W4A16\n")


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
        f"error: {bad}:2: scheme: unknown scheme 'NOPE'; choose one of: FP8_DYNAMIC, W8A8, W4A16"
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
