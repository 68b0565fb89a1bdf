"""Layer groups a mix assigns schemes to: the attention and the MLP projections of each decoder block.

vLLM fuses q/k/v (and gate/up) into one layer whose shards must share a scheme, so a group never
splits a block's attention or MLP; targets are compressed-tensors `re:` regexes, which vLLM
resolves the same way (a name match beats the `Linear` class target).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

BLOCK = re.compile(r"^(?P<prefix>.*\.layers)\.(?P<block>\d+)\.(?P<kind>[A-Za-z_]+)\.(?P<leaf>[A-Za-z_0-9]+)$")


@dataclass(frozen=True)
class LayerGroup:
    block: int
    kind: str  # "self_attn" or "mlp" (the model's own submodule name)
    modules: tuple[str, ...]  # full Linear names
    params: int

    @property
    def name(self) -> str:
        return f"{self.block}.{self.kind}"


def layer_groups(model: Any, ignore: list[str]) -> list[LayerGroup]:
    """The model's decoder-block Linear layers grouped by (block, submodule), in model order."""
    import torch

    from qserve.quantize.pipeline import is_ignored

    found: dict[tuple[int, str], list[tuple[str, int]]] = {}
    for name, module in model.named_modules():
        m = BLOCK.match(name)
        if isinstance(module, torch.nn.Linear) and m and not is_ignored(name, ignore):
            found.setdefault((int(m["block"]), m["kind"]), []).append((name, module.weight.numel()))
    return [
        LayerGroup(block, kind, tuple(n for n, _ in members), sum(p for _, p in members))
        for (block, kind), members in sorted(found.items())
    ]


def targets(groups: list[LayerGroup]) -> list[str]:
    """compressed-tensors targets naming exactly these groups' layers: one regex per submodule kind."""
    out = []
    for kind in sorted({g.kind for g in groups}):
        chosen = [g for g in groups if g.kind == kind]
        blocks = "|".join(str(g.block) for g in sorted(chosen, key=lambda g: g.block))
        leaves = "|".join(sorted({m.rsplit(".", 1)[1] for g in chosen for m in g.modules}))
        out.append(rf"re:.*layers\.({blocks})\.{re.escape(kind)}\.({leaves})$")
    return out
