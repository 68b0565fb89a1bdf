"""Norms that scale by (1 + weight), and the smoothing that must not be folded into them.

SmoothQuant and AWQ move a per-channel scale s from a layer's input into the layer that produces it:
the balance layers' weights are multiplied by s and the smooth layer's weight divided by it. That
keeps the model's function only if the smooth layer's output is proportional to its weight. Gemma's
RMSNorm outputs x_norm * (1 + weight), so dividing its weight gives (1 + w/s), not (1 + w)/s, and the
model changes (llm-compressor issue 2365; llm-compressor 0.14 still divides the weight). Which norms
do this is read from the model itself, by running each norm class once with a zero weight, not from
a list of architecture names.
"""

from __future__ import annotations

import re
from typing import Any


def offset_norms(model: Any) -> dict[str, str]:
    """Module name -> class name of every module whose output is not zero with its weight (and bias)
    zeroed: a norm that scales by (1 + weight). Works on a meta-device skeleton too."""
    import torch

    behaves: dict[type, bool] = {}
    found = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.ndim != 1 or isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        if type(module) not in behaves:
            behaves[type(module)] = _scales_by_one_plus_weight(module)
        if behaves[type(module)]:
            found[name] = type(module).__name__
    return found


def _scales_by_one_plus_weight(module: Any) -> bool:
    import copy

    import torch

    probe = copy.deepcopy(module).to_empty(device="cpu")
    with torch.no_grad():
        for param in probe.parameters():
            param.zero_()
        try:
            out = probe(torch.randn(3, probe.weight.numel()))
        except Exception:  # not a module that maps hidden states to hidden states
            return False
    return isinstance(out, torch.Tensor) and bool(out.abs().max() > 0)


def matches(pattern: str, name: str) -> bool:
    """llm-compressor's mapping target syntax: "re:<regex>" (matched from the start) or a module name."""
    return bool(re.match(pattern[3:], name)) if pattern.startswith("re:") else name == pattern or name.endswith("." + pattern)


def without_offset_smoothing(mappings: list[Any], model: Any, attribute: str = "smooth_layer") -> tuple[list[Any], list[str]]:
    """The mappings whose smooth layer is no offset norm, and the smooth-layer patterns dropped."""
    norms = offset_norms(model)
    kept, dropped = [], []
    for mapping in mappings:
        pattern = getattr(mapping, attribute)
        if any(matches(pattern, name) for name in norms):
            dropped.append(pattern)
        else:
            kept.append(mapping)
    return kept, dropped
