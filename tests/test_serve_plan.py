"""The `vllm serve` command qserve builds: matched arguments, pass-through, scale-out flags."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ALLOWED_USES, REPO, run_qserve_in_process, small_manifest

from qserve.checkpoint.manifest import Manifest, VllmArgs
from qserve.device.detect import Device
from qserve.errors import QserveError
from qserve.serve.plan import Endpoint, plan
from qserve.support import claims as support

CPU = Device("cpu", "test")
GPU = Device("cuda", "test GPU")


def manifest(**vllm) -> Manifest:
    args = {"kv_cache_dtype": "auto", "dtype": "bfloat16"} | vllm
    return small_manifest(args.pop("quantization", "compressed-tensors"), created_at="2026-01-01T00:00:00+00:00", **args)


def flags(cmd: list[str]) -> dict[str, str | None]:
    """`--flag value`, `--flag=value` and bare `--flag` after the model, as a dict (the last one wins)."""
    out: dict[str, str | None] = {}
    tokens = cmd[cmd.index("serve") + 2 :]
    for i, token in enumerate(tokens):
        if token.startswith("--"):
            flag, eq, value = token.partition("=")
            following = tokens[i + 1] if i + 1 < len(tokens) and not tokens[i + 1].startswith("--") else None
            out[flag] = value if eq else following
    return out


def test_matched_arguments_and_loopback_default(tmp_path: Path) -> None:
    p = plan(tmp_path / "ck", manifest(), CPU, Endpoint())
    f = flags(p.command)
    assert p.command[1:5] == ["-m", "qserve.engines.vllm_cli", "serve", str((tmp_path / "ck").resolve())]
    assert (f["--quantization"], f["--kv-cache-dtype"], f["--dtype"]) == ("compressed-tensors", "auto", "bfloat16")
    assert (f["--host"], f["--port"]) == ("127.0.0.1", "8000")
    assert "--enforce-eager" in f and "--kv-cache-memory-bytes" in f  # CPU engine settings, as in eval
    assert "--trust-remote-code" not in f


def test_scale_out_flags_pass_through_on_gpu(tmp_path: Path) -> None:
    extra = ["--tensor-parallel-size", "8", "--pipeline-parallel-size=2", "--distributed-executor-backend", "ray"]
    p = plan(tmp_path / "ck", manifest(), GPU, Endpoint("0.0.0.0", 9000), extra_args=extra)
    f = flags(p.command)
    assert (f["--tensor-parallel-size"], f["--pipeline-parallel-size"], f["--distributed-executor-backend"]) == ("8", "2", "ray")
    assert "--enforce-eager" not in f and "--kv-cache-memory-bytes" not in f
    assert p.url == "http://0.0.0.0:9000"


def test_two_cpu_workers_are_bound_a_core_share_each_and_a_pipeline_served_compiled(tmp_path: Path, monkeypatch) -> None:
    """As the eval engine runs them (engines/vllm.py: cpu_binding, engine_kwargs): on a one-node CPU each worker
    gets its share of the cores; a pipeline is served without --enforce-eager, tensor parallel keeps it."""
    from qserve.engines import vllm as engine

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(engine, "numa_nodes", lambda: 1)
    tp = plan(tmp_path / "ck", manifest(), CPU, Endpoint(), extra_args=["--tensor-parallel-size", "2"])
    pp = plan(tmp_path / "ck", manifest(), CPU, Endpoint(), extra_args=["--pipeline-parallel-size", "2"])
    one = plan(tmp_path / "ck", manifest(), CPU, Endpoint())
    assert tp.env["VLLM_CPU_OMP_THREADS_BIND"] == pp.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in one.env
    assert ("--enforce-eager" in flags(tp.command), "--enforce-eager" in flags(pp.command)) == (True, False)


def test_user_overrides_qserve_defaults_once(tmp_path: Path) -> None:
    p = plan(tmp_path / "ck", manifest(), CPU, Endpoint(), extra_args=["--max-model-len", "4096", "--served-model-name", "m"])
    assert p.command.count("--max-model-len") == 1 and flags(p.command)["--max-model-len"] == "4096"
    assert p.model_name == "m"


def test_agreeing_matched_flag_is_accepted_once(tmp_path: Path) -> None:
    p = plan(tmp_path / "ck", manifest(), CPU, Endpoint(), extra_args=["--dtype=bfloat16"])
    assert p.command.count("--dtype") == 1


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["--quantization", "awq"],
            "--quantization awq contradicts the checkpoint, which needs --quantization compressed-tensors",
        ),
        # Normalised as vLLM parses them: short forms, underscores, `=`, unambiguous abbreviations.
        (["-q", "fp8"], "--quantization fp8 contradicts the checkpoint, which needs --quantization compressed-tensors"),
        (["--kv_cache_dtype", "fp8"], "--kv-cache-dtype fp8 contradicts the checkpoint, which needs --kv-cache-dtype auto"),
        (["--kv-cache-dtype=fp8"], "--kv-cache-dtype fp8 contradicts the checkpoint, which needs --kv-cache-dtype auto"),
        (["--dtype", "float16"], "--dtype float16 contradicts the checkpoint, which needs --dtype bfloat16"),
        (["--dty", "float16"], "--dtype float16 contradicts the checkpoint, which needs --dtype bfloat16"),
        (["--dtype", "bfloat16", "--dtype", "auto"], "--dtype auto contradicts the checkpoint"),  # the last one wins
        # Off the allowlist: weights, tokenizer, numerics, adapters, code in the server, unguarded doors.
        (["--load-format", "dummy"], "--load-format cannot be passed to vLLM: qserve passes only options that leave"),
        (["--no-enforce-eager"], "--enforce-eager cannot be passed to vLLM: the engine would run differently"),
        (["--tokenizer", "/elsewhere"], "--tokenizer cannot be passed to vLLM: qserve passes only"),
        (["--trust-remote-code"], "--trust-remote-code cannot be passed to vLLM: qserve passes only"),
        (["--hf-overrides", '{"rope_theta": 1}'], "--hf-overrides cannot be passed to vLLM: qserve passes only"),
        (["--revision=main"], "--revision cannot be passed to vLLM: qserve passes only"),
        (["--middleware", "m.M"], "--middleware cannot be passed to vLLM: a middleware runs code of its own"),
        (["--tool-parser-plugin", "p.py"], "--tool-parser-plugin cannot be passed to vLLM: a plugin runs code"),
        (["--reasoning-parser-plugin", "p.py"], "--reasoning-parser-plugin cannot be passed to vLLM: a plugin runs code"),
        (["--io-processor-plugin", "p"], "--io-processor-plugin cannot be passed to vLLM: a plugin runs code"),
        (  # an allowed option's config object naming code to load, in either of vLLM's spellings
            ["--structured-outputs-config", '{"backend": "xgrammar", "reasoning_parser_plugin": "p.py"}'],
            "--structured-outputs-config with reasoning_parser_plugin cannot be passed to vLLM: a plugin runs code",
        ),
        (
            ["--structured-outputs-config.reasoning_parser_plugin", "p.py"],
            "--structured-outputs-config with reasoning_parser_plugin cannot be passed to vLLM: a plugin runs code",
        ),
        (["--grpc"], "--grpc cannot be passed to vLLM: vLLM's gRPC server does not check the API key"),
        (["--disable-sliding-window"], "--disable-sliding-window cannot be passed to vLLM: qserve passes only"),
        (["--logprobs-mode", "raw_logits"], "--logprobs-mode cannot be passed to vLLM: qserve passes only"),
        (["--enable-lora"], "--enable-lora cannot be passed to vLLM: LoRA adapters change what the model computes"),
        (["--lora-modules", "a=/x"], "--lora-modules cannot be passed to vLLM: LoRA adapters change what the model"),
        (["--chat-template", "t.jinja"], "--chat-template cannot be passed to vLLM: qserve passes only"),
        (["--trust-request-chat-template"], "--trust-request-chat-template cannot be passed to vLLM"),
        (["--port", "1"], "pass --port as qserve's own --port option"),
        (["--api_key", "k"], "pass --api-key as qserve's own --api-key (or QSERVE_API_KEY) option"),
        (["tensor-parallel-size"], "vLLM does not accept the options after `--`: unrecognized arguments: tensor-parallel-size"),
        (["--kv-cache-dt", "fp8"], "vLLM does not accept the options after `--`: ambiguous option: --kv-cache-dt could match"),
        (["--max-model-len", "many"], "vLLM does not accept the options after `--`: argument --max-model-len"),
    ],
)
def test_contradicting_or_misplaced_flags_are_refused(tmp_path: Path, extra: list[str], message: str) -> None:
    with pytest.raises(QserveError) as e:
        plan(tmp_path / "ck", manifest(), CPU, Endpoint(), extra_args=extra)
    assert str(e.value).startswith(message)


def test_capacity_and_placement_flags_pass_through(tmp_path: Path) -> None:
    extra = ["--max_model_len", "4096", "--max-num-seqs=8", "--tensor-parallel-size", "2", "--seed", "3"]
    p = plan(tmp_path / "ck", manifest(), CPU, Endpoint(), extra_args=extra)
    assert p.command[-len(extra) :] == extra  # as the user wrote them, after qserve's own
    assert "--max-model-len" not in p.command  # qserve's default gave way to the user's


@pytest.mark.parametrize("family", sorted(ALLOWED_USES))
def test_each_allowed_family_passes_through(tmp_path: Path, family: str) -> None:
    from qserve.engines.passthrough import PASS_THROUGH

    assert set(ALLOWED_USES) == set(PASS_THROUGH)  # every family has its use here
    p = plan(tmp_path / "ck", manifest(), CPU, Endpoint(), extra_args=ALLOWED_USES[family])
    assert p.command[-len(ALLOWED_USES[family]) :] == ALLOWED_USES[family]


def test_qserve_run_refuses_before_work_what_serve_would_refuse(tmp_path: Path) -> None:
    from qserve.engines.passthrough import ALLOWED
    from qserve.serve.plan import PLANNED_BY_QSERVE, _options, check_before_work

    # Every setting qserve plans itself is in the set the early check leaves to plan time.
    planned = {flag for flag, _ in _options(tmp_path, manifest(trust_remote_code=True), CPU, Endpoint("h", 1, "k"))[0]}
    assert {f.removeprefix("--").replace("-", "_") for f in planned} <= PLANNED_BY_QSERVE
    check_before_work([t for family in ALLOWED_USES.values() for t in family])  # all allowed at once
    check_before_work(["--dtype", "bfloat16", "--enforce-eager"])  # decided when the server is planned
    for bad, message in (["--grpc"], "--grpc cannot be passed"), (["--port", "1"], "pass --port as qserve's own"):
        with pytest.raises(QserveError) as e:
            check_before_work(bad)
        assert str(e.value).startswith(message)
    assert "grpc" not in ALLOWED and "enable_lora" not in ALLOWED


def test_only_allowed_environment_reaches_vllm() -> None:
    from qserve.engines.passthrough import served_environment

    env = served_environment(
        {
            "PATH": "/bin",
            "LC_ALL": "C",
            "OMP_NUM_THREADS": "2",
            "VLLM_LOGGING_LEVEL": "DEBUG",
            "VLLM_API_KEY": "inherited",
            "LD_PRELOAD": "/tmp/evil.so",
            "PYTHONSTARTUP": "x.py",
            "TORCH_LOGS": "+all",
        }
    )
    assert env == {"PATH": "/bin", "LC_ALL": "C", "OMP_NUM_THREADS": "2", "VLLM_LOGGING_LEVEL": "DEBUG"}
    for name in ("VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_ATTENTION_BACKEND"):
        with pytest.raises(QserveError) as e:
            served_environment({"PATH": "/bin", name: "1"})
        assert str(e.value).startswith(f"the environment sets {name}, which qserve does not pass to a served vLLM")


def test_api_key_stays_out_of_the_command_line(tmp_path: Path) -> None:
    p = plan(tmp_path / "ck", manifest(), CPU, Endpoint(api_key="s3cret"))
    assert "s3cret" not in " ".join(p.command) and p.env["VLLM_API_KEY"] == "s3cret"


def test_trust_remote_code_only_when_recorded(tmp_path: Path) -> None:
    p = plan(tmp_path / "ck", manifest(trust_remote_code=True), CPU, Endpoint())
    assert "--trust-remote-code" in p.command


def test_a_key_guards_every_route_through_qserves_middleware(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "inherited")
    p = plan(tmp_path / "ck", manifest(), CPU, Endpoint(api_key="s3cret"))
    assert flags(p.command)["--middleware"] == "qserve.serve.auth.KeyOnEveryRoute" and p.env["VLLM_API_KEY"] == "s3cret"
    open_plan = plan(tmp_path / "ck", manifest(), CPU, Endpoint())
    assert "VLLM_API_KEY" not in open_plan.env and "--middleware" not in open_plan.command  # never silently inherited


def _asgi(path: str, method: str = "POST", auth: str | None = None) -> tuple[int, bool]:
    """(status sent, whether the request reached the app) for one request through the middleware."""
    import asyncio

    from qserve.serve.auth import KeyOnEveryRoute

    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message):
        sent.append(message)

    headers = [(b"authorization", auth.encode())] if auth else []
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    asyncio.run(KeyOnEveryRoute(app)(scope, None, send))
    return sent[0]["status"], bool(reached)


@pytest.mark.parametrize(
    ("path", "method", "auth", "expected"),
    [
        ("/invocations", "POST", None, (401, False)),  # vLLM's own key check leaves this route open
        ("/generative_scoring", "POST", "Bearer wrong", (401, False)),
        ("/scale_elastic_ep", "POST", "Basic s3cret", (401, False)),
        ("/invocations", "POST", "Bearer s3cret", (200, True)),
        ("/v1/completions", "POST", "bearer s3cret", (200, True)),
        ("/health", "GET", None, (200, True)),
        ("/metrics", "GET", None, (200, True)),
        ("/health", "POST", None, (401, False)),
    ],
)
def test_key_middleware(monkeypatch, path: str, method: str, auth: str | None, expected: tuple[int, bool]) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    assert _asgi(path, method, auth) == expected


def test_non_loopback_without_a_key_is_warned_about(capsys) -> None:
    from qserve.serve.server import _warn_about_access

    _warn_about_access(Endpoint("0.0.0.0"))
    assert capsys.readouterr().err.startswith("warning: 0.0.0.0 is reachable from other machines and no API key is set")
    for host in ("127.0.0.1", "localhost", "::1"):
        _warn_about_access(Endpoint(host))
    _warn_about_access(Endpoint("0.0.0.0", api_key="k", key_source="QSERVE_API_KEY"))
    assert (
        capsys.readouterr().err
        == "requests need the API key from QSERVE_API_KEY on every route but /health, /ping, /version and /metrics\n"
    )


def test_cuda_engine_arguments_and_environment(tmp_path: Path, monkeypatch) -> None:
    """The GPU path, checked without a GPU: what qserve hands vllm.LLM and the environment it sets."""
    from qserve.engines import vllm as engine

    args = VllmArgs(quantization="compressed-tensors", kv_cache_dtype="fp8", dtype="bfloat16")
    kw = engine.engine_kwargs(tmp_path / "ck", args, GPU)
    assert kw == {
        "pretrained": str(tmp_path / "ck"),
        "dtype": "bfloat16",
        "quantization": "compressed-tensors",
        "kv_cache_dtype": "fp8",
        "trust_remote_code": False,
        "max_model_len": engine.MAX_MODEL_LEN,
        "seed": 0,
    }  # no CPU settings: CUDA graphs, vLLM's own KV-cache sizing and executor stay on
    # In-process engine core: apply_model (the KV-scale readout) is a direct call, so pickled
    # functions over vLLM's socket (VLLM_ALLOW_INSECURE_SERIALIZATION) are never needed.
    assert engine.engine_env(GPU) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert engine.engine_env(CPU) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        monkeypatch.delenv(key, raising=False)
    engine.configure_engine_env(GPU)
    import os

    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in os.environ and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ
    # The served engine is vLLM's API server on every device: its engine core is a process of its own.
    served = plan(tmp_path / "ck", manifest(kv_cache_dtype="fp8"), GPU, Endpoint())
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in served.env and "VLLM_ALLOW_INSECURE_SERIALIZATION" not in served.env
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in served.env  # vLLM's own choice on a GPU (spawn once CUDA is up)
    assert "--enforce-eager" not in served.command and "--kv-cache-memory-bytes" not in served.command
    # On CPU the served engine core keeps its worker in-process, as the eval engine does, and is forked.
    cpu_env = plan(tmp_path / "ck", manifest(), CPU, Endpoint()).env
    planned = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_WORKER_MULTIPROC_METHOD")
    assert {key: cpu_env[key] for key in planned} == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_WORKER_MULTIPROC_METHOD": "fork",
    }
    import qserve

    monkeypatch.setitem(qserve.STARTUP_ENVIRONMENT, "VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # a user's choice wins
    assert plan(tmp_path / "ck", manifest(), CPU, Endpoint()).env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    monkeypatch.delitem(qserve.STARTUP_ENVIRONMENT, "VLLM_WORKER_MULTIPROC_METHOD")
    # ... and a `qserve serve` started in that environment (as `qserve bench --suite` starts one) passes all of it on.
    from qserve.engines.passthrough import served_environment

    assert served_environment(cpu_env) == cpu_env


def test_qserve_run_refuses_before_work_a_scheme_serve_would_refuse_here(tmp_path: Path, monkeypatch) -> None:
    """On CPU flags without VNNI or AMX-INT8, INT8 W8A8 is not served (support/claims.py): `qserve run`
    says so in one line before it quantizes anything, instead of after quantizing and evaluating."""
    from qserve.device import detect

    monkeypatch.setattr(detect, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))
    r = run_qserve_in_process("run", REPO / "recipes" / "w8a8-int8.yaml", "--output", tmp_path / "out")
    claim = support.CPU_NEEDS_VNNI["W8A8"]
    expected = (
        f"error: W8A8 cannot be served on this machine ({claim.evidence}); it needs {claim.needs}. "
        "`qserve quantize` and `qserve eval` still run it"
    )
    assert (r.returncode, r.stderr.strip()) == (1, expected)
    assert not (tmp_path / "out").exists()
