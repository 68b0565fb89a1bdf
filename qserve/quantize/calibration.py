"""Calibration samples from files, Hugging Face datasets, weighted mixes, or the model's own text.

Whatever the source, `load_texts` returns the exact texts and a record (with content hashes) that
the manifest keeps, so a checkpoint says precisely what it was calibrated on.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from qserve.errors import QserveError
from qserve.progress import step
from qserve.spec.recipe import CalibrationSpec, DataSource, GenerateSpec

FILE_FORMATS = (".jsonl", ".json", ".txt", ".parquet")
GENERATE_BATCH = 8


def load_texts(spec: CalibrationSpec, data_dir: Path, model_path: Path | None = None) -> tuple[list[str], dict[str, Any]]:
    """Draw `spec.samples` texts from the spec's source(s); returns them and their record.

    `model_path` supplies the tokenizer (chat templates) and the generator (data-free source).
    """
    sources = spec.sources()
    tokenizer = cache(lambda: _tokenizer(model_path))  # loaded only for chat messages
    texts: list[str] = []
    drawn: list[dict[str, Any]] = []
    for i, (src, n) in enumerate(zip(sources, split_by_weight(spec.samples, [s.weight for s in sources]), strict=True)):
        if n == 0:
            continue
        rng = random.Random(spec.seed + i)
        if src.generate is not None:
            got, rec = _generated(src.generate, n, spec.seed + i, model_path)
        else:
            records, rec = _dataset_records(src) if src.dataset else _file_records(src, data_dir)
            if len(records) < n:
                raise QserveError(
                    f"calibration source {_name(src, data_dir)} has {len(records)} records; the recipe asks for {n}"
                )
            chosen = sorted(rng.sample(range(len(records)), n))
            got = [_render(src, records[j], j, tokenizer, _name(src, data_dir)) for j in chosen]
            rec |= {"records": len(records), "template": src.text or "{text}", "messages_field": src.messages}
        texts += got
        drawn.append({"kind": src.kind, "source": src.source, "weight": src.weight, "samples": n} | rec)
    record = {
        "samples": len(texts),
        "seq_len": spec.seq_len,
        "seed": spec.seed,
        "sources": drawn,
        "content_sha256": hashlib.sha256("\x1e".join(texts).encode()).hexdigest(),
    }
    return texts, record


def split_by_weight(total: int, weights: list[float]) -> list[int]:
    """Largest-remainder split of `total` samples in proportion to `weights`."""
    shares = [total * w / sum(weights) for w in weights]
    counts = [int(s) for s in shares]
    for i in sorted(range(len(shares)), key=lambda i: counts[i] - shares[i])[: total - sum(counts)]:
        counts[i] += 1
    return counts


def tokenized_dataset(texts: list[str], tokenizer: Any, seq_len: int) -> Any:
    """A datasets.Dataset of input_ids/attention_mask, truncated to seq_len, as oneshot expects."""
    from datasets import Dataset

    enc = tokenizer(texts, truncation=True, max_length=seq_len, add_special_tokens=False)
    return Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def check_files(spec: CalibrationSpec, data_dir: Path) -> None:
    """Refuse, before any work, a calibration file that does not exist or has an unknown format."""
    for src in spec.sources():
        if src.generate is None and not src.dataset:
            resolve_path(src, data_dir)


def resolve_path(src: DataSource, data_dir: Path) -> Path:
    path = Path(src.path or "").expanduser()
    path = path if path.is_absolute() else data_dir / path
    if not path.is_file():
        raise QserveError(
            f"calibration data {path} does not exist (relative paths resolve against --data-dir / QSERVE_DATA_DIR, now {data_dir})"
        )
    if path.suffix not in FILE_FORMATS:
        raise QserveError(f"calibration data {path}: unsupported format {path.suffix!r}; use one of {', '.join(FILE_FORMATS)}")
    return path


def _file_records(src: DataSource, data_dir: Path) -> tuple[list[dict], dict[str, Any]]:
    path = resolve_path(src, data_dir)
    records = READERS[path.suffix](path)
    if not records:
        raise QserveError(f"calibration data {path} is empty")
    return records, {"path": str(path), "file_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def _dataset_records(src: DataSource) -> tuple[Any, dict[str, Any]]:
    import datasets

    what = f"{src.dataset}{f' ({src.subset})' if src.subset else ''} split {src.split}"
    with step(f"loading calibration dataset {what} from the Hugging Face hub"):
        try:
            ds = datasets.load_dataset(src.dataset, src.subset, split=src.split)
        except Exception as exc:  # offline, unknown id, bad split: the user's to fix
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise QserveError(f"could not load calibration dataset {what}: {first}") from None
    rec = {"dataset": src.dataset, "subset": src.subset, "split": src.split, "fingerprint": ds._fingerprint}
    return ds, rec


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise QserveError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise QserveError(f"{path}:{n}: each line must be a JSON object")
            records.append(obj)
    return records


def _read_json(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise QserveError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise QserveError(f"{path}: expected a JSON list of objects")
    return data


def _read_txt(path: Path) -> list[dict]:
    """Plain text: one sample per paragraph (blank-line separated), as field `text`."""
    paragraphs = path.read_text(encoding="utf-8").split("\n\n")
    return [{"text": p.strip()} for p in paragraphs if p.strip()]


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise QserveError(f"{path}: not a readable parquet file ({exc})") from None


READERS: dict[str, Callable[[Path], list[dict]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".txt": _read_txt,
    ".parquet": _read_parquet,
}


def _render(src: DataSource, record: dict, index: int, tokenizer: Callable[[], Any], where: str) -> str:
    if src.messages:
        messages = record.get(src.messages)
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise QserveError(
                f"record {index + 1} of {where}: field {src.messages!r} must be a list of {{role, content}} messages"
            )
        return tokenizer().apply_chat_template(messages, tokenize=False)
    template = src.text or "{text}"
    try:
        return template.format(**record)
    except KeyError as exc:
        raise QserveError(
            f"calibration template {template!r} names field {exc.args[0]!r}, which record {index + 1} of {where} lacks (fields: {', '.join(record)})"
        ) from None


def _generated(spec: GenerateSpec, n: int, seed: int, model_path: Path | None) -> tuple[list[str], dict[str, Any]]:
    """Data-free: the model continues the seed prompts (sampled, seeded) to make its own text."""
    import torch
    from transformers import AutoModelForCausalLM

    if model_path is None:
        raise QserveError("a generate calibration source needs the model")
    tok = _tokenizer(model_path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    prompts = [_chat_prompt(tok, spec.prompts[i % len(spec.prompts)]) for i in range(n)]
    torch.manual_seed(seed)
    texts = []
    with step(f"generating {n} calibration samples with the model itself ({spec.max_new_tokens} new tokens each)"):
        for start in range(0, n, GENERATE_BATCH):
            batch = prompts[start : start + GENERATE_BATCH]
            enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    max_new_tokens=spec.max_new_tokens,
                    do_sample=spec.temperature > 0,
                    temperature=spec.temperature or None,
                    top_p=0.95 if spec.temperature > 0 else None,
                    pad_token_id=tok.pad_token_id,
                )
            new = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            texts += [p + c for p, c in zip(batch, new, strict=True)]
    rec = {
        "prompts_sha256": hashlib.sha256("\x1e".join(spec.prompts).encode()).hexdigest(),
        "prompts": len(spec.prompts),
        "max_new_tokens": spec.max_new_tokens,
        "temperature": spec.temperature,
        "generator": str(model_path),
    }
    return texts, rec


def _chat_prompt(tok: Any, prompt: str) -> str:
    if not getattr(tok, "chat_template", None):
        return prompt
    return tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)


def _tokenizer(model_path: Path | None) -> Any:
    from transformers import AutoTokenizer

    if model_path is None:
        raise QserveError("chat-message calibration needs the model's tokenizer (its chat template)")
    return AutoTokenizer.from_pretrained(model_path)


def _name(src: DataSource, data_dir: Path) -> str:
    if src.dataset:
        return src.dataset
    path = Path(src.path or "")
    return str(path if path.is_absolute() else data_dir / path)
