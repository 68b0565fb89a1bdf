"""`qserve inspect` and `qserve sign`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from qserve.cli._common import AcceptGateDifferenceOpt, JsonOpt, PolicyOpt, user_errors


@user_errors
def inspect(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint dir written by `qserve quantize`.")],
    as_json: JsonOpt = False,
) -> None:
    """Show a checkpoint's scheme, size against its baseline, vLLM arguments, integrity and gate status.

    \b
    Example:
      qserve inspect out-w8a8-int8 --json
    """
    from qserve.workflows.inspection import format_inspection, inspect_checkpoint

    info = inspect_checkpoint(checkpoint)
    typer.echo(json.dumps(info, indent=2) if as_json else format_inspection(info))


@user_errors
def sign(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint dir whose accuracy gate passed.")],
    private_key: Annotated[Path, typer.Option("--private-key", help="PEM elliptic-curve private key (e.g. P-256).")],
    password_env: Annotated[
        str | None, typer.Option("--password-env", help="Name of the environment variable holding the key's password.")
    ] = None,
    policy: PolicyOpt = None,
    accept_gate_difference: AcceptGateDifferenceOpt = False,
) -> None:
    """Sign a gated checkpoint with OpenSSF model-signing: every file, the manifest and the eval record.

    Writes CKPT/qserve_signature.sig (a sigstore bundle). `qserve serve CKPT --verify-key PUB` and
    `qserve eval CKPT --verify-key PUB` then refuse it if any file was added, removed or changed, or if
    another key signed it. Re-evaluating rewrites the eval record, so sign again after an eval.

    \b
    Example (a P-256 key pair, then the signature):
      openssl ecparam -name prime256v1 -genkey -noout | openssl pkcs8 -topk8 -nocrypt -out key.pem
      openssl ec -in key.pem -pubout -out key.pub
      qserve sign out-w8a8-int8 --private-key key.pem
      qserve serve out-w8a8-int8 --verify-key key.pub
    """
    from qserve.gate.records import sign as run

    password = os.environ.get(password_env) if password_env else None
    typer.echo(str(run(checkpoint, private_key, password, policy, accept_gate_difference)))
