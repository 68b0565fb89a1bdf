"""Signed checkpoints (OpenSSF model-signing): a signature covers exactly the files, manifest and eval record.

Keys are generated here with `cryptography`, never committed. The checkpoint is a small directory
with a real manifest and an eval record bound to it, so the real signing and verifying code runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import gate_record, make_keys, run_qserve, small_manifest

from qserve.checkpoint.manifest import EVAL_NAME, SIGNATURE_NAME, hash_files, manifest_digest, write_manifest
from qserve.checkpoint.signing import verify
from qserve.errors import QserveError
from qserve.gate.records import sign


def _gated_checkpoint(root: Path, verdict: str = "pass") -> Path:
    ckpt = root / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights")
    (ckpt / "config.json").write_text("{}")
    manifest = small_manifest(files=hash_files(ckpt))
    write_manifest(ckpt, manifest)
    record = {
        "verdict": verdict,
        "manifest_sha256": manifest_digest(ckpt),
        "decided_at": "2026-11-22T00:00:00+00:00",
        "gates": [gate_record("gsm8k")],
    }
    (ckpt / EVAL_NAME).write_text(json.dumps(record))
    return ckpt


@pytest.fixture()
def signed(tmp_path: Path) -> tuple[Path, Path, Path]:
    ckpt = _gated_checkpoint(tmp_path)
    private, public = make_keys(tmp_path, "owner")
    assert sign(ckpt, private) == ckpt / SIGNATURE_NAME
    return ckpt, private, public


def test_signature_verifies_and_ignores_only_serve_logs(signed) -> None:
    ckpt, _, public = signed
    verify(ckpt, public)
    (ckpt / "logs").mkdir()
    (ckpt / "logs" / "serve.log").write_text("vLLM output")  # serve writes here: not signed
    verify(ckpt, public)


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda c: (c / "sitecustomize.py").write_text("import os"), "unexpected sitecustomize.py"),
        (lambda c: (c / "config.json").unlink(), "missing config.json"),
        (lambda c: (c / "model.safetensors").write_bytes(b"weightz"), "changed model.safetensors"),
        # A deliberate edit with a re-hashed manifest and a re-bound eval record: the manifest alone would accept it.
        (lambda c: _rehash(c), f"changed config.json, {EVAL_NAME}, qserve_manifest.json"),
        (lambda c: (c / EVAL_NAME).write_text('{"verdict": "pass"}'), f"changed {EVAL_NAME}"),
    ],
)
def test_any_change_is_refused_naming_the_file(signed, edit, reason: str) -> None:
    ckpt, _, public = signed
    edit(ckpt)
    with pytest.raises(QserveError) as e:
        verify(ckpt, public)
    assert str(e.value) == f"signature check of {ckpt} against {public} failed: {reason}"


def _rehash(ckpt: Path) -> None:
    from qserve.checkpoint.manifest import read_manifest, verify_files

    (ckpt / "config.json").write_text('{"rope_theta": 1}')
    manifest = read_manifest(ckpt)
    manifest.files = hash_files(ckpt)
    write_manifest(ckpt, manifest)
    record = json.loads((ckpt / EVAL_NAME).read_text()) | {"manifest_sha256": manifest_digest(ckpt)}
    (ckpt / EVAL_NAME).write_text(json.dumps(record))
    verify_files(ckpt, manifest)  # the hashes agree: only the signature tells


def test_another_key_or_no_signature_is_refused(signed, tmp_path: Path) -> None:
    ckpt, _, _ = signed
    _, stranger = make_keys(tmp_path, "stranger")
    with pytest.raises(QserveError) as e:
        verify(ckpt, stranger)
    assert str(e.value) == (
        f"signature check of {ckpt} against {stranger} failed: Key mismatch: The public key hash in the "
        "signature's verification material does not match the provided public key."
    )
    (ckpt / SIGNATURE_NAME).unlink()
    with pytest.raises(QserveError, match=f"^{ckpt} is not signed \\(no {SIGNATURE_NAME}\\); sign it with"):
        verify(ckpt, stranger)


def test_only_a_passed_gate_is_signed(tmp_path: Path) -> None:
    ckpt = _gated_checkpoint(tmp_path, verdict="inconclusive")
    private, _ = make_keys(tmp_path, "owner")
    with pytest.raises(QserveError, match="did not pass its accuracy gate \\(verdict: inconclusive\\)"):
        sign(ckpt, private)
    assert not (ckpt / SIGNATURE_NAME).exists() and sorted(p.name for p in ckpt.iterdir() if p.name.startswith(".")) == []


def test_cli_sign_then_eval_refuses_a_wrong_key_before_any_engine(tmp_path: Path) -> None:
    ckpt = _gated_checkpoint(tmp_path)
    private, _ = make_keys(tmp_path, "owner")
    _, stranger = make_keys(tmp_path, "stranger")
    proc = run_qserve("sign", ckpt, "--private-key", private)
    assert proc.returncode == 0 and proc.stdout.strip() == str(ckpt / SIGNATURE_NAME), proc.stderr
    proc = run_qserve("eval", ckpt, "--verify-key", stranger)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: signature check of {ckpt} against {stranger} failed: ")
    proc = run_qserve("sign", ckpt, "--private-key", tmp_path / "missing.pem")
    assert (proc.returncode, proc.stderr.strip().splitlines()[-1]) == (
        1,
        f"error: --private-key {tmp_path / 'missing.pem'}: no such file",
    )
