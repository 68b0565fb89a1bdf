"""The checkpoint's recipe.yaml as plain YAML.

llm-compressor writes the recipe it ran with PyYAML's Python tags (`!!python/tuple` for SmoothQuant
and AWQ mappings, `!!python/object/apply:...ActivationOrdering [static]` for enums), which
`yaml.safe_load`, and so llm-compressor's own recipe loader, refuse; AWQ's "not provided" sentinel
even records the library's install path. The same content as plain YAML (tuples as lists, enums
as their values, sentinels left out) is what a user re-runs with `oneshot(recipe=...)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

RECIPE_FILE = "recipe.yaml"


class _TaggedLoader(yaml.SafeLoader):
    """Reads those two tags as data, never as code: a tuple as a list, an enum as its value."""


def _tuple(loader: yaml.SafeLoader, node: yaml.Node) -> list[Any]:
    return loader.construct_sequence(node, deep=True)


_OMIT = object()  # llm-compressor's "not provided" sentinel: the key is left out, so the default applies


def _applied(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    """An enum (one argument: its value) or llm-compressor's Sentinel (left out)."""
    args = loader.construct_sequence(node, deep=True) if isinstance(node, yaml.SequenceNode) else []
    if suffix.endswith(".Sentinel"):
        return _OMIT
    if len(args) != 1:
        raise yaml.constructor.ConstructorError(None, None, f"unexpected !!python/object/apply:{suffix}", node.start_mark)
    return args[0]


def _without_omitted(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _without_omitted(v) for k, v in data.items() if v is not _OMIT}
    if isinstance(data, list):
        return [_without_omitted(v) for v in data]
    return data


_TaggedLoader.add_constructor("tag:yaml.org,2002:python/tuple", _tuple)
_TaggedLoader.add_multi_constructor("tag:yaml.org,2002:python/object/apply:", _applied)


def make_plain(directory: Path) -> None:
    """Rewrite `directory`/recipe.yaml, if there is one, as plain YAML with the same content."""
    path = directory / RECIPE_FILE
    if path.is_file():
        data = yaml.load(path.read_text(), Loader=_TaggedLoader)  # noqa: S506  (a SafeLoader: no code runs)
        path.write_text(yaml.safe_dump(_without_omitted(data), sort_keys=False))
