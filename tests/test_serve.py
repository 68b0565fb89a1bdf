"""`qserve serve`: the real vLLM OpenAI server, answering the real `openai` client, behind the gate."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from conftest import QSERVE, copy_checkpoint, free_port, run_qserve


@pytest.mark.slow
def test_serve_answers_chat_completions(passed_eval) -> None:
    from openai import OpenAI

    ckpt, _ = passed_eval
    port = free_port()
    proc = subprocess.Popen([*QSERVE, "serve", ckpt, "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=os.environ.copy())
    timer = threading.Timer(600, proc.kill)  # never hang the suite
    timer.start()
    try:
        first = proc.stdout.readline()
        assert first.startswith(f"serving {ckpt.name} at http://127.0.0.1:{port}/v1"), first
        curl = proc.stdout.readline()
        assert curl.startswith(f"curl http://127.0.0.1:{port}/v1/chat/completions")
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model=ckpt.name, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16, temperature=0
        )
        assert "Paris" in reply.choices[0].message.content
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_serve_refuses_ungated_checkpoint(checkpoints, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(checkpoints["w4a16-gptq"], tmp_path / "ckpt")
    (ckpt / "qserve_eval.json").unlink(missing_ok=True)
    proc = run_qserve("serve", ckpt, "--port", str(free_port()))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == f"error: {ckpt} has no accuracy gate result; run `qserve eval {ckpt}` first (or pass --skip-gate)"


@pytest.mark.slow
def test_serve_refuses_failed_or_stale_gate(passed_eval, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(passed_eval[0], tmp_path / "ckpt")
    eval_file = ckpt / "qserve_eval.json"
    eval_file.write_text(eval_file.read_text().replace('"verdict": "pass"', '"verdict": "fail"'))
    proc = run_qserve("serve", ckpt, "--port", str(free_port()))
    assert proc.returncode == 1 and "did not pass its accuracy gate (verdict: fail)" in proc.stderr


@pytest.mark.slow
def test_serve_refuses_tampered_weights(passed_eval, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(passed_eval[0], tmp_path / "ckpt")
    with (ckpt / "model.safetensors").open("r+b") as f:
        f.seek(-16, os.SEEK_END)
        f.write(b"\x00" * 16)
    proc = run_qserve("serve", ckpt, "--port", str(free_port()))
    assert proc.returncode == 1
    assert "does not match its manifest (changed model.safetensors)" in proc.stderr


@pytest.mark.slow
def test_serve_refuses_occupied_port(passed_eval) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_qserve("serve", passed_eval[0], "--port", str(port))
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
