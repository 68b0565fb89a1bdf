"""2:4 sparsity (SparseGPT, then INT8 W8A8): the pattern is really in the exported weights, and
what vLLM 0.32 does with it, seen in runs (parity: test_support.py, as a runnable W8A8 entry)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qserve.checkpoint.manifest import read_manifest
from qserve.errors import QserveError
from qserve.spec.recipe import parse_recipe

SPARSE = "name: s\nscheme: W8A8\nsparsity: '2:4'\ncalibration: {path: gsm8k/train.jsonl}\n"


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (
            ("scheme: W8A8\n", "scheme: W8A8\nalgorithm: gptq\n"),
            "sparsity 2:4 is quantized with rtn, which keeps the pruned zeros; drop algorithm gptq",
        ),
        (("scheme: W8A8", "scheme: W4A16"), "sparsity 2:4 is offered with 8-bit weights (FP8 or INT8 schemes), not W4A16"),
        (
            ("scheme: W8A8", "scheme: FP8\nbackend: quark"),
            "sparsity 2:4 is llm-compressor's SparseGPT; it needs backend: llmcompressor",
        ),
        (("calibration: {path: gsm8k/train.jsonl}\n", ""), "sparsity 2:4 (SparseGPT) need a calibration section"),
        (("'2:4'", "'1:4'"), "Input should be '2:4'"),
    ],
)
def test_sparsity_mistakes_are_one_line(change: tuple[str, str], error: str) -> None:
    with pytest.raises(QserveError) as e:
        parse_recipe(SPARSE.replace(*change), "r.yaml")
    assert error in str(e.value) and "\n" not in str(e.value)


@pytest.mark.matrix  # make test-matrix (CI runs it after make test): keeps make test within 30 minutes
@pytest.mark.slow
def test_every_quantized_layer_is_two_of_four_and_nothing_else_is_pruned(checkpoints, embedded_model_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file

    ckpt = checkpoints["w8a8-int8-2of4"]
    tensors = load_file(ckpt / "model.safetensors")
    layers = [n.removesuffix(".weight_scale") for n in tensors if n.endswith(".weight_scale")]
    assert len(layers) == 30 * 7  # q, k, v, o, gate, up, down in each of 30 blocks
    zeros = 0
    for layer in layers:
        codes = tensors[layer + ".weight"]
        assert codes.dtype == torch.int8
        runs = (codes.reshape(codes.shape[0], -1, 4) != 0).sum(dim=-1)  # runs of 4 along the input dim
        assert int(runs.max()) <= 2, layer
        zeros += int((codes == 0).sum())
    total = sum(tensors[layer + ".weight"].numel() for layer in layers)
    assert read_manifest(ckpt).sparsity == {
        "structure": "2:4",
        "algorithm": "sparsegpt",
        "layers": 210,
        "zero_fraction": round(zeros / total, 4),
    }
    assert zeros / total >= 0.5
    # The embeddings (and the lm_head tied to them) are left dense, as the source.
    source = load_file(embedded_model_dir / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(tensors["model.embed_tokens.weight"].float(), source.float())
    # Saved dense, with no sparsity_config, so that vLLM 0.32 loads it at all (next test).
    assert not json.loads((ckpt / "config.json").read_text())["quantization_config"].get("sparsity_config")


@pytest.mark.matrix  # make test-matrix (CI runs it after make test): keeps make test within 30 minutes
@pytest.mark.slow
def test_vllm_refuses_a_sparsity_config(checkpoints, tmp_path: Path) -> None:
    """What vLLM does with the 2:4 metadata older compressed-tensors wrote: it refuses the checkpoint."""
    from qserve.device import detect
    from qserve.engines import vllm as engine

    ckpt = shutil.copytree(checkpoints["w8a8-int8-2of4"], tmp_path / "with-sparsity-config")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["sparsity_config"] = {
        "format": "sparse-24-bitmask",
        "sparsity_structure": "2:4",
        "global_sparsity": 0.5,
        "targets": ["Linear"],
        "ignore": ["lm_head"],
    }
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(DeprecationWarning) as e:
        with engine.open_engine(ckpt, read_manifest(ckpt).vllm_args, detect.detect_device(), ckpt.name):
            pass
    assert str(e.value) == (
        "Sparsity support has been removed from compressed-tensors. Please use a model without sparsity configuration."
    )
