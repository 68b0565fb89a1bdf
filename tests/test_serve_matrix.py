"""Serve runs what eval gated: every scheme the matrix marks servable, through the real `qserve serve`
(INT8 W8A8 on test_serve.py's server).

The gate is decided on the in-process engine (`qserve eval`); users get vLLM's API server, whose
engine core (holding the worker, as the eval engine does) runs in a process of its own. For each servable scheme the server must
answer a chat request at temperature 0, and its greedy text must equal the eval engine's for the
same prompt and the same chat: same kernels, same dtype, one request at a time, so the same tokens.
"""

from __future__ import annotations

import pytest
from conftest import FP8_PARITY, PROMPT, Server, assert_served_text_equals_the_eval_engines, matrix_cells, needs_vllm

from qserve.checkpoint.manifest import read_manifest
from qserve.device import detect
from qserve.engines import vllm as engine
from qserve.evaluate import parity
from qserve.schemes.catalog import SCHEMES
from qserve.support import claims as support

# recipe -> the matrix entry it proves in the serve column
SERVABLE = {
    "fp8": ("compressed-tensors", "FP8_DYNAMIC"),
    "w8a8-int8": ("compressed-tensors", "W8A8"),
    "smollm2-tuned": ("compressed-tensors", "W8A8+W4A16"),  # qserve tune's per-layer mix
    "quark-w4a16": ("quark", "W4A16"),
    # W4A16 weights (GPTQ's and AWQ's runs write the same format) with the FP8 KV cache on top
    # (support.CPU_KV_CACHE): one server start proves both entries.
    "w4a16-fp8kv": ("compressed-tensors", "W4A16"),
}
# FP8_DYNAMIC runs at ~5 s per prompt token and ~30 s per generated token on a CPU without AMX-FP8
# (conftest.FP8_RECIPES): it has a test of its own below, with a 1-token completion and no chat.
# INT8 W8A8 is the demo's checkpoint: test_serve.py checks it on the server it already runs.
# So `make test` checks the served text of both activation kinds (INT8 there, FP8 below); the other
# servable schemes repeat that check per recipe and run as `matrix` cells (`make test-matrix`; CI runs
# both), as test_support.py's per-recipe cells do.
GENERIC = sorted(set(SERVABLE) - {"fp8", "w8a8-int8"})


def start_server(checkpoints, name: str) -> Server:
    """`qserve serve` of the recipe's checkpoint, not yet waited for: vLLM's server (mostly single-core
    imports) starts while the test's eval engine answers. Nothing more overlaps: quantizing the next
    checkpoint during a start (two torch jobs on two cores) made this module slower, 226.8 s against
    199.8 s without (2026-11-25, the module alone)."""
    return Server(checkpoints[name], "--skip-gate", wait=False)


def test_serve_column_is_exactly_what_this_module_proves() -> None:
    served = {key for key, s in support.CPU.items() if s.serves}
    assert served == set(SERVABLE.values())
    assert support.CPU_KV_CACHE.serves
    assert all(support.CPU[key].runs for key in served)  # nothing is served that eval cannot gate


@pytest.mark.slow
@pytest.mark.parametrize("name", matrix_cells(GENERIC, serve=True))
def test_served_text_equals_the_eval_engines(checkpoints, name: str) -> None:
    server = start_server(checkpoints, name)
    try:
        assert_served_text_equals_the_eval_engines(server)
    finally:
        server.close()


@pytest.mark.slow
@pytest.mark.matrix  # emulated FP8 generates at seconds a token on a CPU: minutes of make test's budget
@needs_vllm("fp8", serve=True)
def test_fp8_served_token_equals_the_eval_engines_which_matches_transformers(checkpoints) -> None:
    """FP8_DYNAMIC, at ~30 s a token here, in one engine run for both checks: the eval engine's
    greedy tokens match transformers' emulation (parity, as test_engine does for the other schemes)
    and the server's first token is the eval engine's."""
    server = start_server(checkpoints, "fp8")
    ckpt = server.ckpt
    manifest = read_manifest(ckpt)
    try:
        with engine.open_engine(ckpt, manifest.vllm_args, detect.detect_device(), ckpt.name) as lm:
            config = lm.model.llm_engine.model_config
            assert (config.quantization, str(config.dtype)) == ("compressed-tensors", f"torch.{manifest.vllm_args.dtype}")
            generations = parity.vllm_generations(lm, [PROMPT], FP8_PARITY["max_tokens"])
            first = lm.model.get_tokenizer().decode(generations[0].token_ids[:1])
        server.wait()
        assert server.ready_line == f"serving {ckpt.name} at {server.base_url}\n"
        common = {"model": ckpt.name, "temperature": 0, "max_tokens": 1}
        served = server.client(timeout=900).completions.create(prompt=PROMPT, **common).choices[0].text
    finally:
        server.close()
    assert served == first == " Paris"
    tolerance = parity.tolerance_for(SCHEMES[manifest.scheme].activations)
    result = parity.compare_with_transformers(ckpt, generations, tolerance)
    assert result["status"] == "pass", result
    assert tolerance.max_mean_abs_logprob_diff == parity.TOLERANCES["activation"].max_mean_abs_logprob_diff
