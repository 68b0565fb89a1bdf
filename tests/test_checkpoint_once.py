"""A checkpoint opened once per command: each file hashed once, then the private copy for serving
hashed as it is written, after its disk space was checked."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from conftest import small_manifest

from qserve.checkpoint import hashing
from qserve.checkpoint.manifest import check_hashes, hash_files, manifest_digest, write_manifest
from qserve.checkpoint.opened import open_checkpoint
from qserve.checkpoint.snapshot import private_copy
from qserve.errors import QserveError


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    (d / "sub").mkdir(parents=True)
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    (d / "config.json").write_text("{}")
    (d / "sub" / "tokenizer.json").write_text('{"v": 1}')
    (d / "logs").mkdir()
    (d / "logs" / "quantize.log").write_text("not part of the checkpoint")
    write_manifest(d, small_manifest(files=hash_files(d)))
    return d


def _counted(monkeypatch) -> list[Path]:
    read: list[Path] = []
    real = hashing.sha256_file
    monkeypatch.setattr(hashing, "sha256_file", lambda p: read.append(p) or real(p))
    return read


def test_a_checkpoint_is_hashed_once_when_opened_and_not_again_when_passed_on(ckpt: Path, monkeypatch) -> None:
    read = _counted(monkeypatch)
    opened = open_checkpoint(ckpt)
    # each file once, and the manifest's own digest (what gate decisions bind to)
    assert sorted(p.name for p in read) == ["config.json", "model.safetensors", "qserve_manifest.json", "tokenizer.json"]
    assert open_checkpoint(opened) is opened and len(read) == 4
    assert opened.digest == manifest_digest(ckpt) and opened.manifest.files == hash_files(ckpt)


def test_the_private_copy_is_hashed_as_written_and_a_file_changed_after_opening_is_caught(ckpt: Path, monkeypatch) -> None:
    opened = open_checkpoint(ckpt)
    read = _counted(monkeypatch)
    with private_copy(ckpt) as (copy, hashes):
        assert read == []  # hashed from the bytes it wrote, not read again
        assert hashes == opened.manifest.files and not (copy / "logs").exists()
        assert (copy / "sub" / "tokenizer.json").read_text() == '{"v": 1}'
    assert not copy.exists()
    (ckpt / "config.json").write_text('{"swapped": true}')
    with private_copy(ckpt) as (copy, hashes), pytest.raises(QserveError) as err:
        check_hashes(copy, hashes, opened.manifest)
    assert str(err.value) == (
        f"checkpoint {copy} does not match its manifest (changed config.json): it was modified after quantization"
    )


def test_a_private_copy_that_would_not_fit_is_refused_before_it_is_made(ckpt: Path, monkeypatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda where: usage(10 << 30, 10 << 30, 1 << 20))
    with pytest.raises(QserveError) as err:
        with private_copy(ckpt):
            pass
    assert str(err.value).startswith(f"serving {ckpt.resolve()} needs a private copy of 0.06 GiB and ")
    assert str(err.value).endswith(" has 0.00 GiB free; free space there or point QSERVE_CACHE_DIR at a larger disk")
