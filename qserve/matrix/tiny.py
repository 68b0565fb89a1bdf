"""Tiny random-initialised models of real architectures, built offline from transformers' own config
classes with a fixed seed, over the embedded SmolLM2 tokenizer.

Every width is a multiple of 256, so every scheme's group (W4A16's 128, MXFP4's 32, NVFP4's 16,
FP8_BLOCK's 128 x 128) divides it. Each config keeps its own defaults for what makes the architecture
itself (embedding tying, norms, QK-norm, soft-capping); two layers, so that an architecture that
alternates sliding-window and full attention has one of each. The sliding window (16 tokens) is
shorter than every matrix prompt plus its answer, so its masking is exercised, not skipped.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qserve.errors import InvalidSpec
from qserve.runtime.capture import library_output

VOCAB = 49152  # the SmolLM2 tokenizer's
SEED = 0
SLIDING_WINDOW = 16
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}
# Mixtures of experts: 4 experts, 2 per token; expert widths of 256 (vLLM-CPU's MoE kernels tile by 32).
MOE: dict[str, Any] = {"num_experts_per_tok": 2}


@dataclass(frozen=True)
class Architecture:
    name: str  # transformers' model_type
    config_class: str  # in transformers
    extra: dict[str, Any] = field(default_factory=dict)  # beyond COMMON
    what: str = ""  # what the architecture adds that quantization must get right
    # Weights' init std. transformers' default (0.02) gives a tiny model next-token distributions
    # close to uniform, where top-1 agreement is a coin toss; 0.25 gives peaked ones. Gemma multiplies
    # embeddings by sqrt(hidden), so a smaller std does the same.
    init: float = 0.25

    @property
    def moe(self) -> bool:
        return any(k in self.extra for k in ("num_experts", "num_local_experts"))


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("llama", "LlamaConfig", {"head_dim": 64}, "the reference (SmolLM2's own)"),
        Architecture("qwen2", "Qwen2Config", {}, "q/k/v biases"),
        Architecture("qwen3", "Qwen3Config", {"head_dim": 64}, "QK-norm"),
        Architecture("mistral", "MistralConfig", {"head_dim": 64, "sliding_window": SLIDING_WINDOW}, "sliding-window attention"),
        Architecture(
            "gemma2",
            "Gemma2Config",
            {"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": SLIDING_WINDOW},
            "RMSNorm as (1 + weight), soft-capped logits, alternating sliding-window layers; vLLM refuses float16",
            init=0.085,
        ),
        Architecture(
            "gemma3_text",
            "Gemma3TextConfig",
            {
                "head_dim": 64,
                "query_pre_attn_scalar": 64,
                "sliding_window": SLIDING_WINDOW,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            "RMSNorm as (1 + weight), QK-norm, sliding-window layers; vLLM refuses float16",
            init=0.085,
        ),
        Architecture("phi3", "Phi3Config", {}, "fused qkv_proj and gate_up_proj"),
        Architecture("olmo2", "Olmo2Config", {}, "norms after attention and MLP (none before), QK-norm"),
        Architecture("granite", "GraniteConfig", {}, "embedding, residual and logit multipliers"),
        Architecture(
            "qwen3_moe",
            "Qwen3MoeConfig",
            {"head_dim": 64, "num_experts": 4, "moe_intermediate_size": 256, **MOE},
            "mixture of experts with a router, QK-norm",
        ),
        Architecture(
            "qwen2_moe",
            "Qwen2MoeConfig",
            {"num_experts": 4, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 512, **MOE},
            "mixture of experts plus a shared expert behind a Linear gate",
        ),
        Architecture("mixtral", "MixtralConfig", {"num_local_experts": 4, **MOE}, "mixture of experts, sliding window unset"),
    )
}


def get_architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise InvalidSpec(f"unknown architecture {name!r}; choose one of: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def config_of(arch: Architecture) -> Any:
    import transformers

    return getattr(transformers, arch.config_class)(**COMMON, **arch.extra, initializer_range=arch.init)


def build(name: str, out: Path, tokenizer_dir: Path, seed: int = SEED) -> Path:
    """Write the tiny model `name` (bfloat16 safetensors, config, the tokenizer) to `out`. The same
    seed gives the same bytes, so a matrix cell can be re-run against the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch = get_architecture(name)
    config = config_of(arch)
    # The tokenizer's special tokens, not the config class's defaults (OLMo 2's eos is outside this vocabulary).
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with library_output(out.parent / f"{out.name}-build.log"):  # transformers' shard-writing progress bar
        model.to(torch.bfloat16).save_pretrained(out)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / file, out / file)
    return out
