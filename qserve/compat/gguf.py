"""gguf (as transformers uses it to convert a GGUF file): each file parsed once."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock


@contextmanager
def parsed_once() -> Iterator[None]:
    """In the block, gguf's file reader and tensor-name map are built once per argument. transformers
    parses the GGUF four times for one conversion (config, tokenizer twice, weights) and builds the same
    name map once per module; both are pure functions of their arguments, and transformers looks them
    up on `gguf` at each call, so sharing one result is invisible to it."""
    import gguf

    reader = functools.cache(gguf.GGUFReader)
    with mock.patch.object(gguf, "GGUFReader", lambda path, mode="r": reader(str(path), mode)):
        with mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
            yield
