"""Try checkpoints on this device's vLLM, for `qserve doctor --probe`: does it load and answer?

Runs in a child process (`python -m qserve.support.probe CKPT...`): a scheme without a kernel can crash
or hang vLLM, and the parent must survive that with a verdict. One JSON line per checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from qserve.device import detect
from qserve.errors import QserveError
from qserve.runtime.process import ProcessGroup

PROMPT = "The capital of France is"
TIMEOUT = 600.0


def probe(checkpoints: list[Path], timeout: float = TIMEOUT) -> list[dict[str, Any]]:
    """Load each checkpoint in vLLM with its recorded arguments (one child process group for all).

    A signal to qserve stops the probe's whole process group within the grace period (qserve.runtime.process).
    """
    cmd = [sys.executable, "-m", "qserve.support.probe", *map(str, checkpoints)]
    env = os.environ | {"VLLM_LOGGING_STREAM": "ext://sys.stderr"}  # stdout carries only the verdicts
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        group = ProcessGroup(cmd, env=env, stdout=out, stderr=err)
        try:
            code = group.wait(timeout)
        finally:
            group.close()
        if code is None:
            raise QserveError(
                f"the vLLM probe did not finish within {timeout:.0f}s (a scheme may hang the engine); probe one checkpoint at a time"
            )
        out.seek(0), err.seek(0)
        results = [json.loads(line) for line in out.read().splitlines() if line.startswith("{")]
        if len(results) != len(checkpoints):
            tail = err.read().strip().splitlines()[-1:] or ["no output"]
            raise QserveError(f"the vLLM probe crashed (exit {code}): {tail[0]}")
    return results


# vLLM-CPU's INT8 layers multiply through oneDNN with a bfloat16 output: one bfloat16 step is the error
# a correct kernel may show. Without VNNI the product is wrong, not refused (support.CPU_NEEDS_VNNI).
INT8_TOLERANCE = 2**-7
INT8_WRONG = "vLLM-CPU's INT8 GEMM is wrong here"


def int8_gemm_misses() -> float:
    """The fraction of a full-range int8 product's entries (64 x 576 x 576, seeded) that vLLM-CPU's INT8
    GEMM misses by more than one bfloat16 step, against the exact product."""
    import torch
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(-128, 128, (576, 576), dtype=torch.int8, generator=gen)
    x = torch.randint(-128, 128, (64, 576), dtype=torch.int8, generator=gen)
    # Kept alive in variables: oneDNN's handler holds a pointer to the weight scale without owning it.
    weight_scale, x_scale = torch.ones(576, 1), torch.ones(64, 1)
    handler = ops.create_onednn_scaled_mm(weight.t(), weight_scale, torch.bfloat16, True, False, 32)
    out = torch.empty(64, 576, dtype=torch.bfloat16)
    ops.onednn_scaled_mm(handler, x, out, x_scale, None, None, None)
    exact = x.double() @ weight.double().t()
    return float(((out.double() - exact).abs() > exact.abs() * INT8_TOLERANCE).double().mean())


def _check_int8(scheme: str) -> dict[str, Any]:
    """An INT8 scheme answers even where its GEMM is wrong: the probe checks the kernel itself."""
    from qserve.schemes.catalog import parts_of

    if "W8A8" not in parts_of(scheme):
        return {}
    misses = int8_gemm_misses()
    if not misses:
        return {}
    return {"runs": False, "error": f"{INT8_WRONG}: {misses:.0%} of a full-range int8 product off by more than one bfloat16 step"}


def _probe_one(ckpt: Path) -> dict[str, Any]:
    from qserve.checkpoint.manifest import read_manifest
    from qserve.engines import vllm as engine

    manifest = read_manifest(ckpt)
    args = manifest.vllm_args
    result: dict[str, Any] = {"checkpoint": str(ckpt), "scheme": manifest.scheme, "vllm_args": args.model_dump()}
    try:
        with engine.open_engine(ckpt, args, detect.detect_device(), f"probe of {ckpt.name}") as lm:
            result |= {"runs": True, "text": engine.greedy_generate(lm, [PROMPT], 8)[0]}
            result |= _check_int8(manifest.scheme)
    except Exception as exc:  # whatever vLLM raises is the finding
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        result |= {"runs": False, "error": f"{type(exc).__name__}: {' '.join(lines[:2])}"}
    return result


def main() -> None:
    for arg in sys.argv[1:]:
        print(json.dumps(_probe_one(Path(arg))), flush=True)


if __name__ == "__main__":
    main()
