"""Beyond one machine's memory and one process: model-free quantization of a model larger than the
memory limit, and data-parallel calibration under torchrun (gloo on this CPU machine)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import QSERVE, REPO, copy_tokenizer, llama_config, needs_vllm, quantize_in_process, run_qserve

from qserve.checkpoint.manifest import read_manifest
from qserve.device.detect import native_bfloat16
from qserve.errors import QserveError, is_out_of_memory
from qserve.quantize import distributed, execution
from qserve.spec.recipe import parse_recipe

# --- the torchrun command line and the refusals (no library runs) ---


def test_torchrun_command_single_node() -> None:
    cmd = distributed.torchrun_command(Path("/s/job.json"), 8)
    assert cmd == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "8",
        "--standalone",
        "-m",
        "qserve.quantize.distributed",
        "/s/job.json",
    ]


def test_torchrun_command_for_each_node() -> None:
    cmd = distributed.torchrun_command(Path("/s/job.json"), 8, nnodes=2, node_rank=1, rdzv_endpoint="node0:29500")
    assert cmd[3:] == [
        "--nproc-per-node",
        "8",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "node0:29500",
        "-m",
        "qserve.quantize.distributed",
        "/s/job.json",
    ]
    with pytest.raises(QserveError, match=r"^--nnodes above 1 needs --rdzv-endpoint HOST:PORT"):
        distributed.torchrun_command(Path("/s/job.json"), 8, nnodes=2)


def test_calibration_across_machines_is_refused_where_ranks_would_miss_their_devices() -> None:
    # llm-compressor 0.14's get_main_device indexes the accelerator by the global rank: refused on GPUs
    # (one line, before any work), allowed on CPU machines such as this one, where every rank uses the CPU.
    with pytest.raises(QserveError) as e:
        distributed.check_nodes(2, "cuda")
    assert str(e.value) == (
        "--nnodes 2 on cuda: llm-compressor puts rank R on cuda:R (the global rank), so the ranks of every "
        "node after the first ask for devices they do not have; calibrate on one node (--nproc up to its device count)"
    )
    distributed.check_nodes(1, "cuda")
    assert distributed.current_accelerator() is None
    distributed.check_nodes(2, distributed.current_accelerator())


def test_samples_are_split_contiguously_and_completely() -> None:
    assert distributed.samples_per_rank(32, 2) == [16, 16]
    assert distributed.samples_per_rank(10, 4) == [2, 3, 2, 3]
    bounds = [distributed.share_bounds(10, r, 4) for r in range(4)]
    assert bounds == [(0, 2), (2, 5), (5, 7), (7, 10)]


def test_model_free_refused_for_a_calibrated_recipe() -> None:
    text = "name: x\nscheme: W4A16\nalgorithm: gptq\nexecution: model_free\ncalibration: {source: gsm8k-train}\n"
    with pytest.raises(QserveError) as err:
        parse_recipe(text, "r.yaml")
    assert str(err.value) == (
        "r.yaml:1: recipe: execution model_free quantizes weights shard by shard without data; "
        "drop calibration, kv_cache and smoothquant (they need data), or use execution in_memory"
    )


def test_failed_allocations_are_recognised_as_out_of_memory() -> None:
    """quantize turns these into its one-line out-of-memory advice; other library errors keep their own."""
    import errno

    import torch

    with pytest.raises(RuntimeError) as torch_oom:
        torch.empty(2**50, dtype=torch.uint8)  # torch's CPU allocator, for real
    assert is_out_of_memory(torch_oom.value) and is_out_of_memory(MemoryError())
    assert is_out_of_memory(OSError(errno.ENOMEM, os.strerror(errno.ENOMEM)))
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(OSError(errno.ENOSPC, "full"))


def test_auto_keeps_a_model_that_fits_in_memory(embedded_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qserve.device import detect

    recipe = parse_recipe("name: x\nscheme: FP8_DYNAMIC\n")
    monkeypatch.setattr(detect, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    run = execution.choose(recipe, embedded_model_dir)
    # The bfloat16 conversion: 269 MB, 0.25 GiB.
    assert run.path == "in_memory" and run.reason.startswith("auto: fits (0.3 GiB of weights, ")
    # Without a bfloat16 kernel a calibrated recipe runs in float32: twice the bytes in memory.
    monkeypatch.setattr(detect, "cpu_flags", lambda: frozenset({"avx2"}))
    assert execution.choose(recipe, embedded_model_dir).reason.startswith("auto: fits (0.3 GiB of weights, ")  # data-free
    calibrated = parse_recipe("name: x\nscheme: W8A8\ncalibration: {source: gsm8k-train, samples: 4}\n")
    reason = execution.choose(calibrated, embedded_model_dir).reason
    assert reason.startswith("auto: fits (0.3 GiB of weights (0.5 GiB in float32 to calibrate), ")


@pytest.mark.parametrize(
    ("flags", "model_dtype", "calibrated_in"),
    [
        ({"avx2"}, "bfloat16", "float32"),  # e.g. AMD EPYC Milan: no bfloat16 matmul kernel
        ({"avx2", "avx512f"}, "bfloat16", "float32"),  # AVX-512 without its BF16 extension
        ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16", "bfloat16"),
        ({"avx2", "amx_tile", "amx_bf16"}, "bfloat16", "bfloat16"),
        ({"avx2"}, "float16", "float16"),  # not measured: left as it is
        ({"avx2"}, "float32", "float32"),
    ],
)
def test_bfloat16_calibrates_in_float32_only_without_a_bfloat16_kernel(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], model_dtype: str, calibrated_in: str
) -> None:
    from qserve.device import detect

    monkeypatch.setattr(detect, "cpu_flags", lambda: frozenset(flags))
    assert execution.calibration_dtype(model_dtype) == calibrated_in


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        ("fp8.yaml", "error: --nproc splits the calibration data between processes, and recipe fp8 is data-free"),
        ("quark-fp8-kv.yaml", "error: --nproc runs llm-compressor's data-parallel calibration; it needs backend: llmcompressor"),
    ],
)
def test_nproc_refusals(tmp_path: Path, recipe: str, message: str) -> None:
    # Known from the recipe alone: refused before the model is looked for (this one does not exist).
    args = ("--nproc", "2", "--model", tmp_path / "no-model", "--output", tmp_path / "out")
    proc = run_qserve("quantize", REPO / "recipes" / recipe, *args, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == message
    assert not (tmp_path / "out").exists()


# --- larger than memory, data-free ---

# The quantize process runs in a memory cgroup of its own with this limit (resident memory, not
# address space: torch and llm-compressor alone reserve 2.4 GB of address space, measured here).
LIMIT_BYTES = 2 << 30


@contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A fresh memory cgroup (v1 here; v2 where mounted unified) limited to `limit` bytes."""
    name = f"qserve-test-{os.getpid()}"
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").is_file()
    group = Path("/sys/fs/cgroup") / name if v2 else Path("/sys/fs/cgroup/memory") / name
    group.mkdir()
    try:
        (group / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit))
        yield group
    finally:
        group.rmdir()


def _write_synthetic_llama(directory: Path, tokenizer_dir: Path, hidden: int, intermediate: int, layers: int) -> int:
    """A random-initialised Llama-architecture model (seed 0) in bf16, four decoder layers a shard,
    written shard by shard so the test itself never holds it; returns its weight bytes."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir()
    config = llama_config(
        hidden, intermediate, layers, heads=16, kv_heads=4, max_position_embeddings=2048, tie_word_embeddings=False
    )
    config.save_pretrained(directory)
    copy_tokenizer(tokenizer_dir, directory)
    gen = torch.Generator().manual_seed(0)
    h, f = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * h // config.num_attention_heads
    per_layer = {
        "self_attn.q_proj.weight": (h, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, h),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }
    groups = [{"model.embed_tokens.weight": (config.vocab_size, h)}]
    for start in range(0, layers, 4):
        group = {}
        for i in range(start, min(start + 4, layers)):
            group |= {f"model.layers.{i}.{k}": s for k, s in per_layer.items()}
            group |= {f"model.layers.{i}.input_layernorm.weight": (h,), f"model.layers.{i}.post_attention_layernorm.weight": (h,)}
        groups.append(group)
    groups[-1] |= {"model.norm.weight": (h,), "lm_head.weight": (config.vocab_size, h)}
    weight_map, total = {}, 0
    for n, group in enumerate(groups, start=1):
        shard = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        tensors = {
            k: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
            for k, s in group.items()
        }
        save_file(tensors, directory / shard, metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map |= dict.fromkeys(group, shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


@pytest.fixture(scope="module")
def large_model(tmp_path_factory, embedded_model_dir: Path) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("large") / "llama-synthetic"
    # 20 layers, hidden 2048: 2.6 GiB in 6 shards
    return path, _write_synthetic_llama(path, embedded_model_dir, 2048, 8192, 20)


def _quantize_in(group: Path, recipe: Path, model: Path, out: Path) -> subprocess.CompletedProcess:
    """`qserve quantize` as a process that joins `group` before it starts."""
    qserve = shlex.join([*QSERVE, "quantize", str(recipe), "--model", str(model), "--output", str(out)])
    script = f"echo $$ > {group}/cgroup.procs && exec {qserve}"
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=1200, cwd=REPO)


@pytest.mark.matrix  # make test-matrix (CI runs it after make test): keeps make test within 30 minutes
@pytest.mark.slow
@needs_vllm("w4a16-gptq")  # each ends by running its W4A16 checkpoint in vLLM
def test_a_model_larger_than_the_memory_limit_is_quantized_shard_by_shard(large_model, tmp_path: Path) -> None:
    model, weights = large_model
    assert weights > LIMIT_BYTES * 1.25  # 2.6 GiB of weights against a 2 GiB limit
    recipe = tmp_path / "w4a16-rtn.yaml"
    recipe.write_text("name: w4a16-rtn\nscheme: W4A16\ngroup_size: 128\n")  # execution: auto
    with memory_cgroup(LIMIT_BYTES) as group:
        proc = _quantize_in(group, recipe, model, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sizes = f"{weights / 2**30:.1f} GiB of weights, 2.0 GiB of memory available"
    assert f"execution: model_free (auto: too large to load ({sizes}); shard by shard)" in proc.stderr
    manifest = read_manifest(tmp_path / "out")
    assert manifest.execution["path"] == "model_free" and manifest.execution["shards"] == 6
    assert manifest.scheme == "W4A16"
    assert manifest.timings["peak_rss_mib"] * 2**20 < LIMIT_BYTES
    for layer in ("model.layers.0.self_attn.k_proj", "model.layers.19.mlp.down_proj"):
        _check_rtn_weights(model, tmp_path / "out", layer, group=128)
    _check_vllm_runs(tmp_path / "out")


def _check_rtn_weights(source: Path, ckpt: Path, layer: str, group: int) -> None:
    """Dequantized int4 weights are within half a step of the source weights (symmetric, per group
    of `group` inputs, scale absmax/7.5), computed here from the safetensors files alone. The
    stored scale is bfloat16: a code up to 8 steps from zero may be off by 8 x 2^-8 of a step more."""
    w, scale, codes = _int4_layer(source, ckpt, layer)
    steps = scale.repeat_interleave(group, dim=1)
    assert ((codes * steps - w).abs() <= steps * (0.5 + 8 * 2**-8)).all()
    _check_scales_from_source(w, scale, group)


def _tensor(directory: Path, name: str):
    """One tensor of a sharded safetensors checkpoint, found through its index."""
    from safetensors import safe_open

    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(directory / index[name], "pt") as f:
        return f.get_tensor(name)


def _int4_layer(source: Path, ckpt: Path, layer: str) -> tuple:
    """The source weight, the checkpoint's scales and its int4 codes (checked to be in range), as floats."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    w = _tensor(source, f"{layer}.weight").float()
    scale = _tensor(ckpt, f"{layer}.weight_scale").float()
    codes = unpack_from_int32(_tensor(ckpt, f"{layer}.weight_packed"), 4, w.shape).float()
    assert codes.min() >= -8 and codes.max() <= 7
    return w, scale, codes


def _check_scales_from_source(w, scale, group: int) -> None:
    """Symmetric int4 scales: each group's absmax / 7.5, from the source weights."""
    import torch

    absmax = w.abs().reshape(w.shape[0], -1, group).amax(-1)
    assert torch.allclose(scale, absmax / 7.5, rtol=1e-2)


def _check_vllm_runs(ckpt: Path) -> None:
    from qserve.device import detect
    from qserve.engines import vllm as engine

    manifest = read_manifest(ckpt)
    with engine.open_engine(ckpt, manifest.vllm_args, detect.detect_device(), ckpt.name) as lm:
        assert lm.model.llm_engine.model_config.quantization == "compressed-tensors"
        ((text, tokens),) = engine.greedy_completions(lm, ["The capital of France is"], max_tokens=4)
    assert len(tokens) == 4


# --- larger than memory, calibrated ---

# 1.25 GiB: under the 1.3 GiB model below, over what offloaded GPTQ needed here (peak RSS 1130 MiB,
# file-backed pages included). The same recipe with `execution: in_memory` under this limit was
# killed by the kernel after 19 of its 40 decoder layers (2026-11-24; README, "Scale").
OFFLOAD_LIMIT_BYTES = 1280 << 20


@pytest.fixture(scope="module")
def model_over_the_offload_limit(tmp_path_factory, embedded_model_dir: Path) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("offload") / "llama-synthetic"
    # 14 layers, hidden 2048: 1.3 GiB in 5 shards. Wider and fewer layers than docs/scale.md's 40 x 1024
    # model of the same size: GPTQ's cost is mostly per input column (a Python step each), 229k here
    # against 410k there (29k quantized: the test GPTQs o_proj alone).
    return path, _write_synthetic_llama(path, embedded_model_dir, 2048, 4096, 14)


@pytest.mark.matrix  # make test-matrix (CI runs it after make test): keeps make test within 30 minutes
@pytest.mark.slow
@needs_vllm("w4a16-gptq")  # each ends by running its W4A16 checkpoint in vLLM
def test_a_calibrated_model_larger_than_the_memory_limit_is_offloaded_to_disk(
    model_over_the_offload_limit, tmp_path: Path
) -> None:
    model, weights = model_over_the_offload_limit
    assert weights > OFFLOAD_LIMIT_BYTES
    recipe = tmp_path / "w4a16-gptq.yaml"
    # Only o_proj is GPTQ'd; the MLP and q, k, v are left in bf16 (gate and up took 47 of GPTQ's 81 s here,
    # 2026-11-26, with down_proj already kept; q, k and v 20 of the remaining 27 s, 2026-11-28; vLLM refuses a
    # fused qkv_proj whose shards differ in scheme): carried through the offloaded run and saved as they were.
    ignore = "[lm_head, 're:.*mlp\\..*_proj$', 're:.*self_attn\\.[qkv]_proj$']"
    recipe.write_text(
        f"name: w4a16-gptq-offload\nscheme: W4A16\nalgorithm: gptq\ngroup_size: 128\nignore: {ignore}\n"
        "calibration: {source: gsm8k-train, samples: 8, seq_len: 128}\n"  # execution: auto
    )
    with memory_cgroup(OFFLOAD_LIMIT_BYTES) as group:
        proc = _quantize_in(group, recipe, model, tmp_path / "out")
        hits = _limit_hits(group)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Without a bfloat16 matmul kernel (the machine's flags) its bfloat16 weights would calibrate in float32.
    widened = "" if native_bfloat16() else f" ({2 * weights / 2**30:.1f} GiB in float32 to calibrate)"
    sizes = f"{weights / 2**30:.1f} GiB of weights{widened}, {OFFLOAD_LIMIT_BYTES / 2**30:.1f} GiB of memory available"
    assert f"execution: offload (auto: too large to load ({sizes}); weights beyond memory offloaded to disk)" in proc.stderr
    assert hits > 0  # the limit bound: the kernel reclaimed memory to keep the process under it
    manifest = read_manifest(tmp_path / "out")
    assert manifest.execution["path"] == "offload" and manifest.execution["max_memory_cpu"] == 256 << 20
    assert manifest.timings["peak_rss_mib"] * 2**20 < OFFLOAD_LIMIT_BYTES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "w4a16-gptq.yaml"]  # offload folder removed
    for layer in ("model.layers.0.self_attn.o_proj", "model.layers.13.self_attn.o_proj"):
        w, scale, codes = _int4_layer(model, tmp_path / "out", layer)
        _check_scales_from_source(w, scale, 128)
        # GPTQ's error feedback moved codes off round-to-nearest, which would move none (measured
        # 2026-11-26: 15 % of layer 0's q_proj, 9.7 % of layer 13's o_proj; 2026-11-28: 21 % of layer 0's o_proj).
        rtn = (w / scale.repeat_interleave(128, dim=1)).round().clamp(-8, 7)
        assert 0.05 < (codes != rtn).float().mean().item() < 0.3, layer
    for kept in (
        "model.layers.13.mlp.down_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.7.self_attn.v_proj.weight",
    ):
        assert _tensor(tmp_path / "out", kept).equal(_tensor(model, kept))  # ignored layers, bit for bit
    _check_vllm_runs(tmp_path / "out")


def _limit_hits(group: Path) -> int:
    """How often the cgroup's memory reached its limit (v1 memory.failcnt; v2 memory.events `max`)."""
    if (group / "memory.failcnt").is_file():
        return int((group / "memory.failcnt").read_text())
    events = dict(line.split() for line in (group / "memory.events").read_text().splitlines())
    return int(events["max"])


# --- data-parallel calibration ---


@pytest.mark.matrix  # make test-matrix (CI runs it after make test): keeps make test within 30 minutes
@pytest.mark.slow
@pytest.mark.skipif(
    not native_bfloat16(),
    reason="without a bfloat16 kernel one process calibrates in float32 and the ranks in bfloat16: not the same "
    "arithmetic in another order, which the bounds below are for (measured: distance ratio 0.980 at one layer)",
)
def test_two_process_gptq_matches_the_single_process_checkpoint(checkpoints, embedded_model_dir: Path, tmp_path: Path) -> None:
    """GPTQ in 2 gloo processes against the session's 1-process checkpoint of the same recipe: the same
    solution up to the order of the Hessian's sums; GPTQ on another draw of calibration samples is not."""
    from safetensors.torch import load_file

    proc = run_qserve("quantize", checkpoints.recipe("w4a16-gptq"), "--nproc", "2", "--output", tmp_path / "ddp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = read_manifest(tmp_path / "ddp").execution
    assert record["path"] == "distributed" and record["samples_per_rank"] == [4, 4]  # 8 samples (conftest.SHRUNK)
    assert [r["samples"] for r in record["ranks"]] == [4, 4]
    one, two = (load_file(p / "model.safetensors") for p in (checkpoints["w4a16-gptq"], tmp_path / "ddp"))
    source = load_file(embedded_model_dir / "model.safetensors")
    assert _another_solution(one, two, source) == []
    # The case the bounds must catch: one process, calibrated on another seeded draw of 8 samples.
    recipe = checkpoints.recipe("w4a16-gptq")
    other = tmp_path / "seed1.yaml"
    other.write_text(recipe.read_text().replace("  seq_len: 128\n", "  seq_len: 128\n  seed: 1\n", 1))
    assert "  seed: 1\n" in other.read_text()
    redrawn = load_file(quantize_in_process(other, tmp_path / "seed1") / "model.safetensors")
    assert len(_another_solution(one, redrawn, source)) >= 20  # measured: 49 of 210 layers below 0.985


def _another_solution(one: dict, two: dict, source: dict) -> list[str]:
    """Why `two` is not `one`'s GPTQ solution found again: its scales differ, too many codes move by more than
    one step, or a layer lies farther from (or nearer to) the source weights than DDP_ERROR_RATIO allows."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    assert sorted(one) == sorted(two)
    found, beyond_one_step, total = [], 0, 0
    for name in (n for n in one if n.endswith("weight_packed")):
        layer = name.removesuffix("weight_packed")
        if not torch.equal(one[layer + "weight_scale"], two[layer + "weight_scale"]):
            found.append(f"{layer}: scales")
        shape = torch.Size(one[layer + "weight_shape"].tolist())
        codes = [unpack_from_int32(t[name], 4, shape).int() for t in (one, two)]
        beyond_one_step, total = beyond_one_step + int(((codes[0] - codes[1]).abs() > 1).sum()), total + codes[0].numel()
        # Equally good solutions: each one's distance from the source weights.
        steps = one[layer + "weight_scale"].float().repeat_interleave(64, dim=1)
        error = [(c.float() * steps - source[layer + "weight"].float()).norm() for c in codes]
        if not DDP_ERROR_RATIO[0] < error[1] / error[0] < DDP_ERROR_RATIO[1]:
            found.append(f"{layer}: distance ratio {error[1] / error[0]:.4f}")
    if beyond_one_step / total >= DDP_MAX_BEYOND_ONE_STEP:
        found.append(f"{beyond_one_step / total:.2%} of codes more than one step apart")
    return found


# Not bit-exact, by the arithmetic: the ranks' Hessian sums are added in another order, and GPTQ's
# sequential rounding carries a flipped decision forward. Measured spread (w4a16-gptq shrunk, 2 processes
# against 1, 5 runs on AMD EPYC kinds): per-layer distance ratio extremes 0.990-0.994 and 1.011-1.024,
# codes more than one step apart 1.06-1.07 %. Bounds: the mean extreme +- 3 sd, rounded out to 0.005;
# one step 0.3 points over 1.07 %. Another seeded draw of the samples (ratios 0.965-1.011, 1.80 %) must fail.
DDP_MAX_BEYOND_ONE_STEP = 0.014
DDP_ERROR_RATIO = (0.985, 1.03)


# --- eval at scale: vLLM's parallel options reach both engines ---


def test_parallel_options_reach_the_engine_keywords() -> None:
    from qserve.checkpoint.manifest import VllmArgs
    from qserve.cli._common import parallel_args
    from qserve.device.detect import Device
    from qserve.engines import vllm as engine

    args = VllmArgs(quantization="compressed-tensors", kv_cache_dtype="auto", dtype="bfloat16")
    one_node = Device("cuda", "8 GPUs").with_parallel(parallel_args(8, 1, 1, None))
    kw = engine.engine_kwargs(Path("/m"), args, one_node)
    assert kw["tensor_parallel_size"] == 8 and kw["distributed_executor_backend"] == "mp"
    nodes = Device("cuda", "16 GPUs").with_parallel(parallel_args(8, 2, 1, "ray"))
    kw = engine.engine_kwargs(Path("/m"), args, nodes)
    assert (kw["tensor_parallel_size"], kw["pipeline_parallel_size"], kw["distributed_executor_backend"]) == (8, 2, "ray")
    assert "data_parallel_size" not in kw
    assert parallel_args(1, 1, 4, None) == {"data_parallel_size": 4}


def test_data_parallel_on_a_gpu_host_needs_ray_and_one_replica_needs_nothing() -> None:
    """On a GPU host `-dp 2` is lm-eval's Ray replicas: without Ray (the lock does not hold it) one line says
    so before any work; one replica is no data parallelism and passes on any host."""
    import importlib.util

    from qserve.device.detect import Device
    from qserve.engines import vllm as engine
    from qserve.errors import QserveError

    assert importlib.util.find_spec("ray") is None  # make setup's environment: Ray is an install of its own
    with pytest.raises(QserveError) as refused:
        engine.check_data_parallel(Device("cuda", "2 GPUs").with_parallel({"data_parallel_size": 2}))
    assert str(refused.value) == (
        "-dp 2: lm-eval runs each data-parallel replica as a Ray task, and Ray is not installed "
        "(qserve's `ray` extra; make setup DEVICE=cuda installs it)"
    )
    for kind in ("cpu", "cuda"):
        engine.check_data_parallel(Device(kind, "one replica").with_parallel({"tensor_parallel_size": 2}))


def test_cpu_workers_get_a_share_of_the_cores_each_and_a_pipeline_runs_compiled(monkeypatch) -> None:
    """vLLM-CPU binds a worker per NUMA node and refuses more workers than nodes ("Not enough allowed NUMA
    nodes to bind threads of 2 local CPUWorkers"): qserve gives each worker its share of the cores. vLLM
    0.32's eager CPU runner fails a pipeline's later stage on its first step, so a pipeline runs compiled."""
    from qserve.checkpoint.manifest import VllmArgs
    from qserve.device.detect import Device
    from qserve.engines import vllm as engine

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(engine, "numa_nodes", lambda: 1)
    assert (engine.cpu_binding(1), engine.cpu_binding(2), engine.cpu_binding(4)) == (None, "0,1|2,3", "0|1|2|3")
    with pytest.raises(
        QserveError, match=r"^8 vLLM CPU workers \(tensor x pipeline parallel\) need 8 cores; this process has 4$"
    ):
        engine.cpu_binding(8)
    monkeypatch.setattr(engine, "numa_nodes", lambda: 2)
    assert engine.cpu_binding(2) is None  # a node each: vLLM's own binding
    args = VllmArgs(quantization=None, kv_cache_dtype="auto", dtype="bfloat16")
    tp, pp = (Device("cpu", "x").with_parallel({key: 2}) for key in ("tensor_parallel_size", "pipeline_parallel_size"))
    assert engine.engine_kwargs(Path("/m"), args, tp)["enforce_eager"] is True
    assert "enforce_eager" not in engine.engine_kwargs(Path("/m"), args, pp)
    assert engine.engine_kwargs(Path("/m"), args, pp)["distributed_executor_backend"] == "mp"
