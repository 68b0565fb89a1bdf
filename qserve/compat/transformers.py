"""transformers after vLLM ran in the same process: its model classes as transformers ships them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def undecorated_models() -> Iterator[None]:
    """transformers builds its own models in the block as if vLLM had not run in this process.

    vLLM runs architectures it has no implementation of through its Transformers backend, which
    decorates transformers' model class in place, for the rest of the process, for its compiler;
    building that class again then needs a vLLM config ("AssertionError: Current vLLM config is not
    set"). Each modeling module with a decorated class is dropped from sys.modules (with the names its
    package cached), so that transformers imports it afresh, undecorated."""
    if "vllm.compilation.decorators" in sys.modules:
        _forget_decorated_modules()
    yield


def _forget_decorated_modules() -> None:
    import inspect

    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or ".modeling_" not in name:
            continue
        classes = [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == name]
        if not any(TorchCompileWithNoGuardsWrapper in c.__bases__ for c in classes):
            continue
        del sys.modules[name]
        holders = [sys.modules.get(name.rpartition(".")[0]), sys.modules.get("transformers")]
        for holder in [h for h in holders if h is not None]:
            for c in classes:
                vars(holder).pop(c.__name__, None)
