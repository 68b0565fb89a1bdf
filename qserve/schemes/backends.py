"""The quantization backends qserve drives, one entry each (in the manner of lm-eval's model registry).

An entry is data: the recipe's `backend:` value, the library, vLLM's `quantization` value for the
checkpoints it writes, the recipe algorithms it runs, and the module that runs it (imported only
when a recipe runs, since it pulls in its library). The module implements
`qserve.quantize.backends.BackendRunner`. Adding a backend is one `register_backend` call here plus
its module; recipes, `qserve doctor`, the manifest's vLLM arguments and the model card read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from qserve.errors import InvalidSpec


@dataclass(frozen=True)
class Backend:
    name: str  # the recipe's `backend:` value
    label: str  # the library as its authors spell it (model card, messages)
    distribution: str  # the package whose version the manifest records
    vllm_quantization: str  # vLLM's `quantization` value for the checkpoints it writes
    algorithms: tuple[str, ...]  # the recipe's `algorithm:` values it runs
    module: str  # implements quantize.backends.BackendRunner


BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    """Add a backend to the registry; a name registered twice is a programming error."""
    if backend.name in BACKENDS:
        raise ValueError(f"backend {backend.name!r} is registered twice")
    BACKENDS[backend.name] = backend
    return backend


register_backend(
    Backend(
        name="llmcompressor",
        label="llm-compressor",
        distribution="llmcompressor",
        vllm_quantization="compressed-tensors",
        # autoround: Intel AutoRound through llm-compressor's AutoRoundModifier
        algorithms=("rtn", "gptq", "awq", "autoround"),
        module="qserve.quantize.backends.llmcompressor",
    )
)
register_backend(
    Backend(
        name="quark",
        label="Quark",
        distribution="amd-quark",
        vllm_quantization="quark",
        algorithms=("rtn",),  # qserve runs Quark's plain quantization
        module="qserve.quantize.backends.quark",
    )
)

# Every algorithm some backend runs, in registry order (the recipe's `algorithm:` choices).
ALGORITHMS: tuple[str, ...] = tuple(dict.fromkeys(a for b in BACKENDS.values() for a in b.algorithms))


def get_backend(name: str) -> Backend:
    """The backend registered as `name`."""
    backend = BACKENDS.get(name)
    if backend is None:
        raise InvalidSpec(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    return backend


def backend_writing(quantization: str | None) -> Backend | None:
    """The backend whose checkpoints vLLM loads with `quantization` (None: no backend of qserve's)."""
    return next((b for b in BACKENDS.values() if b.vllm_quantization == quantization), None)
