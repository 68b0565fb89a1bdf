"""`qserve tune`: per-layer mixes as recipes, the groups they target, the search, and a real tune."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import DEMO_RECIPE, REPO, run_qserve, run_qserve_in_process, runs_here

from qserve.checkpoint.manifest import read_manifest
from qserve.checkpoint.tensors import quantized_layer_bytes, tensor_headers
from qserve.errors import QserveError
from qserve.schemes.catalog import scheme_of_checkpoint
from qserve.spec.recipe import load_recipe, parse_recipe
from qserve.tune.groups import LayerGroup, targets
from qserve.tune.search import next_k, predicted_k, search_order

# recipes/smollm2-tuned.yaml promises a pass at this many gsm8k_ppl documents (README, "qserve tune"):
# the search's, and as many held-out ones for the confirmation.
# The shipped tuned recipe's promise: its candidate (about +3 % perplexity against +5.26 % allowed) passes the
# betting gate at the log 2 cap in about 160 documents (4 runs in 5, as its gate simulated at 100), so the
# search scores 300 and the held-out confirmation the 300 after them.
TUNED_LIMIT = 300

MIXED = """\
name: m
scheme: W8A8
overrides:
  - scheme: W4A16
    group_size: 64
    targets: ['re:.*layers\\.(3)\\.mlp\\.(down_proj|gate_proj|up_proj)$']
"""


def test_a_recipe_with_overrides_targets_the_mix() -> None:
    r = parse_recipe(MIXED)
    assert (r.scheme, r.target_scheme, r.overrides[0].group_size) == ("W8A8", "W8A8+W4A16", 64)
    assert r.label == "W8A8+W4A16 with llmcompressor (rtn)"


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (
            ("scheme: W8A8", "scheme: W8A8+W4A16"),
            "W8A8+W4A16 is a per-layer mix: give one scheme and list the other's layers under overrides",
        ),
        (
            ("  - scheme: W4A16", "  - scheme: FP8_DYNAMIC"),
            "the mix FP8_DYNAMIC+W8A8 was never run on vLLM by qserve; known mixes: W8A8+W4A16",
        ),
        (("scheme: W8A8\n", "scheme: W4A16\nbackend: quark\n"), "overrides (per-layer schemes) need backend: llmcompressor"),
        (
            ("    group_size: 64\n", "    group_size: 64\n    bits: 3\n"),
            "unknown field; valid fields: scheme, group_size, targets",
        ),
        (("targets: [", "targets: []  # ["), "List should have at least 1 item"),
    ],
)
def test_override_mistakes_are_one_line(change: tuple[str, str], error: str) -> None:
    with pytest.raises(QserveError) as e:
        parse_recipe(MIXED.replace(*change), "r.yaml")
    assert error in str(e.value) and "\n" not in str(e.value)


def test_a_checkpoint_with_two_config_groups_is_the_mix() -> None:
    w8 = {"weights": {"type": "int", "num_bits": 8}, "input_activations": {"type": "int", "num_bits": 8}}
    w4 = {"weights": {"type": "int", "num_bits": 4, "group_size": 64}, "input_activations": None}
    assert scheme_of_checkpoint({"config_groups": {"group_0": w8, "group_1": w4}}) == "W8A8+W4A16"
    assert scheme_of_checkpoint({"config_groups": {"group_0": w4, "group_1": w8}}) == "W8A8+W4A16"  # order-free
    fp8 = {"weights": {"type": "float", "num_bits": 8}, "input_activations": {"type": "float", "num_bits": 8, "dynamic": True}}
    assert scheme_of_checkpoint({"config_groups": {"group_0": fp8, "group_1": w4}}) is None  # never run: no name


def test_group_targets_name_exactly_their_layers() -> None:
    from compressed_tensors.utils import match_name

    leaves = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
    groups = [LayerGroup(b, k, tuple(f"model.layers.{b}.{k}.{leaf}" for leaf in leaves[k]), 1) for b in range(12) for k in leaves]
    chosen = [g for g in groups if (g.block, g.kind) in {(1, "mlp"), (10, "mlp"), (3, "self_attn")}]
    regexes = targets(chosen)
    matched = {m for g in groups for m in g.modules if any(match_name(m, t) for t in regexes)}
    assert matched == {m for g in chosen for m in g.modules}  # layers.1 does not catch layers.10/11, nor 10 catch 1
    assert regexes == [
        r"re:.*layers\.(1|10)\.mlp\.(down_proj|gate_proj|up_proj)$",
        r"re:.*layers\.(3)\.self_attn\.(k_proj|o_proj|q_proj|v_proj)$",
    ]


def test_the_search_moves_the_least_harm_per_parameter_first() -> None:
    attn = {"group": "3.self_attn", "kl": 0.002, "params": 884_736}
    mlp = {"group": "3.mlp", "kl": 0.004, "params": 2_654_208}  # twice the harm, three times the bytes
    assert [g["group"] for g in search_order([attn, mlp])] == ["3.mlp", "3.self_attn"]


def test_the_search_starts_at_the_prediction_gallops_then_bisects() -> None:
    # log(1/0.95)/2 = 0.02565 nats: the first three groups fit, the fourth does not.
    assert predicted_k([0.008, 0.008, 0.008, 0.008], 0.95) == 3
    assert predicted_k([0.5], 0.95) == 1  # never below one group
    assert next_k(lo=3, hi=61, n=60) == 6  # nothing failed yet: double
    assert next_k(lo=6, hi=12, n=60) == 9  # both sides known: bisect
    assert next_k(lo=40, hi=61, n=60) == 60


@pytest.mark.slow
@pytest.mark.matrix  # the shipped tuned recipe's cell: a search, two evals and two quantizations
def test_tune_finds_a_smaller_mix_that_passes_in_vllm_and_its_recipe_remakes_it(checkpoints, passed_eval, tmp_path: Path) -> None:
    """One candidate (the predicted k) at the shipped tuned recipe's promise, gsm8k_ppl at TUNED_LIMIT documents:
    it must pass the 0.95 gate in vLLM with engine parity, again on the documents after those (held out
    from the search), with fewer quantized-layer bytes than uniform W8A8,
    and recipes/smollm2-tuned.yaml, plainly quantized, must re-make its weights bit for bit (so the
    shipped recipe's checkpoint is the one that passed)."""
    out = tmp_path / "tune"
    proc = run_qserve_in_process(
        "tune", REPO / DEMO_RECIPE, "--tasks", "gsm8k_ppl", "--limit", str(TUNED_LIMIT), "--max-candidates", "1", "--out-dir", out
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    result = json.loads((out / "pareto.json").read_text())
    sens = json.loads((out / "sensitivity.json").read_text())
    # Sensitivity: all 60 groups (30 blocks x attention, MLP), least harmful first, each measurably harmful.
    kls = [g["kl"] for g in sens["groups"]]
    assert len(kls) == 60 and kls == sorted(kls) and kls[0] > 0
    assert (out / "sensitivity.md").read_text().count("\n| ") == 61  # header row + 60 groups
    # The one candidate tried is the prediction, and it is the winner: it passed the noise-aware gate in vLLM.
    winner = result["winner"]
    assert len(result["candidates"]) == 1 and winner == result["candidates"][0] and winner["k"] == result["predicted_k"] >= 1
    # Its gate record is the confirmation on held-out items, not the search's (the best of the candidates).
    record = json.loads((Path(winner["checkpoint"]) / "qserve_eval.json").read_text())
    gate = record["gates"][0]
    assert (record["verdict"], record["engine"], record["parity"]["status"]) == ("pass", "vllm", "pass")
    assert (record["purpose"], record["offset"], record["limit"], gate["items"]) == (
        "gate",
        TUNED_LIMIT,
        TUNED_LIMIT,
        TUNED_LIMIT,
    )
    assert result["confirmation"] == {
        "verdict": "pass",
        "recovery": gate["recovery"],
        "bounds": gate["bounds"],
        "items": f"{TUNED_LIMIT}-{2 * TUNED_LIMIT - 1}",
        "look": record["look"]["number"],
    }
    assert record["parity"]["tolerance"]["max_mean_abs_logprob_diff"] == 0.35  # INT8 activations: the looser bound
    assert gate["criteria"] == {"min_recovery": 0.95} and gate["evidence"]["criteria"]["min_recovery"]["decision"] == "pass"
    assert gate["test"].startswith(
        f"betting without replacement (Waudby-Smith and Ramdas 2020) on the task's {1319 - TUNED_LIMIT} items after the "
        f"first {TUNED_LIMIT} of its order (a claim about them), in the seeded order size-biased by words"
    )
    assert f"recovery {winner['recovery']:.4f}, PASS" in proc.stdout
    assert (
        f"confirmation on held-out items {TUNED_LIMIT}-{2 * TUNED_LIMIT - 1}: PASS, recovery {gate['recovery']:.4f}"
        in proc.stdout
    )
    # Smaller than uniform W8A8, measured independently from both checkpoints' safetensors headers.
    mixed, w8a8 = quantized_layer_bytes(Path(winner["checkpoint"])), quantized_layer_bytes(passed_eval[0])
    assert mixed["layers"] == w8a8["layers"] == 210 and mixed["ratio"] < w8a8["ratio"]
    assert winner["layer_bytes_vs_bf16"] == mixed["ratio"]
    # Exactly the first k groups of the search order are INT4 (packed weights), the rest INT8.
    packed = {n.rsplit(".", 2)[0] for n in tensor_headers(Path(winner["checkpoint"])) if n.endswith(".weight_packed")}
    expected = {f"model.layers.{name}" for name in result["order"][: winner["k"]]}
    assert packed == expected
    # The recipe it wrote is the shipped one in all that decides the weights (recipes/smollm2-tuned.yaml is
    # this winner, renamed), and quantizing that file re-makes the winner's weights bit for bit.
    written, shipped = (
        parse_recipe(Path(result["recipe_file"]).read_text()),
        load_recipe(REPO / "recipes" / "smollm2-tuned.yaml")[0],
    )
    weights_fields = {"scheme", "algorithm", "smoothquant", "ignore", "calibration", "overrides", "group_size", "dtype"}
    assert written.model_dump(include=weights_fields) == shipped.model_dump(include=weights_fields)
    tuned = read_manifest(checkpoints["smollm2-tuned"])
    assert tuned.scheme == "W8A8+W4A16"
    assert tuned.files["model.safetensors"] == read_manifest(Path(winner["checkpoint"])).files["model.safetensors"]
    assert (out / f"{Path(DEMO_RECIPE).stem}-tuned.yaml").read_bytes() == Path(winner["recipe"]).read_bytes()
    for name in ("pareto.png", "sensitivity.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["recipes/fp8.yaml", "--limit", "10"],
            "error: no per-layer mix with FP8_DYNAMIC is known to run in vLLM on this device",
        ),
        (
            ["recipes/w8a8-int8.yaml", "--with", "mxfp4", "--limit", "10"],
            "error: mixing W8A8 with MXFP4 was never seen to run in vLLM here; runnable partners: "
            + ("W4A16" if runs_here("smollm2-tuned") else "none"),  # the mix's INT4 layers need AVX-512, its INT8 VNNI
        ),
        (["recipes/w8a8-int8.yaml", "--objective", "speed"], "error: objective must be bytes or throughput, not 'speed'"),
        (
            ["recipes/w8a8-int8.yaml"],
            "error: qserve tune needs --limit: the winner is confirmed on the next --limit items, held out from the search",
        ),
        (
            ["recipes/quark-w4a16.yaml", "--limit", "10"],
            "error: qserve tune starts from an llm-compressor recipe with one scheme (no overrides, kv_cache or sparsity)",
        ),
    ],
)
def test_tune_refuses_what_it_cannot_search_in_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    proc = run_qserve("tune", *args, "--out-dir", tmp_path / "t")
    assert (proc.returncode, proc.stderr.strip().splitlines()[-1]) == (1, message)
    assert not (tmp_path / "t" / "sensitivity.json").exists()
