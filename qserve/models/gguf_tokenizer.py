"""A GGUF file's tokenizer, checked before anything is measured with it.

transformers converts a GGUF tokenizer by architecture. For SentencePiece vocabularies
(`tokenizer.ggml.model` "llama", as Gemma's GGUF files carry) its Gemma converter builds a Unigram
model from scores that llama.cpp reads as BPE merge priorities, and adds no BOS: Gemma 3 270M's
GGUF then splits words into pieces of two letters, and a model evaluated through it looks broken.
So every converted tokenizer is checked (a round trip of the task's text, BOS as the GGUF says,
tokens per word as a real tokenizer gives), and for a SentencePiece vocabulary whose conversion
fails, qserve builds the tokenizer llama.cpp runs on that file: byte-fallback BPE that merges the
adjacent pair whose merged piece scores highest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Tokens per whitespace-separated word of PROBE that a real subword tokenizer gives: one splitting words
# into letters or pairs of letters lands above (tests/test_gguf.py measures SmolLM2's, Gemma 3's and
# transformers' broken Gemma conversion against it).
TOKENS_PER_WORD = (1.0, 2.0)
# English prose with numbers, as the shipped tasks have: what a converted tokenizer must round-trip.
PROBE = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Natalia sold 48/2 = 24 clips in May. "
    "Weng earns $12 an hour for babysitting; yesterday she did 50 minutes of it. How much did she earn?"
)
CONTROL, USER_DEFINED = 3, 4  # GGUF token types that are matched whole, never split


@dataclass(frozen=True)
class GgufVocab:
    """What a GGUF file says of its tokenizer."""

    model: str  # tokenizer.ggml.model: "llama" (SentencePiece), "gpt2" (byte-level BPE), ...
    tokens: list[str]
    scores: list[float]
    types: list[int]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_space_prefix: bool


def read_vocab(gguf: Path) -> GgufVocab:
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields

    def scalar(key: str, default: Any = None) -> Any:
        field = fields.get(key)
        return field.parts[field.data[0]][0].item() if field is not None and field.data else default

    def strings(key: str) -> list[str]:
        field = fields[key]
        return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]

    def numbers(key: str) -> list:
        field = fields.get(key)
        return [field.parts[i][0].item() for i in field.data] if field is not None else []

    model = bytes(fields["tokenizer.ggml.model"].parts[fields["tokenizer.ggml.model"].data[0]]).decode()
    return GgufVocab(
        model=model,
        tokens=strings("tokenizer.ggml.tokens"),
        scores=[float(s) for s in numbers("tokenizer.ggml.scores")],
        types=[int(t) for t in numbers("tokenizer.ggml.token_type")],
        bos_id=scalar("tokenizer.ggml.bos_token_id"),
        eos_id=scalar("tokenizer.ggml.eos_token_id"),
        unk_id=scalar("tokenizer.ggml.unknown_token_id"),
        pad_id=scalar("tokenizer.ggml.padding_token_id"),
        add_bos=bool(scalar("tokenizer.ggml.add_bos_token", False)),
        add_space_prefix=bool(scalar("tokenizer.ggml.add_space_prefix", True)),
    )


def spm_tokenizer(vocab: GgufVocab) -> Any:
    """llama.cpp's SentencePiece tokenizer for this vocabulary, as a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    ids = {piece: i for i, piece in enumerate(vocab.tokens)}
    tokenizer = Tokenizer(BPE(ids, _merges(vocab, ids), unk_token=_token(vocab, vocab.unk_id), byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Prepend("▁")] if vocab.add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(decode + ([decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else []))
    whole = [i for i, t in enumerate(vocab.types) if t in (CONTROL, USER_DEFINED)]
    tokenizer.add_special_tokens(
        [AddedToken(vocab.tokens[i], special=vocab.types[i] == CONTROL, normalized=False) for i in whole]
    )
    bos = _token(vocab, vocab.bos_id)
    if vocab.add_bos and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab.bos_id)]
        )
    names = {"bos_token": vocab.bos_id, "eos_token": vocab.eos_id, "unk_token": vocab.unk_id, "pad_token": vocab.pad_id}
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **{k: _token(vocab, i) for k, i in names.items() if i is not None})


def _token(vocab: GgufVocab, index: int | None) -> str | None:
    return vocab.tokens[index] if index is not None and 0 <= index < len(vocab.tokens) else None


def _merges(vocab: GgufVocab, ids: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two pieces, the splits of higher-scoring pieces first: BPE's
    ranks then reproduce llama.cpp's "merge the pair whose merged piece scores highest"."""
    ranked = []
    for piece, index in ids.items():
        if len(piece) < 2 or (vocab.types and vocab.types[index] != 1):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-vocab.scores[index], ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def problems(tokenizer: Any, vocab: GgufVocab, text: str) -> list[str]:
    """What makes this tokenizer unlike the GGUF's on `text` (empty when none)."""
    found = []
    plain = tokenizer(text, add_special_tokens=False).input_ids
    if tokenizer.decode(plain) != text:
        found.append("encoding and decoding the task's text does not give it back")
    first = tokenizer(text).input_ids[:1]
    if vocab.add_bos and first != [vocab.bos_id]:
        found.append(f"it adds no BOS ({_token(vocab, vocab.bos_id)}), which the GGUF asks for (tokenizer.ggml.add_bos_token)")
    if not vocab.add_bos and vocab.bos_id is not None and first == [vocab.bos_id]:
        found.append("it adds a BOS, which the GGUF does not ask for")
    per_word = len(plain) / max(1, len(text.split()))
    low, high = TOKENS_PER_WORD
    if not low <= per_word <= high:
        found.append(f"{per_word:.2f} tokens per word, where a real tokenizer gives {low}-{high}")
    return found
