"""`qserve gate --checkpoint`: bind two lm-eval runs made elsewhere to a qserve checkpoint, so that their
PASS can serve it.

Before anything is decided, the runs must be of this checkpoint and of its source model, as lm-eval
records them (`config.model_args`: a dict from lm-eval's command line, a "k=v,k=v" string from its
Python API): the quantized run's `pretrained=` is the checkpoint's own directory (an absolute path,
resolved: lm-eval does not record where it ran, so a relative one names nothing here), loaded without
adapters, another tokenizer or engine settings the server would not use, and started after the
checkpoint was made (a checkpoint re-quantized in place is other weights at the same path); the
baseline run's is the source model the manifest names. The checkpoint's files are verified against
its manifest by whoever opened it. The record is then written as `qserve eval` writes its own,
saying where the runs came from.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qserve.checkpoint.hashing import sha256_file
from qserve.checkpoint.opened import Checkpoint
from qserve.errors import QserveError
from qserve.gate.decisions import Gate
from qserve.gate.schema import EvalRecord, Look, OutsideRun, OutsideRuns

# model_args that load more than the named weights: a PEFT adapter, a delta, a vLLM LoRA (lm-eval's names).
ADAPTERS = ("peft", "delta", "lora_local_path")
# vLLM settings that change what the model computes, at vLLM's default when a run names none. A run's
# must be what `qserve serve` passes (the manifest's), or a value that takes the checkpoint's own
# (quantization found in its config, dtype "auto": the config's); kv_cache_dtype "auto" is not fp8.
ENGINE_DEFAULTS = {"quantization": None, "dtype": "auto", "kv_cache_dtype": "auto"}
TAKEN_FROM_CHECKPOINT = {("quantization", None), ("dtype", "auto")}


def model_args(raw: dict[str, Any], where: Path) -> dict[str, Any]:
    """A run's model arguments as lm-eval wrote them (`config.model_args`), as a dict."""
    args = (raw.get("config") or {}).get("model_args") if isinstance(raw.get("config"), dict) else None
    if isinstance(args, dict):
        return args
    if isinstance(args, str):  # read as lm-eval read it to load the model
        from lm_eval.utils import simple_parse_args_string

        return simple_parse_args_string(args)
    raise QserveError(
        f"{where} does not record the model it evaluated (lm-eval's config.model_args); it cannot vouch for a checkpoint"
    )


def check_runs(ckpt: Checkpoint, base: tuple[dict[str, Any], Path], quant: tuple[dict[str, Any], Path]) -> None:
    """Refuse runs that are not of this checkpoint (quantized) and its source model (baseline)."""
    (quant_raw, quant_at), (base_raw, base_at) = quant, base
    args = model_args(quant_raw, quant_at)
    named = _pretrained(args, quant_at)
    if named.resolve() != ckpt.path.resolve():
        raise QserveError(
            f"the quantized run {quant_at} evaluated {args['pretrained']}, not the checkpoint {ckpt.path.resolve()}: "
            "its gate cannot authorize this checkpoint"
        )
    _loads_only_the_checkpoint(args, ckpt, quant_at)
    _ran_after(quant_raw, ckpt, quant_at)
    _names_source(model_args(base_raw, base_at), ckpt, base_at)


def _pretrained(args: dict[str, Any], where: Path) -> Path:
    """The quantized run's model directory: an absolute path (lm-eval does not record where it ran)."""
    value = args.get("pretrained")
    if not isinstance(value, str) or not value:
        raise QserveError(f"the quantized run {where} names no model directory (pretrained= in its model_args)")
    if not Path(value).is_absolute():
        raise QserveError(
            f"the quantized run {where} names the relative path {value}, and lm-eval does not record where it ran; "
            "run it with an absolute pretrained= path"
        )
    return Path(value)


def _loads_only_the_checkpoint(args: dict[str, Any], ckpt: Checkpoint, where: Path) -> None:
    """No adapter, no other tokenizer, and the engine settings `qserve serve` will use."""
    extra = [k for k in ADAPTERS if args.get(k)]
    if extra:
        raise QserveError(
            f"the quantized run {where} loaded {extra[0]}={args[extra[0]]} on top of the checkpoint: not what is served"
        )
    tokenizer = args.get("tokenizer")
    if tokenizer and (not Path(str(tokenizer)).is_absolute() or Path(str(tokenizer)).resolve() != ckpt.path.resolve()):
        raise QserveError(f"the quantized run {where} used the tokenizer {tokenizer}, not the checkpoint's: not what is served")
    served = ckpt.manifest.vllm_args.model_dump()
    for key, default in ENGINE_DEFAULTS.items():
        ran = args.get(key, default)
        if ran != served[key] and (key, ran) not in TAKEN_FROM_CHECKPOINT:
            raise QserveError(
                f"the quantized run {where} ran with {key}={ran}, and `qserve serve` runs the checkpoint with "
                f"{key}={served[key]}: its scores are not those of what is served"
            )


def _ran_after(raw: dict[str, Any], ckpt: Checkpoint, where: Path) -> None:
    """A run started before the checkpoint was made evaluated other weights at that path."""
    started, made = raw.get("date"), _instant(ckpt.manifest.created_at)
    if not isinstance(started, (int, float)):
        raise QserveError(
            f"the quantized run {where} does not record when it started (lm-eval's date): it cannot vouch for {ckpt.path}"
        )
    if made is None:
        raise QserveError(f"{ckpt.path}'s manifest does not say when it was made (created_at {ckpt.manifest.created_at!r})")
    if started < made:
        ran = datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds")
        raise QserveError(
            f"the quantized run {where} started {ran}, before the checkpoint {ckpt.path} was made "
            f"({ckpt.manifest.created_at}): it evaluated other weights at that path"
        )


def _instant(stamp: str) -> float | None:
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def _names_source(args: dict[str, Any], ckpt: Checkpoint, where: Path) -> None:
    """The baseline is the model the checkpoint was quantized from: its id (a hub id), or its directory."""
    source = ckpt.manifest.source_model
    value = args.get("pretrained")
    if isinstance(value, str) and value == source.get("id"):
        return
    here = isinstance(value, str) and Path(value).is_absolute() and source.get("path")
    if here and Path(value).resolve() == Path(source["path"]).resolve():
        return
    raise QserveError(
        f"the baseline run {where} evaluated {value}, not {ckpt.path}'s source model {source.get('id')} "
        f"({source.get('path')}): the gate would compare the checkpoint with another model"
    )


def described(raw: dict[str, Any], results: Path) -> OutsideRun:
    """Where a run came from and what lm-eval recorded of it, for the record."""
    config = raw.get("config") if isinstance(raw.get("config"), dict) else {}
    date = raw.get("date")
    return OutsideRun(
        results=str(results.resolve()),
        results_sha256=sha256_file(results),
        model=config.get("model") if isinstance(config.get("model"), str) else None,
        model_args=config.get("model_args") if isinstance(config.get("model_args"), (dict, str)) else None,
        lm_eval_version=raw.get("lm_eval_version") if isinstance(raw.get("lm_eval_version"), str) else None,
        date=float(date) if isinstance(date, (int, float)) else None,
    )


def record(ckpt: Checkpoint, summary: dict[str, Any], runs: dict[str, OutsideRun], n_samples: dict[str, Any]) -> EvalRecord:
    """`qserve gate`'s decision as the eval record `qserve serve` reads: bound to the manifest it checked."""
    engine = {"vllm": "vllm", "hf": "transformers"}.get(runs["quantized"].model or "")
    return EvalRecord(
        manifest_sha256=ckpt.digest,
        decided_at=summary["decided_at"],
        verdict=summary["verdict"],
        gates=[Gate(**g) for g in summary["gates"]],
        checkpoint=str(ckpt.path.resolve()),
        engine=engine,
        emulated=engine == "transformers",  # lm-eval's hf: scores from transformers, not the vLLM that serves
        scheme=ckpt.manifest.scheme,
        recipe=ckpt.manifest.recipe.name,
        tasks=summary["tasks"],
        groups=summary.get("groups"),
        n_samples={task: n_samples.get(task) for task in summary["tasks"]},
        look=Look(**summary["look"]),
        outside_runs=OutsideRuns(**runs),
    )
