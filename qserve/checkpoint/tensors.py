"""Reading safetensors checkpoints without loading weights: headers, element counts, bytes."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from qserve.errors import QserveError

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "BOOL": 1,
}


def weight_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def parameter_count(directory: Path) -> int:
    """Elements of all tensors, read from the safetensors headers (no weights loaded)."""
    return sum(numel(info["shape"]) for info in tensor_headers(directory).values())


def safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def tensor_headers(directory: Path) -> dict[str, dict[str, Any]]:
    """Every tensor's header entry (dtype, shape, offsets) across the directory's safetensors files."""
    tensors: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors |= {k: v for k, v in safetensors_header(path).items() if k != "__metadata__"}
    return tensors


def quantized_layer_bytes(ckpt: Path) -> dict[str, float]:
    """Bytes of the quantized Linear layers (weights, scales, zero points) against the same
    layers in bf16, read from the safetensors headers."""
    tensors = tensor_headers(ckpt)
    quantized = {name.rsplit(".", 1)[0] for name in tensors if name.endswith(".weight_scale")}
    if not quantized:
        raise QserveError(f"{ckpt} holds no quantized layer (no *.weight_scale in its safetensors files)")
    stored = bf16 = 0
    for module in quantized:
        parts = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == module}
        stored += sum(numel(v["shape"]) * DTYPE_BYTES[v["dtype"]] for k, v in parts.items() if not k.endswith(".weight_shape"))
        shape = parts.get(f"{module}.weight", {}).get("shape")
        bf16 += 2 * (numel(shape) if shape else _packed_numel(ckpt, f"{module}.weight_shape"))
    return {"layers": len(quantized), "stored_bytes": stored, "bf16_bytes": bf16, "ratio": round(stored / bf16, 4)}


def numel(shape: list[int]) -> int:
    return math.prod(shape)


def _packed_numel(ckpt: Path, name: str) -> int:
    """Packed int4 weights record their original shape in a small tensor."""
    from safetensors import safe_open

    for path in ckpt.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            if name in f.keys():
                return numel([int(x) for x in f.get_tensor(name).tolist()])
    raise QserveError(f"{ckpt}: {name} is missing, so the packed weight's size is unknown")
