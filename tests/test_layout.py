"""The layout is the architecture: which part may import which, no cycles, serve without the eval stack."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "qserve"
BASE = {"errors", "paths", "progress", "runtime", "__init__"}
# part -> the parts it may import (lazy imports inside functions count too), from the bottom up.
ALLOWED = {
    "base": {"base"},
    "schemes": {"base"},
    "device": {"base"},
    "spec": {"base", "schemes"},  # what a user asks for: below checkpoint/, whose manifest holds the recipe typed
    "checkpoint": {"base", "schemes", "spec"},
    "compat": {"base", "device"},
    "models": {"base", "checkpoint"},
    "gate": {"base", "schemes", "checkpoint", "device"},  # schemes: the model card names the backend
    "engines": {"base", "checkpoint", "compat", "device"},
    "support": {"base", "schemes", "checkpoint", "device", "engines"},
    "evaluate": {"base", "schemes", "checkpoint", "device", "models", "gate", "engines", "support"},
    "serve": {"base", "checkpoint", "device", "gate", "engines", "support"},  # never the eval stack
    "quantize": {"base", "schemes", "checkpoint", "device", "models", "gate", "engines", "support"},
    "matrix": {"base", "schemes", "checkpoint", "device", "models", "engines", "support", "quantize", "serve"},  # gates nothing
    "workflows": {"base", "schemes", "checkpoint", "device", "models", "gate", "engines", "support", "evaluate", "quantize"},
    "tune": {"base", "schemes", "checkpoint", "device", "models", "gate", "support", "evaluate", "quantize", "workflows"},
    "bench": {"base", "checkpoint", "compat", "device", "models", "engines", "evaluate", "quantize", "serve"},
}
ALLOWED["cli"] = set(ALLOWED) | {"cli"}
for _part_name, _deps in ALLOWED.items():
    _deps.add(_part_name)
    if "checkpoint" in _deps:  # every part that reads a manifest reads its recipe
        _deps.add("spec")
    if "engines" in _deps or _part_name == "models":  # the patches, for every part that runs a library
        _deps.add("compat")


def _module(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    return ".".join(p for p in rel.parts if p != "__init__") if rel.name == "__init__" else ".".join(rel.parts)


def _part(module: str) -> str:
    parts = module.split(".")
    return "base" if len(parts) == 1 or parts[1] in BASE else parts[1]


def _imports(path: Path) -> set[str]:
    """qserve modules this file imports, anywhere in it (a `from pkg import mod` names the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qserve"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if (PACKAGE / Path(*sub.split(".")[1:])).with_suffix(".py").exists() else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("qserve")}
    return found


def _graph() -> dict[str, set[str]]:
    return {_module(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def test_no_part_imports_a_higher_or_sibling_part() -> None:
    wrong = [
        f"{mod} ({_part(mod)}) imports {dep} ({_part(dep)})"
        for mod, deps in _graph().items()
        for dep in deps
        if _part(dep) not in ALLOWED[_part(mod)]
    ]
    assert wrong == []


def test_no_import_cycles() -> None:
    graph = _graph()
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for dep in graph.get(node, ()):
            if dep in path:
                cycles.append(path[path.index(dep) :] + [dep])
            elif dep in graph and dep not in done:
                visit(dep, path + [dep])
        done.add(node)

    done: set[str] = set()
    for mod in sorted(graph):
        visit(mod, [mod])
    assert cycles == []


def test_the_folders_name_the_parts() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(ALLOWED) - {"base"} | {"runtime"}
    flat = {p.stem for p in PACKAGE.glob("*.py")}
    assert flat == BASE - {"runtime"}


def test_serving_and_inspection_load_no_evaluation_stack() -> None:
    code = (
        "import sys, qserve.serve.server, qserve.serve.plan, qserve.bench.load, qserve.workflows.inspection\n"
        "print(sorted(m for m in sys.modules if m.startswith(('lm_eval', 'qserve.evaluate', 'vllm', 'torch'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"
