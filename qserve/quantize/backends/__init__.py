"""Quantization backends: each turns (model, recipe, calibration data) into a saved checkpoint.

Which backends exist is schemes/backends.py's registry; this is the interface their modules
implement and the lazy loader (each module imports its library when a recipe runs).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol, cast

from qserve.schemes.backends import get_backend
from qserve.spec.recipe import Recipe


class BackendRunner(Protocol):
    def quantize(
        self, model_path: Path, recipe: Recipe, texts: list[str] | None, out_dir: Path, trust_remote_code: bool = False
    ) -> tuple[str, dict[str, Any] | None]:
        """Quantize and save to out_dir; the scheme written and, for a calibrated mixture of
        experts, the tokens each expert saw (else None)."""
        ...

    def exported_scheme(self, out_dir: Path, recipe: Recipe) -> str:
        """The scheme read back from the export; it must be the one the recipe asked for."""
        ...


def runner(name: str) -> BackendRunner:
    """The module that runs backend `name` (imported now: it pulls in its library)."""
    return cast(BackendRunner, importlib.import_module(get_backend(name).module))
