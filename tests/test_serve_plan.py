"""The `vllm serve` command qserve builds: matched arguments, pass-through, scale-out flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from qserve.checkpoint.manifest import Manifest, VllmArgs
from qserve.device.detect import Device
from qserve.errors import QserveError
from qserve.serve.plan import parse_extra_args, plan

CPU = Device("cpu", "test")
GPU = Device("cuda", "test GPU")


def manifest(**vllm) -> Manifest:
    args = {"quantization": "compressed-tensors", "kv_cache_dtype": "auto", "dtype": "bfloat16"} | vllm
    return Manifest(
        created_at="2026-01-01T00:00:00+00:00",
        scheme="W8A8",
        recipe={},
        recipe_source={},
        source_model={},
        calibration=None,
        versions={},
        vllm_args=VllmArgs(**args),
        timings={},
        files={},
    )


def flags(cmd: list[str]) -> dict[str, str | None]:
    return dict(parse_extra_args(cmd[cmd.index("serve") + 2 :]))


def test_matched_arguments_and_loopback_default(tmp_path: Path) -> None:
    p = plan(tmp_path / "ck", manifest(), CPU, "127.0.0.1", 8000)
    f = flags(p.command)
    assert p.command[1:5] == ["-m", "qserve.device.vllm_cli", "serve", str((tmp_path / "ck").resolve())]
    assert (f["--quantization"], f["--kv-cache-dtype"], f["--dtype"]) == ("compressed-tensors", "auto", "bfloat16")
    assert (f["--host"], f["--port"]) == ("127.0.0.1", "8000")
    assert "--enforce-eager" in f and "--kv-cache-memory-bytes" in f  # CPU engine settings, as in eval
    assert "--trust-remote-code" not in f


def test_scale_out_flags_pass_through_on_gpu(tmp_path: Path) -> None:
    extra = ["--tensor-parallel-size", "8", "--pipeline-parallel-size=2", "--distributed-executor-backend", "ray"]
    p = plan(tmp_path / "ck", manifest(), GPU, "0.0.0.0", 9000, extra_args=extra)
    f = flags(p.command)
    assert (f["--tensor-parallel-size"], f["--pipeline-parallel-size"], f["--distributed-executor-backend"]) == ("8", "2", "ray")
    assert "--enforce-eager" not in f and "--kv-cache-memory-bytes" not in f
    assert p.url == "http://0.0.0.0:9000"


def test_user_overrides_qserve_defaults_once(tmp_path: Path) -> None:
    p = plan(
        tmp_path / "ck", manifest(), CPU, "127.0.0.1", 8000, extra_args=["--max-model-len", "4096", "--served-model-name", "m"]
    )
    assert p.command.count("--max-model-len") == 1 and flags(p.command)["--max-model-len"] == "4096"
    assert p.model_name == "m"


def test_agreeing_matched_flag_is_accepted_once(tmp_path: Path) -> None:
    p = plan(tmp_path / "ck", manifest(), CPU, "127.0.0.1", 8000, extra_args=["--dtype=bfloat16"])
    assert p.command.count("--dtype") == 1


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["--quantization", "awq"],
            "--quantization awq contradicts the checkpoint, which needs --quantization compressed-tensors",
        ),
        (["-q", "fp8"], "-q fp8 contradicts the checkpoint, which needs -q compressed-tensors"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 contradicts the checkpoint, which needs --kv-cache-dtype auto"),
        (["--dtype", "float16"], "--dtype float16 contradicts the checkpoint, which needs --dtype bfloat16"),
        (["--port", "1"], "pass --port as qserve's own --port option"),
        (["tensor-parallel-size"], "unexpected vLLM argument 'tensor-parallel-size'"),
    ],
)
def test_contradicting_or_misplaced_flags_are_refused(tmp_path: Path, extra: list[str], message: str) -> None:
    with pytest.raises(QserveError) as e:
        plan(tmp_path / "ck", manifest(), CPU, "127.0.0.1", 8000, extra_args=extra)
    assert str(e.value).startswith(message)


def test_api_key_stays_out_of_the_command_line(tmp_path: Path) -> None:
    p = plan(tmp_path / "ck", manifest(), CPU, "127.0.0.1", 8000, api_key="s3cret")
    assert "s3cret" not in " ".join(p.command) and p.env["VLLM_API_KEY"] == "s3cret"


def test_trust_remote_code_only_when_recorded(tmp_path: Path) -> None:
    p = plan(tmp_path / "ck", manifest(trust_remote_code=True), CPU, "127.0.0.1", 8000)
    assert "--trust-remote-code" in p.command
