"""The layout is the architecture: which part may import which, no cycles, serve without the eval stack."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "qserve"
BASE = {"errors", "paths", "progress", "capture", "process", "scratch", "heap", "bytecode", "priority", "__init__"}
TOOLS = {"cli", "compare", "bench_suite", "bench_throughput", "benchmarks_page", "workflow", "reproduce"}
# part -> the parts it may import (lazy imports inside functions count too).
ALLOWED = {
    "base": {"base"},
    "checkpoint": {"base", "checkpoint"},
    "device": {"base", "checkpoint", "device"},
    "evaluate": {"base", "checkpoint", "device", "evaluate"},
    "quantize": {"base", "checkpoint", "device", "evaluate", "quantize"},  # evaluate: the recipe's gate schema
    "serve": {"base", "checkpoint", "device", "serve"},
    "tune": {"base", "checkpoint", "device", "evaluate", "quantize", "tune"},
    "matrix": {"base", "checkpoint", "device", "quantize", "serve", "matrix"},  # no evaluate: it gates nothing
    "tools": {"base", "checkpoint", "device", "evaluate", "quantize", "serve", "tune", "matrix", "tools"},
}


def _module(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    return ".".join(p for p in rel.parts if p != "__init__") if rel.name == "__init__" else ".".join(rel.parts)


def _part(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in BASE:
        return "base"
    return "tools" if parts[1] in TOOLS else parts[1]


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
    assert folders == {"checkpoint", "device", "evaluate", "quantize", "serve", "tune", "matrix", "cli"}
    flat = {p.stem for p in PACKAGE.glob("*.py")}
    assert flat | {"cli"} == BASE | TOOLS


def test_serving_and_inspection_load_no_evaluation_stack() -> None:
    code = (
        "import sys, qserve.serve.server, qserve.serve.plan, qserve.serve.bench, qserve.checkpoint.inspection\n"
        "print(sorted(m for m in sys.modules if m.startswith(('lm_eval', 'qserve.evaluate', 'vllm', 'torch'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"
