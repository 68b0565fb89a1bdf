"""Checkpoints in the real vLLM (CPU) against transformers on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_qserve

from qserve import engine
from qserve.manifest import read_manifest

PROMPTS = [
    "The capital of France is",
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
    "def fibonacci(n):",
]
MAX_TOKENS = 24


NEAR_TIE_NATS = 0.5  # float16 (vLLM) vs float32 (transformers) rounding flips only near-ties


def transformers_shortfalls(ckpt: Path, prompts: list[str], completions: list[list[int]]) -> list[list[float]]:
    """Teacher-force vLLM's greedy tokens through transformers on the same checkpoint.

    For each generated token: how far (in nats) its log-probability under transformers falls
    short of transformers' own best token at that position. 0 means both engines agree.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    out = []
    for prompt, generated in zip(prompts, completions):
        prompt_ids = tok(prompt).input_ids
        ids = torch.tensor([prompt_ids + generated])
        with torch.no_grad():
            logprobs = model(ids).logits[0].log_softmax(-1)
        positions = range(len(prompt_ids) - 1, len(prompt_ids) - 1 + len(generated))
        out.append([float(logprobs[p].max() - logprobs[p, t]) for p, t in zip(positions, generated)])
    return out


@pytest.mark.slow
def test_w4a16_in_vllm_matches_transformers(checkpoints) -> None:
    ckpt = checkpoints["w4a16-gptq"]
    manifest = read_manifest(ckpt)
    device = engine.detect_device()
    engine.check_supported(manifest, device)
    with engine.open_engine(ckpt, manifest.vllm_args, device, "w4a16") as lm:
        assert lm.model.llm_engine.model_config.quantization == "compressed-tensors"
        assert str(lm.model.llm_engine.model_config.dtype) == "torch.float16"
        completions = engine.greedy_completions(lm, PROMPTS, MAX_TOKENS)
    assert all(text.strip() for text, _ in completions)
    shortfalls = transformers_shortfalls(ckpt, PROMPTS, [ids for _, ids in completions])
    for (text, _), gaps in zip(completions, shortfalls):
        # Every token vLLM chose is transformers' choice too, or within a rounding-sized tie of it.
        assert max(gaps) < NEAR_TIE_NATS, (text, gaps)
        assert sum(g == 0 for g in gaps) >= 0.8 * len(gaps), (text, gaps)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp8", "w8a8-int8"])
def test_activation_quantized_checkpoints_run_in_vllm(checkpoints, name: str) -> None:
    # transformers does not emulate FP8/INT8 activation quantization, so token-for-token
    # parity is not expected here; the answer to a fact prompt must still be right.
    ckpt = checkpoints[name]
    manifest = read_manifest(ckpt)
    with engine.open_engine(ckpt, manifest.vllm_args, engine.detect_device(), name) as lm:
        assert str(lm.model.llm_engine.model_config.dtype) == f"torch.{manifest.vllm_args.dtype}"
        text = engine.greedy_generate(lm, [PROMPTS[0]], 8)[0]
    assert "Paris" in text, text


@pytest.fixture(scope="session")
def w4a16_float32(tmp_path_factory) -> Path:
    """A real W4A16 checkpoint recorded with dtype float32, which vLLM's int4 kernels cannot run."""
    root = tmp_path_factory.mktemp("f32")
    recipe = root / "w4a16-f32.yaml"
    recipe.write_text("name: w4a16-f32\nscheme: W4A16\nalgorithm: rtn\ngroup_size: 64\ndtype: float32\n")
    proc = run_qserve("quantize", recipe, "--output", root / "ckpt")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root / "ckpt"


@pytest.mark.slow
@pytest.mark.parametrize("command", ["eval", "serve"])
def test_unrunnable_combination_refused_before_engine(w4a16_float32: Path, command: str) -> None:
    proc = run_qserve(command, w4a16_float32, "--skip-gate" if command == "serve" else "--limit=1", timeout=120)
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: W4A16 with dtype float32 cannot run on this machine (vLLM CPU build)")
    assert "cpu_gemm_wna16" in line and "set `dtype: float16`" in line
    assert "starting vLLM" not in proc.stderr
