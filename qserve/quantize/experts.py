"""Mixture-of-experts calibration: which experts saw how many calibration tokens.

llm-compressor 0.14 turns each fused experts tensor into one Linear per expert
(`linearize_moe`, llmcompressor/modeling/moe/linearize.py) and, with `moe_calibrate_all_experts`
(qserve's `calibration.all_experts`, on by default), runs every expert on every calibration token
while the router still picks which outputs count. Without it an expert only sees the tokens routed
to it, and one that sees none is only a warning in llm-compressor ("Attempted to calibrate a
module ... without statistics", modifiers/quantization/calibration.py): its scales would be
whatever the observer's defaults are, found out at serving time. qserve counts, per expert, the
tokens routed to it and the tokens its layers were calibrated on, records both in the manifest,
and makes an expert calibrated on none an error that names it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qserve.errors import QserveError

# Config keys transformers' MoE models use for the expert count and the experts per token.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")


def moe_summary(model_path: Path, trust_remote_code: bool = False) -> dict[str, Any] | None:
    """The model's experts per MoE layer and experts per token, from its config; None for a dense model."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    config = getattr(config, "text_config", config)
    experts = next((getattr(config, k) for k in _EXPERT_KEYS if getattr(config, k, None)), None)
    if not experts:
        return None
    top_k = next((getattr(config, k) for k in _TOP_K_KEYS if getattr(config, k, None)), None)
    return {"experts_per_layer": experts, "experts_per_token": top_k}


class ExpertTokenCounter:
    """Forward hooks on every linearized experts module of a model, counting per expert the tokens
    the router sent it and the tokens its layers ran on. Registered through llm-compressor's
    HooksMixin so they are silenced with the modifiers' hooks during the sequential pipeline's
    output-propagation pass: each calibration token is counted once per layer."""

    def __init__(self, model: Any) -> None:
        from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
        from llmcompressor.modeling.moe.linearize import get_non_linearized_moes, linearize_moe
        from llmcompressor.modifiers.utils.hooks import HooksMixin

        if get_non_linearized_moes(model):
            linearize_moe(model)  # what oneshot would do itself; done first so the hooks land on the result
        self.layers = {n: m for n, m in model.named_modules() if isinstance(m, LinearExperts2D)}
        self.routed = {n: [0] * m.num_experts for n, m in self.layers.items()}
        self.calibrated = {n: [0] * m.num_experts for n, m in self.layers.items()}
        self._mixin = HooksMixin()  # a pydantic model: its handle set is its own
        for name, layer in self.layers.items():
            self._mixin.register_hook(layer, self._router_hook(name), "forward_pre", with_kwargs=True)
            for i in range(layer.num_experts):
                self._mixin.register_hook(layer[i], self._expert_hook(name, i), "forward_pre")

    def _router_hook(self, name: str):
        def count(module: Any, args: tuple, kwargs: dict) -> None:
            import torch

            top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            per_expert = torch.bincount(top_k_index.flatten(), minlength=module.num_experts).tolist()
            self.routed[name] = [a + b for a, b in zip(self.routed[name], per_expert, strict=True)]

        return count

    def _expert_hook(self, name: str, index: int):
        def count(module: Any, args: tuple) -> None:
            self.calibrated[name][index] += args[0].shape[:-1].numel()

        return count

    def remove(self) -> None:
        self._mixin.remove_hooks()

    def record(self, all_experts: bool) -> dict[str, Any]:
        """The manifest's per-layer counts: lists indexed by expert number."""
        return {
            "all_experts_calibrated": all_experts,
            "layers": {n: {"routed_tokens": self.routed[n], "calibration_tokens": self.calibrated[n]} for n in self.layers},
        }


def uncalibrated_experts(record: dict[str, Any]) -> list[str]:
    """Module names of the experts whose layers ran on no calibration token."""
    return [
        f"{layer}.{i}" for layer, counts in record["layers"].items() for i, n in enumerate(counts["calibration_tokens"]) if n == 0
    ]


def check_every_expert_calibrated(record: dict[str, Any]) -> None:
    """Raise naming the experts no calibration token reached (their scales would be meaningless)."""
    missing = uncalibrated_experts(record)
    if not missing:
        return
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    raise QserveError(
        f"{len(missing)} expert(s) saw no calibration token, so their quantization scales would be meaningless: {shown}; "
        "set `calibration: {all_experts: true}` (the default: every expert calibrates on every token) or calibrate on more samples"
    )


def sum_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts of several data-parallel ranks, each over its own share of the samples, added up."""
    total = records[0]
    for other in records[1:]:
        for layer, counts in other["layers"].items():
            for key, values in counts.items():
                total["layers"][layer][key] = [a + b for a, b in zip(total["layers"][layer][key], values, strict=True)]
    return total


# A router (or a shared-expert gate) decides which experts run; quantizing it changes routing, which no
# expert's calibration can repair. transformers 5 makes most routers a *Router module of their own (not
# a Linear, so "Linear" targets miss them); some models still use a Linear named like these.
ROUTER_NAME_ENDS = (".gate", ".router", ".shared_expert_gate")
QUANTIZATION_PARAMS = ("weight_scale", "weight_packed", "weight_zero_point", "weight_global_scale")


def quantized_routers(ckpt: Path) -> list[str]:
    """Routers the written checkpoint stores quantized (read from the safetensors headers)."""
    from qserve.checkpoint.tensors import tensor_headers

    modules = {name.rsplit(".", 1)[0] for name in tensor_headers(ckpt) if name.rsplit(".", 1)[-1] in QUANTIZATION_PARAMS}
    return sorted(m for m in modules if m.endswith(ROUTER_NAME_ENDS))


def experts_quantized(ckpt: Path) -> bool:
    """Whether the written checkpoint stores any expert quantized (a recipe may keep every expert in
    16 bits, for a vLLM without a quantized MoE kernel for the device)."""
    from qserve.checkpoint.tensors import tensor_headers

    return any(".experts." in name and name.rsplit(".", 1)[-1] in QUANTIZATION_PARAMS for name in tensor_headers(ckpt))


# Experts a recipe kept in 16 bits, as the checkpoint's quantization config names them for vLLM.
# compressed-tensors writes each ignored module's own name (experts.0.gate_proj, ...); vLLM 0.32 loads
# Mixtral's experts under its names (experts.0.w1, ...) and checks the ignore list against those, so it
# took ignored experts for INT8 and refused them ("No Int8 MoE backend supports the deployment
# configuration", measured by `qserve matrix`). A regex over the experts matches either naming
# (compressed-tensors and vLLM both read `re:` entries); it cannot match a shared expert (`shared_experts.`).
EXPERTS_IGNORED = r"re:.*\.experts\..*"


def name_unquantized_experts(ckpt: Path) -> None:
    """Add EXPERTS_IGNORED to the checkpoint's quantization-config ignore list (experts all 16-bit)."""
    from qserve.paths import write_text

    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    if "quantization_config" not in config:
        return
    ignore = config["quantization_config"].setdefault("ignore", [])
    if EXPERTS_IGNORED not in ignore:
        ignore.append(EXPERTS_IGNORED)
        write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def check_routers_unquantized(ckpt: Path) -> None:
    routers = quantized_routers(ckpt)
    if routers:
        shown = ", ".join(routers[:4]) + (f" and {len(routers) - 4} more" if len(routers) > 4 else "")
        raise QserveError(
            f"the recipe quantized {len(routers)} MoE router(s) ({shown}), which would change which experts each token "
            "goes to; add them to the recipe's ignore (e.g. 're:.*mlp.gate$')"
        )
