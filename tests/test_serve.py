"""`qserve serve`: the real vLLM OpenAI server, answering the real `openai` client, behind the gate."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import (
    ALLOWED_USES,
    API_KEY,
    REPO,
    Server,
    assert_served_text_equals_the_eval_engines,
    copy_checkpoint,
    free_port,
    make_keys,
    needs_vllm,
    run_qserve,
)


@pytest.fixture(scope="module")
def starting_server(passed_eval, tmp_path_factory):
    """The gated checkpoint, signed after its gate, served only because the signature verifies."""
    private, public = make_keys(tmp_path_factory.mktemp("keys"), "owner")
    proc = run_qserve("sign", passed_eval[0], "--private-key", private)
    assert proc.returncode == 0, proc.stderr[-2000:]
    srv = Server(passed_eval[0], "--verify-key", str(public), wait=False)  # answering: the `server` fixture
    yield srv
    srv.close()


@pytest.fixture
def server(starting_server):
    """The module's server once it answers (the tests that run while it starts take `starting_server`)."""
    starting_server.wait()
    return starting_server


@pytest.mark.slow
def test_serve_refuses_a_signature_by_another_key(starting_server, tmp_path: Path) -> None:
    _, stranger = make_keys(tmp_path, "stranger")
    proc = run_qserve("serve", starting_server.ckpt, "--port", str(free_port()), "--verify-key", stranger)
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: signature check of {starting_server.ckpt} against {stranger} failed: Key mismatch")
    )


@pytest.mark.slow
def test_served_text_equals_the_eval_engines(starting_server) -> None:
    """The serve matrix's check (test_serve_matrix.py) for INT8 W8A8, the demo's scheme, on this server (its
    eval engine answers while vLLM's server starts)."""
    assert_served_text_equals_the_eval_engines(starting_server)


@pytest.mark.slow
def test_serve_prints_endpoint_and_curl(server) -> None:
    assert server.ready_line == f"serving {server.ckpt.name} at {server.base_url}\n"
    assert server.curl_line.startswith(f"curl {server.base_url}/chat/completions")
    assert "Authorization: Bearer $QSERVE_API_KEY" in server.curl_line and API_KEY not in server.curl_line


@pytest.mark.slow
def test_serve_answers_chat_completions(server) -> None:
    """The chat route answers with the model, to the token budget asked. What it answers is the eval
    engine's own greedy text (test_served_text_equals_the_eval_engines, which also checks "Paris"
    in the completion or the chat): which words a 135M INT8 model's 16-token chat reply holds depends
    on the CPU's int8 kernels, and so does where it ends (an AMD EPYC's kernels end it after 8 tokens),
    so the end-of-text token is ignored (vLLM's ignore_eos) and the budget is what ends it."""
    reply = server.client().chat.completions.create(
        model=server.ckpt.name,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert (reply.usage.completion_tokens, reply.choices[0].finish_reason) == (16, "length")
    assert reply.choices[0].message.content.strip()


@pytest.mark.slow
def test_serve_refuses_requests_without_the_key(server) -> None:
    import openai

    for key in ("", "wrong-key"):
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key=key or "none").models.list()


def _one_request(client, model: str, kind: str) -> str:
    prompt = "Question: What is 2 + 3?\nAnswer:"
    messages = [{"role": "user", "content": "Name a colour."}]
    common = {"model": model, "max_tokens": 12, "temperature": 0}
    if kind == "chat":
        return client.chat.completions.create(messages=messages, **common).choices[0].message.content
    if kind == "chat-stream":
        chunks = client.chat.completions.create(messages=messages, stream=True, **common)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if kind == "completion":
        return client.completions.create(prompt=prompt, **common).choices[0].text
    chunks = client.completions.create(prompt=prompt, stream=True, **common)
    return "".join(c.choices[0].text for c in chunks if c.choices)


@pytest.mark.slow
def test_serve_survives_a_concurrent_burst(server) -> None:
    """A bounded burst on loopback: 32 requests, 8 at a time, chat and completions, streaming or not."""
    from concurrent.futures import ThreadPoolExecutor

    kinds = ["chat", "chat-stream", "completion", "completion-stream"] * 8
    client = server.client()
    with ThreadPoolExecutor(max_workers=8) as pool:
        texts = list(pool.map(lambda k: _one_request(client, server.ckpt.name, k), kinds))
    assert len(texts) == 32 and all(t.strip() for t in texts)


@pytest.mark.slow
def test_every_route_that_runs_the_model_needs_the_key(server) -> None:
    """vLLM's own key check covers /v1 and a few prefixes; qserve's middleware closes /invocations and the rest."""
    import requests

    root = server.base_url.removesuffix("/v1")
    body = {"model": server.ckpt.name, "prompt": "Hello", "max_tokens": 2}
    for path in ("/invocations", "/generative_scoring", "/scale_elastic_ep", "/v1/completions"):
        assert requests.post(root + path, json=body, timeout=60).status_code == 401, path
    ok = requests.post(root + "/invocations", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
    assert requests.get(root + "/health", timeout=10).status_code == 200  # probes stay open


@pytest.mark.slow
@needs_vllm("w4a16-gptq", serve=True)  # else serve refuses the scheme first
def test_serve_refuses_ungated_checkpoint(checkpoints, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(checkpoints["w4a16-gptq"], tmp_path / "ckpt")
    (ckpt / "qserve_eval.json").unlink(missing_ok=True)
    proc = run_qserve("serve", ckpt, "--port", str(free_port()))
    assert proc.returncode == 1
    assert (
        proc.stderr.strip().splitlines()[-1]
        == f"error: {ckpt} has no accuracy gate result; run `qserve eval {ckpt}` first (or pass --skip-gate)"
    )


def _serve_edited(src: Path, tmp_path: Path, name: str, old: str, new: str) -> tuple[Path, subprocess.CompletedProcess]:
    """Copy a gated checkpoint, replace text in one of its files, and try to serve it."""
    ckpt = copy_checkpoint(src, tmp_path / "ckpt")
    path = ckpt / name
    path.write_text(path.read_text().replace(old, new))
    return ckpt, run_qserve("serve", ckpt, "--port", str(free_port()))


@pytest.mark.slow
def test_serve_refuses_failed_or_stale_gate(passed_eval, tmp_path: Path) -> None:
    _, proc = _serve_edited(passed_eval[0], tmp_path, "qserve_eval.json", '"verdict": "pass"', '"verdict": "fail"')
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
def test_serve_refuses_occupied_port_and_run_refuses_it_before_any_work(passed_eval, tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_qserve("serve", passed_eval[0], "--port", str(port))
        run = run_qserve("run", REPO / "recipes" / "w8a8-int8.yaml", "--output", tmp_path / "out", "--port", str(port))
    message = f"error: cannot listen on 127.0.0.1:{port}: Address already in use; pick another --port"
    assert (proc.returncode, proc.stderr.strip().splitlines()[-1]) == (1, message)
    assert (run.returncode, run.stderr.strip().splitlines()) == (1, [message])  # not after minutes of quantizing
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_serve_refuses_tampered_manifest(passed_eval, tmp_path: Path) -> None:
    ckpt, proc = _serve_edited(
        passed_eval[0], tmp_path, "qserve_manifest.json", '"kv_cache_dtype": "auto"', '"kv_cache_dtype": "fp8"'
    )
    manifest = ckpt / "qserve_manifest.json"
    assert proc.returncode == 1
    assert "the gate result in" in proc.stderr and "was decided for different checkpoint contents" in proc.stderr
    manifest.write_text("{not json")
    proc = run_qserve("serve", ckpt, "--port", str(free_port()))
    assert proc.returncode == 1 and "qserve_manifest.json is corrupt or was edited by hand" in proc.stderr
    manifest.unlink()
    proc = run_qserve("serve", ckpt, "--port", str(free_port()))
    assert proc.returncode == 1 and "has no qserve_manifest.json: not a qserve checkpoint" in proc.stderr


@pytest.mark.slow
def test_serve_refuses_contradicting_pass_through(passed_eval) -> None:
    proc = run_qserve("serve", passed_eval[0], "--port", str(free_port()), "--", "--kv-cache-dtype", "fp8")
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("error: --kv-cache-dtype fp8 contradicts the checkpoint, which needs --kv-cache-dtype auto")
    )


@pytest.mark.slow
def test_serve_refuses_a_gate_looser_than_the_recipe(passed_eval, tmp_path: Path) -> None:
    """The issue's case: a record that passed at max_increase 1 (+100 %) while the recipe declares 0.95."""
    ckpt = copy_checkpoint(passed_eval[0], tmp_path / "ckpt")
    record = json.loads((ckpt / "qserve_eval.json").read_text())
    (gate,) = [g for g in record["gates"] if g["task"] == "gsm8k_ppl"]
    gate["criteria"] = {"max_increase": 1.0}  # what `--gate gsm8k_ppl:max_increase=1` records
    (ckpt / "qserve_eval.json").write_text(json.dumps(record))
    proc = run_qserve("serve", ckpt, "--port", str(free_port()))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: the gate record does not meet the policy of recipe w8a8-int8: gsm8k_ppl word_perplexity,none was gated at "
        "{'max_increase': 1.0}, looser than the policy's {'min_recovery': 0.95} (re-run `qserve eval` with the policy's gates "
        "and --limit, or pass --accept-gate-difference)"
    )


@pytest.fixture(scope="module")
def production_server(passed_eval, tmp_path_factory):
    """One server as production runs it, shared by the tests below (one vLLM start, not three): an
    option of each allowed family (TLS with a real certificate), started from a copy of the gated
    checkpoint whose weights are replaced by garbage as soon as every check has passed."""
    import time

    work = tmp_path_factory.mktemp("production")
    key, cert = work / "key.pem", work / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            key,
            "-out",
            cert,
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    # Each family's use from the plan tests, but TLS with a real certificate and one CPU process.
    families = ALLOWED_USES | {
        "TLS": ["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)],
        "parallelism and placement": ["--tensor-parallel-size", "1", "--distributed-timeout-seconds", "600"],
    }
    ckpt = copy_checkpoint(passed_eval[0], work / "ckpt")
    srv = Server(ckpt, "--", *[t for tokens in families.values() for t in tokens], wait=False)
    srv.families, srv.cert = families, cert
    deadline = time.monotonic() + 300
    while "> starting vLLM server" not in srv.steps():  # printed once the private copy passed the checks
        assert srv.proc.poll() is None and time.monotonic() < deadline, srv.steps()[-3000:]
        time.sleep(0.1)
    garbage = ckpt / "model.safetensors.new"
    garbage.write_bytes(b"not a safetensors file")
    os.replace(garbage, ckpt / "model.safetensors")  # as an attacker would: one atomic rename
    srv.wait()
    assert srv.ready_line, srv.steps()[-3000:]
    yield srv
    srv.close()


@pytest.mark.slow
def test_a_weight_file_replaced_during_start_up_never_reaches_vllm(production_server) -> None:
    """vLLM loads the private copy qserve checked, so the garbage swapped in during start-up is not
    what it loads: it starts and answers. The next serve checks the checkpoint again and refuses it."""
    assert production_server.ready_line.startswith("serving chat at https://127.0.0.1:"), production_server.ready_line
    proc = run_qserve("serve", production_server.ckpt, "--port", str(free_port()))
    assert proc.returncode == 1 and "does not match its manifest (changed model.safetensors)" in proc.stderr


@pytest.mark.slow
def test_every_allowed_family_works_on_a_real_server(production_server) -> None:
    """TLS, CORS, tool calling, a reasoning parser, structured output, prefix caching, chunked
    prefill, limits, served model name and logging, all passed at once; a request uses each."""
    import httpx
    from openai import OpenAI

    from qserve.engines.passthrough import PASS_THROUGH

    srv, cert = production_server, str(production_server.cert)
    assert set(srv.families) == set(PASS_THROUGH)
    base = f"https://127.0.0.1:{srv.port}"
    client = OpenAI(base_url=f"{base}/v1", api_key=API_KEY, http_client=httpx.Client(verify=cert), max_retries=0)
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    tool = {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    }
    answer = client.chat.completions.create(model="chat", messages=chat, tools=[tool], tool_choice="auto", max_tokens=16)
    assert answer.choices[0].message.role == "assistant"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    shaped = client.chat.completions.create(model="chat", messages=chat, response_format=fmt, max_tokens=24, temperature=0)
    assert (shaped.choices[0].message.content or "").lstrip().startswith("{")  # constrained to the schema's object
    preflight = httpx.options(
        f"{base}/v1/chat/completions",
        verify=cert,
        headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.headers.get("access-control-allow-origin") == "https://app.example"
    with pytest.raises(httpx.TransportError):  # no HTTP answer without TLS
        httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=5)


@pytest.mark.slow
def test_sigkill_of_a_ready_server_leaves_no_process_and_frees_the_port(production_server) -> None:
    """`kill -9` of qserve: no handler runs, yet the group's guard ends vLLM's whole process group
    (last in this module: it ends the shared server)."""
    import time

    from qserve.runtime.process import GRACE_SECONDS, group_members
    from qserve.serve.server import ensure_port_free

    proc = production_server.proc
    children = [int(c) for c in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    (server,) = [c for c in children if b"qserve.engines.vllm_cli" in Path(f"/proc/{c}/cmdline").read_bytes()]
    roles = sorted(_role(Path(f"/proc/{pid}/cmdline").read_bytes()) for pid in group_members(server))
    # The worker runs inside the engine core, forked from the API server: a spawned one would come with
    # Python's resource tracker beside it (and import vLLM again).
    assert roles == ["API server", "engine core"], roles
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + GRACE_SECONDS + 10
    while group_members(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group_members(server) == []
    ensure_port_free("127.0.0.1", production_server.port)  # a new `qserve serve --port` may listen there


def _role(cmdline: bytes) -> str:
    """What a process of the served group is, from its command line: vLLM's API server, its engine core,
    or the resource tracker Python's spawn start method runs beside them."""
    for marker, role in (
        (b"qserve.engines.vllm_cli", "API server"),
        (b"VLLM::EngineCore", "engine core"),  # the title vLLM gives the engine core's process
        (b"multiprocessing.resource_tracker", "resource tracker"),
    ):
        if marker in cmdline:
            return role
    return cmdline.replace(b"\0", b" ").decode(errors="replace")
