"""N:M sparsity: the exported weights must really hold it before the checkpoint is published."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qserve.errors import QserveError


def n_of_m(structure: str) -> tuple[int, int]:
    """ "2:4" -> (2, 4): at most N nonzero weights in each run of M."""
    n, m = structure.split(":")
    return int(n), int(m)


def check_structured_sparsity(ckpt: Path, structure: str) -> dict[str, Any]:
    """The manifest's `sparsity`, read back from the safetensors: every quantized layer must have at
    most N nonzero weights in each run of M along its input dim; an error names the layers that do not.

    Checked rather than trusted: llm-compressor 0.14 saves the pruned weights dense (compressed-tensors
    0.19 dropped sparse compression), so nothing else would notice a layer that lost its mask.
    """
    n, m = n_of_m(structure)
    layers, zeros, total, broken = 0, 0, 0, []
    for name, weight in _quantized_weights(ckpt):
        values = weight.float()
        nonzeros = (values.reshape(-1, m) != 0).sum(dim=1)
        layers, zeros, total = layers + 1, zeros + int((values == 0).sum()), total + values.numel()
        if int(nonzeros.max()) > n:
            broken.append(name)
    if broken or not layers:
        what = ", ".join(broken[:4]) + " ..." * (len(broken) > 4) if broken else "no quantized layer found"
        raise QserveError(f"the checkpoint is not {structure}-sparse after SparseGPT: {what}")
    return {"structure": structure, "algorithm": "sparsegpt", "layers": layers, "zero_fraction": round(zeros / total, 4)}


def _quantized_weights(ckpt: Path) -> Iterator[tuple[str, Any]]:
    """(layer name, weight) for each weight stored beside a quantization scale."""
    from safetensors import safe_open

    for path in sorted(ckpt.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            names = set(f.keys())
            for name in sorted(n for n in names if n.endswith(".weight") and n + "_scale" in names):
                yield name.removesuffix(".weight"), f.get_tensor(name)
