"""Per-group sensitivity: how much quantizing one layer group alone moves the model's predictions.

Measured in transformers on held-out calibration text (drawn like the recipe's calibration, never
the same texts): KL divergence of the next-token distribution from the unquantized model's, and the
token perplexity change. The weights are fake-quantized with compressed-tensors' own quantizer
(round-to-nearest with min-max scales), one group at a time: the ranking, not GPTQ's final error,
is what the search needs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from qserve import paths
from qserve.errors import QserveError
from qserve.progress import count, step
from qserve.spec.recipe import Recipe
from qserve.tune.groups import LayerGroup, layer_groups

HELD_OUT_SEQUENCES = 2  # sequences of the recipe's seq_len: ~500 tokens, a few seconds a pass for 135M on 2 cores
HELD_OUT_SEED_OFFSET = 1000  # a draw of its own, so the texts differ from the calibration draw
NEEDS_CALIBRATION = "qserve tune needs a recipe with a calibration section: held-out text from it measures sensitivity"


def held_out_texts(recipe: Recipe, data_dir: Path | None, model_path: Path, calibration: list[str]) -> list[str]:
    """Texts from the recipe's calibration source(s), drawn with another seed, minus the calibration texts."""
    from qserve.quantize.calibration import load_texts

    spec = recipe.calibration
    if spec is None:
        raise QserveError(NEEDS_CALIBRATION)
    wanted = spec.samples + 4 * HELD_OUT_SEQUENCES
    other = spec.model_copy(update={"seed": spec.seed + HELD_OUT_SEED_OFFSET, "samples": wanted})
    texts, _ = load_texts(other, paths.data_dir(data_dir), model_path)
    seen = set(calibration)
    return [t for t in texts if t not in seen]


def token_chunks(tokenizer: Any, texts: list[str], seq_len: int, n: int) -> Any:
    """The texts as one token stream (EOS between them), cut into `n` rows of `seq_len` tokens."""
    import torch

    stream: list[int] = []
    for t in texts:
        stream += tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(stream) >= n * seq_len:
            break
    if len(stream) < n * seq_len:
        raise QserveError(f"the held-out calibration text has {len(stream)} tokens; sensitivity needs {n * seq_len}")
    return torch.tensor(stream[: n * seq_len]).view(n, seq_len)


def weight_args(scheme: str, group_size: int | None) -> Any:
    """The scheme's weight quantization arguments, as compressed-tensors' preset defines them."""
    from compressed_tensors.quantization import preset_name_to_scheme

    from qserve.schemes.catalog import SCHEMES

    args = preset_name_to_scheme(SCHEMES[scheme].backends["llmcompressor"], ["Linear"]).weights
    if group_size is not None:
        args.group_size = group_size
    return args


def fake_quantized(weight: Any, args: Any) -> Any:
    """Round-to-nearest quantize-dequantize of a Linear weight with min-max scales (per channel or group)."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    w = weight.detach()
    rows = w.shape[0]
    grouped = w.view(rows, -1, args.group_size) if args.group_size else w.view(rows, 1, -1)
    lo = torch.clamp(grouped.amin(dim=-1), max=0)
    hi = torch.clamp(grouped.amax(dim=-1), min=0)
    scale, zero = calculate_qparams(lo, hi, args)
    if not args.group_size:
        scale, zero = scale.view(rows, 1), zero.view(rows, 1)
    return fake_quantize(w, scale, zero, args)


class BlockInputs:
    """The reference pass's input to every decoder block, so a pass with block i changed starts at
    block i (about half the work on average). Models without `model.layers`/`norm`/`lm_head` run whole."""

    def __init__(self, model: Any, chunks: Any) -> None:
        self.model, self.chunks = model, chunks
        inner = getattr(model, "model", None)
        self.layers = getattr(inner, "layers", None)
        self.inputs: list[tuple[Any, dict]] = []
        if self.layers is None or not hasattr(inner, "norm") or not hasattr(model, "lm_head"):
            self.layers = None

    def reference(self) -> Any:
        """Log-probabilities of the unchanged model, recording each block's input on the way."""
        hooks = []
        if self.layers is not None:
            record = lambda module, args, kwargs: self.inputs.append((args[0], kwargs))  # noqa: E731
            hooks = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in self.layers]
        try:
            return self.whole()
        finally:
            for h in hooks:
                h.remove()

    def whole(self) -> Any:
        import torch

        with torch.inference_mode():
            return torch.log_softmax(self.model(self.chunks, use_cache=False).logits.float(), dim=-1)

    def from_block(self, block: int) -> Any:
        """Log-probabilities with the recorded input to `block` and the blocks from there on run again."""
        import torch

        if self.layers is None or len(self.inputs) != len(self.layers):
            return self.whole()
        hidden, kwargs = self.inputs[block]
        with torch.inference_mode():
            for layer in self.layers[block:]:
                out = layer(hidden, **kwargs)
                hidden = out[0] if isinstance(out, tuple) else out
            logits = self.model.lm_head(self.model.model.norm(hidden))
            return torch.log_softmax(logits.float(), dim=-1)


def _score(ref: Any, quant: Any, chunks: Any) -> tuple[float, float]:
    """Mean KL(ref || quant) per token, and the quantized model's token perplexity."""
    kl = (ref.exp() * (ref - quant)).sum(-1).mean().item()
    nll = -quant[:, :-1].gather(-1, chunks[:, 1:, None]).mean().item()
    return kl, math.exp(nll)


def measure(
    model_path: Path,
    recipe: Recipe,
    scheme: str,
    group_size: int | None,
    texts: list[str],
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """KL and perplexity change of each layer group quantized alone to `scheme`, most harmful last."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, trust_remote_code=trust_remote_code)
    model.eval()
    chunks = token_chunks(tokenizer, texts, recipe.seq_len, HELD_OUT_SEQUENCES)
    groups = layer_groups(model, recipe.ignore)
    args = weight_args(scheme, group_size)
    with step(f"sensitivity: {len(groups)} layer groups quantized alone to {scheme} on {chunks.numel()} held-out tokens"):
        passes = BlockInputs(model, chunks)
        ref = passes.reference()
        _, base_ppl = _score(ref, ref, chunks)
        rows = []
        for i, g in enumerate(groups):
            rows.append(_group_row(model, g, args, ref, passes, base_ppl))
            count("layer groups", i + 1, len(groups))
    rows.sort(key=lambda r: r["kl"])
    return {
        "scheme": scheme,
        "group_size": group_size,
        "tokens": chunks.numel(),
        "baseline_token_perplexity": base_ppl,
        "metric": "mean KL divergence per token from the unquantized model (nats)",
        "groups": rows,
    }


def _group_row(model: Any, group: LayerGroup, args: Any, ref: Any, passes: BlockInputs, base_ppl: float) -> dict[str, Any]:
    """Quantize one group's weights, score, and put the original weights back."""
    modules = dict(model.named_modules())
    saved = {name: modules[name].weight.data.clone() for name in group.modules}
    try:
        for name in group.modules:
            modules[name].weight.data = fake_quantized(saved[name], args)
        kl, ppl = _score(ref, passes.from_block(group.block), passes.chunks)
    finally:
        for name, w in saved.items():
            modules[name].weight.data = w
    return {
        "group": group.name,
        "block": group.block,
        "kind": group.kind,
        "params": group.params,
        "kl": kl,
        "ppl_change": ppl / base_ppl - 1,
    }
