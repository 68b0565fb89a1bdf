"""`qserve quantize` on the real embedded model with the real llm-compressor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import QSERVE, REPO, SHRUNK, run_qserve, small_manifest

from qserve.checkpoint.manifest import MANIFEST_NAME, hash_files, read_manifest, sha256_file, verify_files
from qserve.errors import QserveError
from qserve.paths import pending_log
from qserve.quantize.pipeline import check_shapes
from qserve.spec.recipe import load_recipe, parse_recipe

RECIPES = ["w4a16-gptq", "fp8", "w8a8-int8"]
# recipe -> weight bits, group size, vLLM dtype, calibrated, largest size as a fraction of the bfloat16
# source (269.0 MB): its 106.2 M Linear weights at 4 or 8 bits plus their 2-byte scales (3.3 MB for one
# per group of 64, 0.3 MB for one per channel), and the 28.3 M embedding and norms in bfloat16 (56.7 MB):
# W4A16 0.420, 8-bit 0.607.
SHAPE = {
    "w4a16-gptq": (4, 64, "float16", True, 0.43),
    "fp8": (8, None, "bfloat16", False, 0.62),
    "w8a8-int8": (8, None, "bfloat16", True, 0.62),
}
W4A16_128 = "name: t\nscheme: W4A16\ncalibration: {path: gsm8k/train.jsonl}\n"


def test_embedded_model_holds_the_ggufs_own_dequantized_weights_in_bfloat16(embedded_model_dir: Path) -> None:
    """The conversion (transformers, with gguf's reader shared across its four reads) against gguf's
    own dequantization of the same tensors, read here independently and rounded to bfloat16 by torch."""
    import gguf
    import torch
    from safetensors.torch import load_file

    from qserve.models.sources import embedded_gguf

    tensors = {t.name: t for t in gguf.GGUFReader(embedded_gguf()).tensors}
    converted = load_file(embedded_model_dir / "model.safetensors")
    assert {t.dtype for t in converted.values()} == {torch.bfloat16}
    # Not attn_q/attn_k: the GGUF stores those permuted for llama.cpp's rotary layout.
    for gguf_name, hf_name in [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight"),
    ]:
        t = tensors[gguf_name]
        expected = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type)).reshape(converted[hf_name].shape)
        assert t.tensor_type != gguf.GGMLQuantizationType.F32, hf_name
        assert torch.equal(converted[hf_name], expected.to(torch.bfloat16)), hf_name


def test_shape_check_names_layers_and_fix(embedded_model_dir: Path) -> None:
    with pytest.raises(QserveError) as e:
        check_shapes(embedded_model_dir, parse_recipe(W4A16_128))  # preset group 128; hidden size 576
    msg = str(e.value)
    assert msg.startswith("group_size 128 does not divide the input dim of model.layers.*.mlp.gate_proj (input dim 576)")
    assert "model.layers.*.self_attn.q_proj (input dim 576)" in msg
    assert "mlp.down_proj" not in msg  # 1536 = 12 * 128
    assert msg.endswith("set group_size to 32 or 64 in the recipe")


def test_shape_check_accepts_group_64(embedded_model_dir: Path) -> None:
    check_shapes(embedded_model_dir, parse_recipe(W4A16_128 + "group_size: 64\n"))


def test_block_check_names_the_fused_parts_vllm_refuses(embedded_model_dir: Path) -> None:
    """vLLM-CPU's own refusal of a whole-model FP8_BLOCK checkpoint (probed): "Weight output_partition_size =
    576 is not divisible by weight quantization block_n = 128"; qserve says so before quantizing."""
    with pytest.raises(QserveError) as e:
        check_shapes(embedded_model_dir, parse_recipe("name: b\nscheme: FP8_BLOCK\nignore: [lm_head]\n"))
    assert str(e.value) == (
        "FP8_BLOCK's 128x128 blocks do not fit model.layers.*.self_attn.k_proj (192 rows), "
        "model.layers.*.self_attn.q_proj (576 rows): vLLM fuses q_proj, k_proj, v_proj into one GEMM and needs "
        "every part but the last to be a multiple of 128 rows; add the whole fused group to ignore in the recipe"
    )
    with pytest.raises(QserveError) as e:  # ... and compressed-tensors' own group-of-128 activation quantizer
        check_shapes(embedded_model_dir, parse_recipe("name: b\nscheme: FP8_BLOCK\nignore: [lm_head, 're:.*(q|k|v)_proj$']\n"))
    assert str(e.value) == (
        "FP8_BLOCK quantizes activations in groups of 128 along the input dim, which does not divide "
        "model.layers.*.mlp.gate_proj (input dim 576), model.layers.*.mlp.up_proj (input dim 576), "
        "model.layers.*.self_attn.o_proj (input dim 576); add these layers to ignore in the recipe"
    )
    check_shapes(embedded_model_dir, load_recipe(REPO / "recipes" / "fp8-block.yaml")[0])  # down_proj: 1536 x 576


def test_shape_check_runs_before_calibration(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(W4A16_128)
    proc = run_qserve("quantize", recipe, "--output", tmp_path / "out")
    assert proc.returncode == 1 and "set group_size to 32 or 64" in proc.stderr
    assert "quantizing" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_quantizes_embedded_model(checkpoints, name: str) -> None:
    ckpt = checkpoints[name]
    manifest = read_manifest(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert manifest.vllm_args.quantization == "compressed-tensors"
    assert manifest.source_model["id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert manifest.recipe_source["sha256"] == sha256_file(checkpoints.recipe(name))  # shipped, or conftest.SHRUNK's
    assert manifest.versions["llmcompressor"] and manifest.versions["torch"].startswith("2.13.0")
    assert manifest.files["model.safetensors"] == sha256_file(ckpt / "model.safetensors")
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    bits, group_size, dtype, calibrated, max_size = SHAPE[name]
    assert (weights["num_bits"], weights["group_size"], manifest.vllm_args.dtype) == (bits, group_size, dtype)
    assert bool(manifest.calibration) == calibrated
    calibration = manifest.calibration or {"samples": 32, "content_sha256": "0" * 64, "sources": [{"path": "gsm8k/train.jsonl"}]}
    assert calibration["samples"] == (8 if name in SHRUNK else 32) and len(calibration["content_sha256"]) == 64
    assert calibration["sources"][0]["path"].endswith("gsm8k/train.jsonl")
    # Size against the bfloat16 source: a 4-bit checkpoint must be much smaller.
    src = sum(f.stat().st_size for f in Path(manifest.source_model["path"]).glob("*.safetensors"))
    assert (ckpt / "model.safetensors").stat().st_size < max_size * src


@pytest.mark.slow
def test_existing_output_is_refused_without_force(checkpoints) -> None:
    ckpt = checkpoints["fp8"]
    before = (ckpt / MANIFEST_NAME).read_bytes()
    proc = run_qserve("quantize", REPO / "recipes" / "fp8.yaml", "--output", ckpt)
    assert proc.returncode == 1 and "already exists; pass --force" in proc.stderr
    assert (ckpt / MANIFEST_NAME).read_bytes() == before


def _when_calibrating(proc: subprocess.Popen) -> None:
    """Once the run's quantize step started and llm-compressor quantized its first module, as the
    run's own log shows: calibration is under way."""
    for line in proc.stderr:
        if line.startswith("> quantizing"):
            break
    log = pending_log("quantize", proc.pid)
    deadline = time.monotonic() + 300
    while not (log.is_file() and "compress_module_list" in log.read_text(errors="replace")):
        assert proc.poll() is None and time.monotonic() < deadline, "calibration never started"
        time.sleep(0.1)


@pytest.mark.slow
def test_interrupted_quantize_leaves_nothing(tmp_path: Path, embedded_model_dir: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [*QSERVE, "quantize", REPO / "recipes" / "w4a16-gptq.yaml", "--output", out],
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    _when_calibrating(proc)
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 130, rest[-2000:]
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def _bad_model(root: Path, kind: str) -> Path:
    if kind == "missing":
        return root / "missing"
    if kind != "no-config":
        (root / "config.json").write_text("{}")
    if kind == "corrupt-weights":
        (root / "model.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"{")
    return root


@pytest.mark.parametrize(
    "kind,message",
    [
        ("missing", "not found: not a local directory and not a hub id"),
        ("no-config", "has no config.json"),
        ("no-weights", "has no .safetensors weights"),
        ("corrupt-weights", "are unreadable, corrupt or truncated"),
    ],
)
def test_bad_model_is_refused_before_work(tmp_path: Path, kind: str, message: str) -> None:
    model = _bad_model(tmp_path, kind)
    proc = run_qserve("quantize", REPO / "recipes" / "fp8.yaml", "--model", model, "--output", tmp_path / "out")
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr
    assert not (tmp_path / "out").exists()


def test_truncated_model_weights_are_refused(tmp_path: Path, embedded_model_dir: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for f in embedded_model_dir.iterdir():
        if f.suffix != ".safetensors":
            (model / f.name).write_bytes(f.read_bytes())
    with (embedded_model_dir / "model.safetensors").open("rb") as src:
        (model / "model.safetensors").write_bytes(src.read(50_000_000))
    proc = run_qserve("quantize", REPO / "recipes" / "fp8.yaml", "--model", model, "--output", tmp_path / "out")
    assert proc.returncode == 1
    assert f"model weights {model}/model.safetensors are unreadable, corrupt or truncated" in proc.stderr


PLAIN_FP8 = REPO / "recipes" / "llmcompressor-fp8-dynamic.yaml"  # data-free: seconds


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".partial" in p.name or ".old-" in p.name)


def test_publish_replaces_only_with_force_and_only_when_complete(tmp_path: Path) -> None:
    from qserve.quantize.pipeline import publish

    out = tmp_path / "out"
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "weights").write_text(name)
    publish(tmp_path / "a", out, force=False)
    with pytest.raises(QserveError, match=r"appeared while this run worked .*this run's result was discarded"):
        publish(tmp_path / "b", out, force=False)
    assert (out / "weights").read_text() == "a"
    publish(tmp_path / "b", out, force=True)
    assert (out / "weights").read_text() == "b" and _leftovers(tmp_path) == []
    assert (tmp_path / "b" / "weights").read_text() == "a"  # exchanged in one step: the caller removes the old


def test_a_killed_runs_leftovers_are_removed_and_a_moved_checkpoint_restored(tmp_path: Path) -> None:
    from qserve.runtime.scratch import clean_stale

    ended = subprocess.Popen(["true"])
    ended.wait()
    out = tmp_path / "out"
    dead = [tmp_path / f".out.partial-{ended.pid}-x1", tmp_path / f".out.old-{ended.pid}-x2"]
    live = tmp_path / f".out.partial-{os.getpid()}-x3"  # a concurrent run's: left alone
    for d in (*dead, live):
        (d / ".offload").mkdir(parents=True)
        (d / "weights").write_text(d.name)
    other = tmp_path / ".outer.partial-1-x4"  # another output's
    other.mkdir()
    clean_stale(out)
    assert (out / "weights").read_text() == dead[1].name  # the moved-aside checkpoint is back
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".outer.partial-1-x4", live.name, "out"])


def test_output_overlapping_the_source_model_is_refused(tmp_path: Path, embedded_model_dir: Path) -> None:
    for out in (embedded_model_dir, embedded_model_dir / "quantized", embedded_model_dir.parent):
        proc = run_qserve("quantize", PLAIN_FP8, "--model", embedded_model_dir, "--output", out, "--force")
        assert proc.returncode == 1
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: --output {out} overlaps the source model {embedded_model_dir}; choose a directory outside it"
        )
    assert not (embedded_model_dir / "quantized").exists()


def test_force_replaces_only_a_qserve_checkpoint(tmp_path: Path) -> None:
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "todo.txt").write_text("keep me")
    proc = run_qserve("quantize", PLAIN_FP8, "--output", precious, "--force")
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith(
        f"error: --force replaces only a qserve checkpoint, and {precious} has no {MANIFEST_NAME}"
    )
    assert (precious / "todo.txt").read_text() == "keep me"


@pytest.mark.slow
def test_force_keeps_the_old_checkpoint_until_the_new_one_is_complete(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_qserve("quantize", PLAIN_FP8, "--output", out).returncode == 0
    before = hash_files(out)
    card = (out / "README.md").read_text()
    assert "\n# out\n" in card and f"qserve serve {out}`" in card  # the final name, not the build dir's
    # A --force run with a calibrated recipe, stopped while it calibrates: the old checkpoint stays whole.
    proc = subprocess.Popen(
        [*QSERVE, "quantize", REPO / "recipes" / "w4a16-gptq.yaml", "--output", out, "--force"],
        stderr=subprocess.PIPE,
        text=True,
    )
    _when_calibrating(proc)
    proc.send_signal(signal.SIGTERM)
    proc.stderr.read()
    assert proc.wait(timeout=60) == 130
    assert hash_files(out) == before and _leftovers(tmp_path) == []
    verify_files(out, read_manifest(out))


@pytest.mark.slow
def test_sigkill_leaves_a_partial_directory_that_the_next_run_removes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [*QSERVE, "quantize", REPO / "recipes" / "w4a16-gptq.yaml", "--output", out], stderr=subprocess.PIPE, text=True
    )
    _when_calibrating(proc)
    proc.kill()  # no handler runs: the partial directory stays
    assert proc.wait(timeout=60) == -signal.SIGKILL
    left = _leftovers(tmp_path)
    assert len(left) == 1 and left[0].startswith(f".out.partial-{proc.pid}-")
    again = run_qserve("quantize", PLAIN_FP8, "--output", out)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"removed {tmp_path / left[0]}: left by run {proc.pid}, which ended before it finished" in again.stderr
    assert _leftovers(tmp_path) == []


@pytest.mark.slow
def test_concurrent_runs_to_one_output_never_corrupt_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    procs = [
        subprocess.Popen([*QSERVE, "quantize", PLAIN_FP8, "--output", out, "--force"], stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    codes = [p.wait(timeout=600) for p in procs]
    assert codes == [0, 0], [p.stderr.read()[-2000:] for p in procs]
    verify_files(out, read_manifest(out))  # one complete checkpoint, whichever finished last
    assert _leftovers(tmp_path) == []


def test_every_file_but_qserves_records_is_hashed_and_checked(tmp_path: Path) -> None:
    from qserve.checkpoint.manifest import write_manifest

    ckpt = tmp_path / "ck"
    (ckpt / "sub").mkdir(parents=True)
    for name in ("model.safetensors", "modeling_custom.py", "pytorch_model.bin", "chat_template.jinja", "sub/extra.pt"):
        (ckpt / name).write_text(name)
    files = hash_files(ckpt)
    assert sorted(files) == [
        "chat_template.jinja",
        "model.safetensors",
        "modeling_custom.py",
        "pytorch_model.bin",
        "sub/extra.pt",
    ]
    manifest = small_manifest(None, files=files)
    write_manifest(ckpt, manifest)
    # qserve's own records may come and go: the model card, eval records, logs, a crashed write's temp file.
    for record in (
        "README.md",
        "qserve_eval.json",
        "qserve_eval.md",
        "lm_eval_results.json",
        "qserve_eval_items.json",
        "logs/serve.log",
        "qserve_eval.json.77.tmp",
    ):
        (ckpt / record).parent.mkdir(exist_ok=True)
        (ckpt / record).write_text("record")
    verify_files(ckpt, manifest)
    (ckpt / "sitecustomize.py").write_text("import os")
    (ckpt / "modeling_custom.py").write_text("changed")
    (ckpt / "sub" / "extra.pt").unlink()
    with pytest.raises(QserveError) as e:
        verify_files(ckpt, manifest)
    assert str(e.value) == (
        f"checkpoint {ckpt} does not match its manifest (missing sub/extra.pt; changed modeling_custom.py; "
        "unexpected sitecustomize.py): it was modified after quantization"
    )


@pytest.mark.parametrize("kind", ["a symbolic link", "a FIFO"])
@pytest.mark.parametrize("where", ["model.safetensors", "logs/serve.log", "sub"])
def test_links_fifos_and_sockets_in_a_checkpoint_are_refused_by_name(tmp_path: Path, kind: str, where: str) -> None:
    ckpt = tmp_path / "ck"
    (ckpt / "logs").mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    target, path = tmp_path / "elsewhere", ckpt / where
    target.mkdir()
    if kind == "a symbolic link":
        path.symlink_to(target)
    else:
        os.mkfifo(path)
    with pytest.raises(QserveError) as e:
        hash_files(ckpt)
    assert str(e.value) == f"checkpoint {ckpt} holds {kind} at {where}; a checkpoint holds only plain files and directories"


def test_logs_are_private_and_never_written_through_a_link(tmp_path: Path) -> None:
    from qserve.paths import open_log

    victim = tmp_path / "victim"
    victim.write_text("precious")
    logs = tmp_path / "ck" / "logs"
    logs.mkdir(parents=True)
    (logs / "serve.log").symlink_to(victim)
    with pytest.raises(QserveError) as e:
        open_log(logs / "serve.log")
    assert str(e.value) == f"log file {logs / 'serve.log'} is a symbolic link; qserve does not write through links: remove it"
    (logs / "serve.log").unlink()
    os.link(victim, logs / "serve.log")
    with pytest.raises(QserveError) as e:
        open_log(logs / "serve.log")
    assert "is not a plain file of its own (a hard link or a device)" in str(e.value)
    (logs / "serve.log").unlink()
    (tmp_path / "ln").symlink_to(tmp_path)
    with pytest.raises(QserveError) as e:
        open_log(tmp_path / "ln" / "x.log")
    assert str(e.value).startswith(f"{tmp_path / 'ln'} is a symbolic link")
    assert victim.read_text() == "precious"
    (logs / "eval.log").write_text("an earlier run's log, world-readable")
    os.chmod(logs / "eval.log", 0o644)
    os.close(open_log(logs / "eval.log"))
    assert (logs / "eval.log").stat().st_mode & 0o777 == 0o600 and (logs / "eval.log").read_text() == ""


TAGGED_RECIPE = """\
default_stage:
  default_modifiers:
    SmoothQuantModifier:
      mappings:
      - !!python/tuple
        - ['re:.*q_proj', 're:.*k_proj']
        - re:.*input_layernorm
    GPTQModifier:
      actorder: !!python/object/apply:compressed_tensors.quantization.quant_args.ActivationOrdering [
        static]
      offload_device: !!python/object/apply:llmcompressor.sentinel.Sentinel [not_provided,
        /home/someone/.venv/lib/python3.11/site-packages/llmcompressor/sentinel.py]
      evil: !!python/object/apply:os.system [echo pwned]
"""


def test_the_checkpoints_recipe_is_plain_yaml_and_no_tag_runs_code(tmp_path: Path) -> None:
    import yaml

    from qserve.quantize.recipe_file import make_plain

    (tmp_path / "recipe.yaml").write_text(TAGGED_RECIPE)
    make_plain(tmp_path)  # os.system is never called: a one-argument apply reads as its argument
    assert yaml.safe_load((tmp_path / "recipe.yaml").read_text()) == {
        "default_stage": {
            "default_modifiers": {
                "SmoothQuantModifier": {"mappings": [[["re:.*q_proj", "re:.*k_proj"], "re:.*input_layernorm"]]},
                "GPTQModifier": {"actorder": "static", "evil": "echo pwned"},  # the sentinel left out: the default applies
            }
        }
    }


# llm-compressor alone, on the checkpoint's own recipe.yaml and qserve's calibration texts.
RAW_ONESHOT_FROM_FILE = """
import json, sys, torch
from datasets import Dataset
from llmcompressor import oneshot
from transformers import AutoModelForCausalLM, AutoTokenizer
model_path, texts_file, seq_len, recipe, out, calibration_dtype = sys.argv[1:7]
texts, seq_len = json.load(open(texts_file)), int(seq_len)
tokenizer = AutoTokenizer.from_pretrained(model_path)
model = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto")
source, calibrated_in = model.dtype, getattr(torch, calibration_dtype)
widened = calibrated_in != source  # a bfloat16 model on a CPU without a bfloat16 kernel: float32
if widened:
    model.to(calibrated_in)
enc = tokenizer(texts, truncation=True, max_length=seq_len, add_special_tokens=False)
oneshot(model=model, recipe=recipe, dataset=Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}),
        num_calibration_samples=len(texts), max_seq_length=seq_len, shuffle_calibration_samples=False, pipeline="sequential")
if widened:  # written back in the source's dtype; a model calibrated in it is saved as it is (its scales' own dtype)
    model.to(source)
model.save_pretrained(out, save_compressed=True)
"""


@pytest.mark.matrix  # a second full calibration of the tuned recipe (two minutes): CI's second phase
def test_raw_llm_compressor_rerun_of_the_checkpoints_recipe_gives_the_same_weights(
    checkpoints, embedded_model_dir: Path, tmp_path: Path
) -> None:
    """The shipped tuned checkpoint: the demo's W8A8 recipe (SmoothQuant mappings and an enum, both tags
    llm-compressor writes) with 8 MLP blocks overridden to W4A16, so two config groups and both GPTQ
    schemes (test_tune shows this recipe re-makes the tune winner). qserve's GPTQ quantizes same-shape
    layers in batches; llm-compressor's default on a CPU, one at a time, must write the same bytes."""
    import yaml

    from qserve.paths import data_dir
    from qserve.quantize.calibration import load_texts
    from qserve.quantize.pipeline import with_default_calibration

    ckpt = checkpoints["smollm2-tuned"]
    text = (ckpt / "recipe.yaml").read_text()
    written = yaml.safe_load(text)
    modifiers = written["default_stage"]["default_modifiers"]
    assert "!!python" not in text and "SmoothQuantModifier" in modifiers
    assert len(modifiers["GPTQModifier"]["config_groups"]) == 2
    assert modifiers["GPTQModifier"]["batched_quantization"] == 3  # backends.llmcompressor.gptq_batch_size
    del modifiers["GPTQModifier"]["batched_quantization"]
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(written, sort_keys=False))  # the modifiers run in order
    recipe = with_default_calibration(load_recipe(checkpoints.recipe("smollm2-tuned"))[0])
    texts, record = load_texts(recipe.calibration, data_dir(), embedded_model_dir)
    assert record["content_sha256"] == read_manifest(ckpt).calibration["content_sha256"]  # the data qserve used
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    # in the dtype qserve calibrated in (float32 on a CPU without a bfloat16 kernel), written back in bfloat16
    calibrated_in = read_manifest(ckpt).execution["calibration_dtype"]
    args = [
        embedded_model_dir,
        tmp_path / "texts.json",
        recipe.seq_len,
        tmp_path / "recipe.yaml",
        tmp_path / "raw",
        calibrated_in,
    ]
    proc = subprocess.run(
        [*QSERVE[:1], "-c", RAW_ONESHOT_FROM_FILE, *map(str, args)], capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sha256_file(tmp_path / "raw" / "model.safetensors") == read_manifest(ckpt).files["model.safetensors"]


def test_gptq_batches_only_repeated_shapes_within_a_quarter_of_the_weights() -> None:
    import torch

    from qserve.quantize.backends.llmcompressor import gptq_batch_size

    torch.manual_seed(0)
    pair = [torch.nn.Linear(64, 32, bias=False) for _ in range(2)]
    head = torch.nn.Linear(64, 4096, bias=False)  # a one-off shape: never batched, so not counted
    model = torch.nn.ModuleList([*pair, head])
    # float32 working set of a 32x64 layer: 4 * (3*32*64 + 3*64*64) = 73,728 bytes; the weights' quarter:
    # 4 * (2*32*64 + 4096*64) / 4 = 266,240 bytes: three such layers fit.
    assert gptq_batch_size(model) == 3
    assert gptq_batch_size(model.to(torch.bfloat16)) == 3  # counted in float32, GPTQ's precision
    assert gptq_batch_size(torch.nn.ModuleList([head])) == 1


def test_without_a_bfloat16_kernel_calibration_runs_in_float32_and_the_checkpoint_stays_bfloat16(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same recipe on the same bfloat16 model, on CPU flags without and with a bfloat16 matmul kernel:
    the manifest records the dtype each calibrated in, the weights differ (float32 arithmetic), and
    every tensor of both checkpoints has the same dtype (the float32 copy is written back in bfloat16)."""
    import torch
    from safetensors import safe_open

    from qserve.device import detect
    from qserve.quantize.pipeline import QuantizeOptions
    from qserve.workflows.run import quantize_logged

    tensors = {}
    for flags, calibrated_in in (({"avx2"}, "float32"), ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16")):
        monkeypatch.setattr(detect, "cpu_flags", lambda flags=flags: frozenset(flags))
        out = quantize_logged(REPO / "recipes" / "w8a8-int8.yaml", QuantizeOptions(str(tiny_model), tmp_path / calibrated_in))
        assert read_manifest(out).execution["calibration_dtype"] == calibrated_in
        assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"  # the source's, restored
        with safe_open(out / "model.safetensors", "pt") as f:
            tensors[calibrated_in] = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    in_float32, in_bfloat16 = tensors["float32"], tensors["bfloat16"]
    assert {k: t.dtype for k, t in in_float32.items()} == {k: t.dtype for k, t in in_bfloat16.items()}
    assert in_float32["model.embed_tokens.weight"].dtype == torch.bfloat16
    down = "model.layers.0.mlp.down_proj.weight"
    assert in_float32[down].dtype == torch.int8 and not torch.equal(in_float32[down], in_bfloat16[down])
