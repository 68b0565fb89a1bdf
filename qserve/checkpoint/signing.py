"""Signed checkpoints through OpenSSF's model-signing library (PyPI `model-signing`).

The manifest's hashes catch accidental change, not a deliberate one: whoever can write the
directory can re-hash it. A signature made with a private key after the gate passed covers
every file of the checkpoint (weights, configs, tokenizer, code, the manifest, the eval record
and the reports), so `eval`/`serve --verify-key PUB` refuse anything the key holder did not sign.
Only the signature itself and `logs/` (written by `serve`) are outside it.

model_signing is imported inside the functions, so `qserve --help` stays instant.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from qserve.checkpoint.manifest import RECORD_DIRS, SIGNATURE_NAME
from qserve.errors import QserveError

# Relative to the checkpoint; recorded in the signed statement, so a verifier sees the same list.
UNSIGNED = (SIGNATURE_NAME, *sorted(RECORD_DIRS))


def write_signature(ckpt: Path, private_key: Path, password: str | None = None) -> Path:
    """Sign every file of the checkpoint as it stands (the caller has checked what must hold first:
    `qserve.gate.records.sign`); returns the signature path."""
    _readable(private_key, "--private-key")
    from model_signing import signing

    signature = ckpt / SIGNATURE_NAME
    partial = ckpt / f".{SIGNATURE_NAME}.{os.getpid()}.tmp"
    config = signing.Config().use_elliptic_key_signer(private_key=private_key, password=password)
    try:
        config.set_hashing_config(_hashing()).sign(ckpt, partial)
        os.replace(partial, signature)  # a signature is there whole or not at all
    except ValueError as exc:
        raise QserveError(f"cannot sign with {private_key}: {exc}") from None
    finally:
        partial.unlink(missing_ok=True)
    return signature


def verify(ckpt: Path, public_key: Path) -> None:
    """Raise unless the checkpoint carries a signature by `public_key` covering exactly its files."""
    signature = ckpt / SIGNATURE_NAME
    if not signature.is_file():
        raise QserveError(f"{ckpt} is not signed (no {SIGNATURE_NAME}); sign it with `qserve sign {ckpt} --private-key KEY`")
    _readable(public_key, "--verify-key")
    from model_signing import verifying

    config = verifying.Config().use_elliptic_key_verifier(public_key=public_key)
    try:
        config.set_hashing_config(_hashing()).verify(ckpt, signature)
    except ValueError as exc:
        raise QserveError(f"signature check of {ckpt} against {public_key} failed: {_reason(str(exc))}") from None


def _reason(message: str) -> str:
    """model-signing's mismatch list (with raw digests) as qserve's one line: which files, and how."""
    # Names stand in quotes that repr() may have escaped ('name' or \'name\').
    changed = re.findall(r"Hash mismatch for \\?'([^'\\]+)", message)
    added = re.search(r"Extra files found in model \\?'[^'\\]*\\?': ([^\"'\\\]]+)", message)
    missing = re.search(r"Missing files in model \\?'[^'\\]*\\?': ([^\"'\\\]]+)", message)
    parts = [f"missing {missing.group(1)}"] if missing else []
    parts += [f"changed {', '.join(changed)}"] if changed else []
    parts += [f"unexpected {added.group(1)}"] if added else []
    return "; ".join(parts) or message.splitlines()[0].strip()


def _hashing():
    from model_signing import hashing

    # git paths are hashed too: nothing in the directory escapes the signature but UNSIGNED.
    return hashing.Config().set_ignored_paths(paths=list(UNSIGNED), ignore_git_paths=False)


def _readable(key: Path, flag: str) -> None:
    if not Path(key).is_file():
        raise QserveError(f"{flag} {key}: no such file")
