"""The transformers fallback: lm-eval through Hugging Face transformers when vLLM cannot run a scheme here.

Scores from it are emulated (quantize-dequantize in PyTorch, not the serving kernels), so every
report labels them; the baseline is evaluated the same way so the comparison stays like for like.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qserve.device.detect import cpu_compute_dtype
from qserve.progress import step

# compressed-tensors decompresses into bfloat16 weights (float32 activations then fail to multiply,
# unless every weight is upcast: in_transformers.load_checked does, for float32); Quark's MXFP4 emulation
# on CPU has no half-precision path; the baseline stays float32.
DTYPES = {"compressed-tensors": "bfloat16", "quark": "float32", None: "float32"}
# On a CPU without a bfloat16 kernel everything runs in float32 (detect.cpu_compute_dtype), but for the
# schemes transformers can only run in bfloat16 (catalog.transformers_dtype).
BATCH_SIZE = 8


def lm_kwargs(model_path: Path, quantization: str | None, trust_remote_code: bool = False) -> dict[str, Any]:
    """Keyword arguments for lm-eval's HFLM (plus a backend marker for the baseline cache key)."""
    return {
        "backend_kind": "transformers",
        "pretrained": str(model_path),
        "dtype": emulation_dtype(model_path, quantization),
        "device": "cpu",
        "batch_size": BATCH_SIZE,
        "trust_remote_code": trust_remote_code,
    }


def emulation_dtype(model_path: Path, quantization: str | None) -> str:
    """The dtype transformers emulates the checkpoint (or the baseline, `quantization` None) in."""
    from qserve.checkpoint.manifest import read_manifest
    from qserve.schemes.catalog import transformers_dtype

    if quantization is not None and transformers_dtype(read_manifest(model_path).scheme, quantization) == "bfloat16":
        return "bfloat16"
    return cpu_compute_dtype(DTYPES.get(quantization, "float32"))


@contextmanager
def open_transformers(model_path: Path, quantization: str | None, label: str, trust_remote_code: bool = False) -> Iterator[Any]:
    """lm-eval's HFLM on the checkpoint (transformers dequantizes or emulates the scheme)."""
    import torch
    from lm_eval.models.huggingface import HFLM

    from qserve.engines.in_transformers import load_checked

    kwargs = lm_kwargs(model_path, quantization, trust_remote_code)
    kwargs.pop("backend_kind")
    with step(f"loading {label} in transformers ({kwargs['dtype']}; emulated: vLLM cannot run the checkpoint here)"):
        # loaded by qserve so that a weight transformers would leave at random init is an error
        model = load_checked(model_path, getattr(torch, kwargs["dtype"]), trust_remote_code)
        lm = HFLM(**{**kwargs, "pretrained": model, "tokenizer": str(model_path)})
    yield lm
