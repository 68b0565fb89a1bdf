"""Tensor and pipeline parallelism run, here on two CPU processes: vLLM's CPU backend runs each rank as a
worker process of its `mp` executor; qserve binds one core to each (vLLM's own binding gives each worker a
NUMA node, and this machine has one). A tiny random-initialised Llama whose 4 heads split in two, FP8
(data-free, seconds to quantize). Data parallelism: vLLM's own (two engine cores) serves here; lm-eval's
(`qserve eval -dp`, Ray tasks that each reserve a GPU) cannot run on a CPU host and is refused there
(tests/test_eval.py).

The check is that every layout decides as one process does: the same gate and verdict on the same items,
the baseline's scores the same; with tensor parallel the quantized model's scores too. Pipeline parallel
schedules its stages' batches otherwise, and on this random model a seeded item can be a near-tie that it
answers otherwise; and that a server with two workers answers, with the text the one-process engine generates.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import REPO, Server, copy_checkpoint, copy_tokenizer, llama_config, quantize_in_process, run_qserve_in_process

pytestmark = [
    pytest.mark.matrix,  # make test-matrix (CI runs it after make test): minutes of engine starts
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two workers need two cores"),
]

LAYOUTS = {"one process": [], "-tp 2": ["-tp", "2"], "-pp 2": ["-pp", "2"]}
# What each layout gives exactly as one process does (the module's docstring says why pipeline parallel is less)
SAME = ("task", "metric", "items", "baseline", "status")
SAME_SCORES = {"-tp 2": SAME + ("quantized", "flips"), "-pp 2": SAME}


@pytest.fixture(scope="module")
def split_checkpoint(tmp_path_factory, embedded_model_dir: Path) -> Path:
    """A Llama of 2 layers, 256 wide, 4 heads of 64 (2 KV heads): vLLM-CPU's attention takes head size 64,
    and both the heads and the layers split in two; FP8 dynamic. Weights drawn 25 times wider than
    transformers' default (sd 0.5, not 0.02): a default random model's answers are near-ties, which any
    other order of the same sums flips (measured: 1 item of 12 with tensor parallel, 1 with pipeline)."""
    import torch
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("parallel")
    model = root / "tiny-llama-4-heads"
    torch.manual_seed(0)
    config = llama_config(256, 512, 2, heads=4, kv_heads=2, max_position_embeddings=2048, initializer_range=0.5)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(model)
    copy_tokenizer(embedded_model_dir, model)
    recipe = root / "fp8.yaml"
    recipe.write_text((REPO / "recipes" / "fp8.yaml").read_text().replace("gates:", f"model: {model}\ngates:"))
    return quantize_in_process(recipe, root / "ckpt")


@pytest.fixture(scope="module")
def decided(split_checkpoint: Path, tmp_path_factory) -> dict[str, tuple[int, dict]]:
    out = {}
    for name, flags in LAYOUTS.items():
        # a separate copy per layout: each writes its own record (and the baseline's cache key holds the layout)
        ckpt = copy_checkpoint(split_checkpoint, tmp_path_factory.mktemp("layout") / "ckpt")
        proc = run_qserve_in_process("eval", ckpt, *flags, "--tasks", "gsm8k_mc", "--limit", "12", "--no-parity", "--json")
        assert proc.stdout, proc.stderr[-3000:]
        out[name] = (proc.returncode, json.loads(proc.stdout))
    return out


@pytest.mark.parametrize("layout", ["-tp 2", "-pp 2"])
def test_a_parallel_eval_decides_as_one_process_does(decided, layout: str) -> None:
    (code_one, one), (code, record) = decided["one process"], decided[layout]
    parallel = {"-tp 2": {"tensor_parallel_size": 2}, "-pp 2": {"pipeline_parallel_size": 2}}[layout]
    assert dict(record["device"]["parallel"]) == parallel and not one["device"]["parallel"]
    keep = SAME_SCORES[layout]
    assert [{k: g[k] for k in keep} for g in record["gates"]] == [{k: g[k] for k in keep} for g in one["gates"]]
    assert (code, record["verdict"]) == (code_one, one["verdict"])
    assert record["gates"][0]["items"] == 12
    assert record["kv_cache"]["status"] == "skipped"  # the readout ran across the workers: FP8 weights, KV auto


def test_a_server_with_two_tensor_parallel_workers_answers_as_the_eval_engine_with_that_layout(
    split_checkpoint: Path, monkeypatch
) -> None:
    """The served greedy text equals what qserve's eval engine with the same two workers generates (the same
    kernels and the same order of the all-reduce's sums). Not the one-process engine's: on this random model
    the two agreed on the first 4 of 8 tokens, then a near-tie went the other way."""
    from vllm import SamplingParams

    from qserve.checkpoint.manifest import read_manifest
    from qserve.device import detect
    from qserve.engines import vllm as engine

    device = detect.detect_device().with_parallel({"tensor_parallel_size": 2})
    for key, value in engine.engine_env(device).items():
        monkeypatch.setenv(key, value)  # the engine's worker binding, undone after this test
    prompt, params = "The capital of France is", SamplingParams(temperature=0.0, max_tokens=8)
    with engine.open_engine(split_checkpoint, read_manifest(split_checkpoint).vllm_args, device, "two workers") as lm:
        expected = lm.model.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    server = Server(split_checkpoint, "--skip-gate", "--", "--tensor-parallel-size", "2")
    try:
        assert server.ready_line.startswith(f"serving {split_checkpoint.name} at "), server.steps()[-3000:]
        reply = server.client().completions.create(model=split_checkpoint.name, prompt=prompt, temperature=0, max_tokens=8)
        assert reply.choices[0].text == expected
    finally:
        server.close()


def test_a_server_with_two_data_parallel_replicas_answers_as_one_process_does(split_checkpoint: Path) -> None:
    """`qserve serve CKPT -- --data-parallel-size 2`: vLLM's own data parallelism, two engine cores each holding
    the whole model, answers concurrent requests with the one-process engine's greedy text (each replica runs
    the one-process model; no sum is split across processes)."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm import SamplingParams

    from qserve.checkpoint.manifest import read_manifest
    from qserve.device import detect
    from qserve.engines import vllm as engine

    prompts = ["The capital of France is", "Water boils at", "Once upon a time,", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with engine.open_engine(split_checkpoint, read_manifest(split_checkpoint).vllm_args, detect.detect_device(), "one") as lm:
        expected = [o.outputs[0].text for o in lm.model.generate(prompts, params, use_tqdm=False)]
    server = Server(split_checkpoint, "--skip-gate", "--", "--data-parallel-size", "2")
    try:
        assert server.ready_line.startswith(f"serving {split_checkpoint.name} at "), server.steps()[-3000:]
        client = server.client()

        def ask(prompt: str):
            return client.completions.create(model=split_checkpoint.name, prompt=prompt, temperature=0, max_tokens=8)

        with ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(ask, prompts))
        assert [r.choices[0].text for r in replies] == expected
        assert all("-dp2-" in r.system_fingerprint for r in replies)  # vLLM names its data-parallel size
        log = (split_checkpoint / "logs" / "serve.log").read_text()
        assert "EngineCore_DP0" in log and "EngineCore_DP1" in log
    finally:
        server.close()
