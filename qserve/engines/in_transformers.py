"""A checkpoint loaded in transformers with every weight from the files, or an error saying which not.

transformers loads what it can and initialises the rest at random, with a warning in a log nobody
reads. qserve compares vLLM with transformers (parity, the architecture matrix) and evaluates in
transformers where vLLM cannot run a scheme, so a weight left at random init would make it compare
with, or gate, another model. Measured here (transformers 5.17): an MoE checkpoint whose experts
llm-compressor left unquantized (ignored) and saved one by one loads with every expert at random init,
because compressed-tensors' expert converter then looks for packed expert weights only. Those experts
are fused here exactly as transformers fuses an unquantized checkpoint's (stack the experts; gate
before up), and the test holds the two against each other.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from qserve.compat import patched
from qserve.errors import QserveError, innermost_message

# transformers' fused expert parameter -> the per-expert weights it is built from, in order
# (Qwen-MoE style names, Mixtral's w1/w3/w2)
FUSED_EXPERTS: dict[str, tuple[tuple[str, ...], ...]] = {
    "gate_up_proj": (("gate_proj", "w1"), ("up_proj", "w3")),
    "down_proj": (("down_proj", "w2"),),
}
RENAMED = {".block_sparse_moe.": ".mlp."}  # checkpoint name -> module name (transformers' Mixtral renaming)


def load_checked(model_path: Path, dtype: Any, trust_remote_code: bool = False) -> Any:
    """AutoModelForCausalLM on `model_path` in eval mode, every weight from the checkpoint."""
    from transformers import AutoModelForCausalLM

    try:
        with patched("transformers-undecorated"):
            model, info = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True
            )
    except RuntimeError as exc:  # transformers' own report of weights it could not convert
        raise QserveError(f"transformers cannot load {model_path}: {innermost_message(exc)}") from None
    missing = sorted(set(info["missing_keys"]) - _fill_unquantized_experts(model, model_path, info["missing_keys"]))
    if missing:
        raise QserveError(
            f"transformers leaves {len(missing)} weight(s) of {model_path} at random init "
            f"({', '.join(missing[:2])}{', ...' if len(missing) > 2 else ''}); it would not be the checkpoint's model"
        )
    if str(dtype).removeprefix("torch.") == "float32":
        _upcast(model)
    return model.eval()


def _upcast(model: Any) -> None:
    """Every 16-bit floating parameter in float32 (lossless). Measured: transformers 5.17 keeps a
    renamed weight (Mixtral's block_sparse_moe.gate, its router) in the checkpoint's bfloat16 in a model
    loaded in float32, and the forward then fails ("expected m1 and m2 to have the same dtype")."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != torch.float32:
                param.data = param.data.float()


def teacher_forced(
    model_path: Path, sequences: list[tuple[list[int], list[int]]], trust_remote_code: bool = False, dtype: str = "float32"
) -> list[Any]:
    """Per (prompt ids, generated ids): transformers' log-probabilities (the model run in `dtype`, the
    log-softmax in float32) over the vocabulary at each generated position, the generated tokens fed back
    in (teacher forcing)."""
    import torch

    model = load_checked(model_path, getattr(torch, dtype), trust_remote_code)
    out = []
    for prompt, tokens in sequences:
        with torch.no_grad():
            logprobs = model(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
        out.append(logprobs[len(prompt) - 1 : len(prompt) - 1 + len(tokens)])
    del model
    return out


def _fill_unquantized_experts(model: Any, model_path: Path, missing: list[str]) -> set[str]:
    """Fill fused expert parameters that transformers left empty from the checkpoint's per-expert
    16-bit weights; returns the names filled. A quantized expert (packed weights) is never filled."""
    import torch

    tensors = _checkpoint_tensors(model_path)
    filled = set()
    for name in missing:
        prefix, _, fused = name.rpartition(".")
        parts = FUSED_EXPERTS.get(fused)
        if parts is None or not prefix.endswith("experts"):
            continue
        stacked = [_stack_experts(tensors, prefix, choices) for choices in parts]
        if any(s is None for s in stacked):
            continue
        param = model.get_parameter(name)
        value = torch.cat(stacked, dim=1)
        if value.shape != param.shape:
            continue
        with torch.no_grad():
            param.copy_(value.to(param.dtype))
        filled.add(name)
    return filled


def _stack_experts(tensors: dict[str, Any], prefix: str, choices: tuple[str, ...]) -> Any:
    """[experts, out, in] from `prefix.{e}.{proj}.weight` for e = 0, 1, ... (the first name in
    `choices` that the checkpoint has), or None."""
    import torch

    for proj in choices:
        pattern = re.compile(re.escape(prefix) + r"\.(\d+)\." + re.escape(proj) + r"\.weight$")
        found = {int(m.group(1)): key for key in tensors if (m := pattern.match(key))}
        if found and sorted(found) == list(range(len(found))):
            return torch.stack([tensors[found[e]]() for e in range(len(found))])
    return None


def _checkpoint_tensors(model_path: Path) -> dict[str, Any]:
    """Module-side tensor name (RENAMED applied) -> a function reading it (safetensors, lazily)."""
    from safetensors import safe_open

    readers: dict[str, Any] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        handle = safe_open(str(file), "pt")
        for key in handle.keys():
            name = key
            for old, new in RENAMED.items():
                name = name.replace(old, new)
            readers[name] = lambda h=handle, k=key: h.get_tensor(k)
    return readers
