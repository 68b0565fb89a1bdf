"""Tasks lm-eval knows (registered, or in an --include-path folder) and their hub datasets read from
local copies in the hub's own layout, offline (no hub at run time)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import DATA_DIR, REPO, copy_checkpoint, run_qserve_in_process, small_manifest

from qserve.checkpoint.manifest import LM_EVAL_RESULTS_NAME, hash_files, write_manifest
from qserve.errors import QserveError
from qserve.evaluate.tasks import LmEvalTask, get_tasks, lm_eval_config, resolve_tasks
from qserve.gate.core import Group, Pooled, decide_gates, group
from qserve.spec.gates import GateSpec

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

# Two tasks in lm-eval's YAML format over one local file: a generation task with a filter, and a
# multiple choice one without metric_list (lm-eval's defaults for multiple_choice: acc, then acc_norm).
DOCS = [
    {"question": "Is the sky blue? One plus one?", "answer": "2"},
    {"question": "Is fire cold? One plus two?", "answer": "3"},
    {"question": "Is the sky up? Two plus zero?", "answer": "2"},
]
COMMON = {"dataset_path": "json", "test_split": "test", "doc_to_text": "{{question}}"}
FOLDER_TASKS = {
    "tiny_gen": {
        "output_type": "generate_until",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n"]},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "filter_list": [
            {"name": "first-number", "filter": [{"function": "regex", "regex_pattern": "(\\d+)"}, {"function": "take_first"}]}
        ],
    },
    "tiny_mc": {"output_type": "multiple_choice", "doc_to_choice": ["yes", "no"], "doc_to_target": 0},
}


def _task_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "my_tasks"
    folder.mkdir()
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, cfg in FOLDER_TASKS.items():
        full = {"task": name, **COMMON, "dataset_kwargs": {"data_files": {"test": str(data)}}, **cfg}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(full))
    return folder


def _checkpoint(root: Path) -> Path:
    """A checkpoint whose files verify (no model in it): enough for what eval checks before an engine starts."""
    ckpt = root / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights")
    write_manifest(ckpt, small_manifest(recipe={"name": "w8a8-int8"}, source_model={"id": "m"}, files=hash_files(ckpt)))
    return ckpt


def scripted_lm(
    generate: Callable[[Any], str] | None = None,
    loglikelihood: Callable[[Any], float] | None = None,
    rolling: Callable[[Any], float] | None = None,
) -> Any:
    """An lm-eval model that answers each request by a rule: `generate(request)` for generate_until,
    `loglikelihood(request)` (the log-likelihood; never greedy) for loglikelihood, `rolling(request)` for
    loglikelihood_rolling; the rest it refuses."""
    from lm_eval.api.model import LM

    class Scripted(LM):
        def generate_until(self, requests, disable_tqdm: bool = False):
            if generate is None:
                raise NotImplementedError
            return [generate(r) for r in requests]

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            if loglikelihood is None:
                raise NotImplementedError
            return [(loglikelihood(r), False) for r in requests]

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            if rolling is None:
                raise NotImplementedError
            return [rolling(r) for r in requests]

    return Scripted()


def _prefers_sky_yes(worse: float) -> Callable[[Any], float]:
    """Log-likelihood -1 for "yes" when the question is about the sky (and for "no" otherwise), else `worse`."""
    return lambda r: -1.0 if (r.args[1].strip() == "yes") == ("sky" in r.args[0]) else worse


def test_a_registered_task_resolves_to_lm_evals_own_config() -> None:
    (task,) = get_tasks(["gsm8k_cot_llama"])
    assert isinstance(task, LmEvalTask) and task.name == "gsm8k_cot_llama"
    assert task.config["dataset_path"] == "openai/gsm8k"
    # the headline: the first metric of its metric_list with the first filter of its filter_list
    assert task.metric == "exact_match,strict-match"
    (arc,) = get_tasks(["arc_challenge"])
    assert arc.metric == "acc,none" and arc.config["output_type"] == "multiple_choice"


def test_qserve_own_eval_of_the_same_name_wins() -> None:
    (gsm8k,) = get_tasks(["gsm8k"])
    assert not isinstance(gsm8k, LmEvalTask) and gsm8k.data_files == {"train": "gsm8k/train.jsonl", "test": "gsm8k/test.jsonl"}


def test_an_include_path_folder_adds_its_two_tasks(tmp_path: Path) -> None:
    tasks = get_tasks(["tiny_gen", "tiny_mc", "gsm8k_ppl"], include_path=_task_folder(tmp_path))
    assert [t.name for t in tasks] == ["tiny_gen", "tiny_mc", "gsm8k_ppl"]
    assert [t.metric for t in tasks[:2]] == ["exact_match,first-number", "acc,none"]
    with pytest.raises(QserveError, match="^unknown task tiny_gen "):
        get_tasks(["tiny_gen"])  # only with the folder


def test_per_item_values_of_a_generation_and_a_multiple_choice_task(tmp_path: Path) -> None:
    """The paired test's per-item values, as qserve collects them from lm-eval's samples, for the headline
    metric of a generate_until task (through its filter) and of a multiple_choice one."""
    import lm_eval

    from qserve.evaluate.lm_eval_run import _items
    from qserve.evaluate.tasks import config_task_manager

    model = scripted_lm(generate=lambda r: "It is 2, surely.", loglikelihood=_prefers_sky_yes(-2.0))
    tasks = get_tasks(["tiny_gen", "tiny_mc"], include_path=_task_folder(tmp_path))
    configs = [lm_eval_config(t, DATA_DIR) for t in tasks]
    out = lm_eval.simple_evaluate(model=model, tasks=configs, task_manager=config_task_manager(), log_samples=True)
    gen, mc = (_items(out["samples"][t.name], out["results"][t.name])[t.metric] for t in tasks)
    assert gen == {"0": 1.0, "1": 0.0, "2": 1.0}  # answers 2, 3, 2 against "2"
    assert mc == {"0": 1.0, "1": 0.0, "2": 1.0}  # every target is "yes"; only the sky questions get it


def test_two_blocks_joined_are_lm_evals_run_of_all_items(tmp_path: Path) -> None:
    """--until-decided's later rounds score only their new items and join them (lm_eval_run.join): on a
    generation task through its filter and a multiple-choice one (acc and acc_norm), documents 0 and 1-2
    scored apart and joined give the scores and stderrs lm-eval states when it scores all three at once."""
    import lm_eval

    from qserve.evaluate.lm_eval_run import EngineRun, _items, join, unjoinable
    from qserve.evaluate.tasks import config_task_manager

    def answer(r: Any) -> str:
        return f"It is {2 if 'plus zero' in r.args[0] or 'One plus one' in r.args[0] else 5}."

    tasks = get_tasks(["tiny_gen", "tiny_mc"], include_path=_task_folder(tmp_path))
    configs = [lm_eval_config(t, DATA_DIR) for t in tasks]

    def run(ids: list[int] | None) -> EngineRun:
        picked = {} if ids is None else {"samples": {t.name: ids for t in tasks}}
        out = lm_eval.simple_evaluate(
            model=scripted_lm(answer, _prefers_sky_yes(-1.5)),
            tasks=configs,
            task_manager=config_task_manager(),
            log_samples=True,
            **picked,
        )
        raw = {k: out[k] for k in ("results", "n-samples")}
        return EngineRun(raw, {t.name: _items(out["samples"][t.name], out["results"][t.name]) for t in tasks})

    whole, first, rest = run(None), run([0]), run([1, 2])
    assert unjoinable(whole) is None and unjoinable(first) is None and unjoinable(rest) is None
    joined = join(first, rest)
    for task in ("tiny_gen", "tiny_mc"):
        stated = whole.raw["results"][task]
        names = {"acc,none", "acc_norm,none"} if task == "tiny_mc" else {"exact_match,first-number"}
        assert names <= set(stated) and set(joined.raw["results"][task]) == set(stated)
        for key, value in stated.items():
            assert joined.raw["results"][task][key] == (pytest.approx(value, rel=1e-12) if isinstance(value, float) else value)
        assert joined.raw["n-samples"][task]["effective"] == 3


def test_an_unknown_task_is_one_line_with_the_closest_names(tmp_path: Path) -> None:
    proc = run_qserve_in_process("eval", _checkpoint(tmp_path), "--tasks", "arc_chalenge")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: unknown task arc_chalenge (closest names lm-eval and qserve know: "
        "arc_challenge, arc_eu_challenge, arc_challenge_mt, arc_ca_challenge, arc_challenge_chat)"
    )


def test_mmlu_resolves_to_its_57_subjects_gated_as_one_group() -> None:
    """lm-eval's mmlu group: its four category groups' subjects (a tag each), one gated unit, lm-eval's
    size-weighted acc its headline; a subject named beside it is gated too."""
    import lm_eval

    default = Path(lm_eval.__file__).parent / "tasks" / "mmlu" / "default"
    subjects = sorted(p.stem for p in default.glob("mmlu_*.yaml"))  # one YAML per subject, read here
    resolved = resolve_tasks(["mmlu", "mmlu_anatomy"])
    assert sorted(t.name for t in resolved.tasks) == subjects and len(subjects) == 57
    group = resolved.groups["mmlu"]
    assert (group.name, sorted(group.members), group.aggregate) == ("mmlu", subjects, (("acc,none", True),))
    assert resolved.units == ["mmlu", "mmlu_anatomy"]


def test_a_group_of_the_leaderboards_tasks_gates_each_metric_its_tasks_are_scored_by(tmp_path: Path) -> None:
    """lm-eval's Open LLM Leaderboard group states acc (mmlu_pro's alone), acc_norm (bbh, gpqa, musr),
    exact_match (math) and ifeval's four: a gate naming no metric gates acc and acc_norm here (math and
    ifeval need packages this environment lacks, so the folder's group leaves them out), each over the
    tasks that report it."""
    import lm_eval

    board = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / "leaderboard" / "leaderboard.yaml").read_text())
    folder = tmp_path / "board"
    folder.mkdir()
    members = ["leaderboard_mmlu_pro", "leaderboard_bbh", "leaderboard_gpqa", "leaderboard_musr"]
    group = {"group": "board", "task": members, "aggregate_metric_list": board["aggregate_metric_list"]}
    (folder / "_board.yaml").write_text(yaml.safe_dump(group))
    resolved = resolve_tasks(["board"], include_path=folder)
    found = resolved.groups["board"]
    assert found.gated == ("acc,none", "acc_norm,none")
    assert found.reporters("acc,none") == ("leaderboard_mmlu_pro",)
    assert found.reporters("acc_norm,none") == tuple(t.name for t in resolved.tasks if t.name != "leaderboard_mmlu_pro")
    assert found.reporters("exact_match,none") == ()


def test_a_groups_gate_without_a_metric_reaches_each_member_by_its_own_headline() -> None:
    """After the group's headline, the first member no earlier metric reaches is gated on its own headline
    where the group aggregates it (c's), not on the first aggregate metric it reports (b)."""
    aggregate = [("a,none", True), ("b,none", True), ("c,none", True), ("d,none", True)]
    reporting = {"a,none": ["t1"], "b,none": ["t2", "t3"], "c,none": ["t2"], "d,none": ["t3"]}
    found = group("g", ["t1", "t2", "t3"], aggregate, reporting, {"t1": "a,none", "t2": "c,none", "t3": "x,none"})
    assert found.gated == ("a,none", "c,none", "b,none")  # t3 reports b and d, its own headline neither: b, the first
    assert group("g", ["t1"], aggregate[:1], {"a,none": ["t1"]}, {}).gated == ("a,none",)


class _Scores:
    """Per-task stated scores and items, as one model's lm-eval output gives them (gate.core.Scores)."""

    def __init__(self, tasks: dict[str, dict[str, float]]) -> None:
        self.tasks = tasks

    def higher_is_better(self, task: str, metric: str) -> bool:
        return True

    def output_type(self, task: str) -> str | None:
        return "multiple_choice"

    def score(self, task: str, metric: str):
        if task not in self.tasks:
            raise QserveError(f"no {task}")
        items = self.tasks[task]
        return sum(items.values()) / len(items), None, items

    def check_items_add_up(self, task: str, metric: str, scored) -> None:
        pass


def test_a_group_pools_its_tasks_items_and_states_lm_evals_aggregate() -> None:
    """Items keyed task/doc_id, all in one paired test; the stated score lm-eval's size-weighted mean (here
    3 of 4 and 1 of 2: (3 + 1) / 6), or the plain mean of the two (0.625) without weight_by_size."""
    scores = _Scores({"a": {"0": 1.0, "1": 1.0, "2": 0.0, "3": 1.0}, "b": {"0": 0.0, "1": 1.0}})
    for by_size, expected in ((True, 4 / 6), (False, (0.75 + 0.5) / 2)):
        pooled = Pooled(scores, {"g": Group("g", ("a", "b", "c"), (("acc,none", by_size),))})
        stated, _, items = pooled.score("g", "acc,none")
        assert stated == pytest.approx(expected, abs=1e-12)
        assert items == {"a/0": 1.0, "a/1": 1.0, "a/2": 0.0, "a/3": 1.0, "b/0": 0.0, "b/1": 1.0}  # c reports nothing
    with pytest.raises(QserveError, match="^group g: none of its 1 tasks reports acc,none$"):
        Pooled(scores, {"g": Group("g", ("c",), (("acc,none", True),))}).score("g", "acc,none")


class _ScoresByMetric(_Scores):
    """_Scores whose tasks report only the metrics given for them (task -> metric -> items)."""

    def __init__(self, tasks: dict[str, dict[str, dict[str, float]]]) -> None:
        self.by_metric = tasks

    def score(self, task: str, metric: str):
        if metric not in self.by_metric.get(task, {}):
            raise QserveError(f"no {metric} for {task}")
        items = self.by_metric[task][metric]
        return sum(items.values()) / len(items), None, items


def test_a_groups_metric_is_bet_on_the_pooled_order_of_the_tasks_that_report_it() -> None:
    """A --limit of 60 of a 3 x 50 group takes the first 60 of its pooled order; acc_norm, which b and c
    alone report, is bet on the 100 items of b and c, of which those taken are a prefix of their own
    pooled order: a claim about all 100 at 5 % over every look (before, a sample of 150 where a's were
    missing: a claim about the scored items alone)."""
    sizes = {"a": 50, "b": 50, "c": 50}
    taken = _pooled_prefix("g", sizes, 60)
    items = {
        t: {m: {str(i): 1.0 for i in taken[t]} for m in ms}
        for t, ms in (("a", ["acc,none"]), ("b", ["acc_norm,none"]), ("c", ["acc_norm,none"]))
    }
    reporting = {"acc,none": ["a"], "acc_norm,none": ["b", "c"]}
    groups = {"g": group("g", ["a", "b", "c"], [("acc,none", True), ("acc_norm,none", True)], reporting, {})}
    spec = GateSpec(max_drop=0.05)
    gates = decide_gates({"g": [spec]}, {}, _ScoresByMetric(items), _ScoresByMetric(items), 0.05, groups, sizes)
    assert [(g.metric, g.items) for g in gates] == [
        ("acc,none", len(taken["a"])),
        ("acc_norm,none", len(taken["b"]) + len(taken["c"])),
    ]
    assert gates[1].test.endswith("at 5 % over every look") and "on 100 items of the task" in gates[1].test
    assert "on 50 items of the task" in gates[0].test


# Two multiple-choice tasks over GSM8K questions and a group over them: each item asks for the word that
# follows the first half of a question, against a non-word, so that both models answer every item alike;
# every fourth item names the non-word its target, so the items score 0 and 1 (all 1 would decide nothing).
# `metrics`: a task's own metric_list (else lm-eval's acc and acc_norm); `aggregate`: the group's metrics.
def _group_folder(tmp_path: Path, per_task: int, metrics: dict[str, str] | None = None, aggregate: tuple = ("acc",)) -> Path:
    folder = tmp_path / "group_tasks"
    folder.mkdir()
    lines = (DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()
    for k, name in enumerate(("half_a", "half_b")):
        docs = []
        for i, line in enumerate(lines[k * per_task : (k + 1) * per_task]):
            words = json.loads(line)["question"].split()
            docs.append({"text": " ".join(words[: len(words) // 2]), "next": words[len(words) // 2], "target": int(i % 4 == 3)})
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        task = {"task": name, **COMMON, "doc_to_text": "{{text}}", "dataset_kwargs": {"data_files": {"test": str(data)}}}
        task |= {"output_type": "multiple_choice", "doc_to_choice": "{{[next, 'qxzvj']}}", "doc_to_target": "{{target}}"}
        if name in (metrics or {}):
            task["metric_list"] = [{"metric": metrics[name], "aggregation": "mean", "higher_is_better": True}]
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(task))
    group = {
        "group": "halves",
        "task": ["half_a", "half_b"],
        "aggregate_metric_list": [{"metric": m, "weight_by_size": True} for m in aggregate],
    }
    (folder / "_halves.yaml").write_text(yaml.safe_dump(group))
    return folder


def test_inline_groups_and_tasks_are_named_under_their_group_as_lm_eval_names_them(tmp_path: Path) -> None:
    """A group YAML may define a subgroup and a task inline (lm-eval's TaskFactory names them
    `outer::inner` and `outer::inner::task`); the group's own settings reach its tasks, theirs win."""
    folder = _group_folder(tmp_path, 5)
    inline = {"task": "inline_half", **yaml.safe_load((folder / "half_a.yaml").read_text())} | {"num_fewshot": 2}
    inline["task"] = "inline_half"
    outer = {
        "group": "outer",
        "task": ["half_b", {"group": "inner", "task": [inline]}],
        "num_fewshot": 1,
        "aggregate_metric_list": [{"metric": "acc"}],
    }
    (folder / "_outer.yaml").write_text(yaml.safe_dump(outer))
    resolved = resolve_tasks(["outer"], include_path=folder)
    assert [(t.name, t.config["num_fewshot"]) for t in resolved.tasks] == [("half_b", 1), ("outer::inner::inline_half", 2)]
    assert resolved.groups["outer"].members == ("half_b", "outer::inner::inline_half")


def test_a_group_in_a_task_folder_is_one_gate_over_its_tasks_pooled_items(passed_eval, tmp_path: Path) -> None:
    """`--tasks halves` runs both tasks on both models and gates once, over the 2 x 100 items; the stated
    scores are lm-eval's per-task scores weighted by their items, read here from lm-eval's results."""
    per_task = 100
    folder = _group_folder(tmp_path, per_task)
    ckpt = copy_checkpoint(passed_eval[0], tmp_path / "ckpt")
    # An allowance of 10 points: this checkpoint's weights have had earlier looks in the session (the
    # demo, other tests), and a later look spends less level (looks.py); the subject here is the pooling.
    args = ("--tasks", "halves", "--include-path", folder, "--gate", "halves:max_drop=0.1", "--no-parity", "--json")
    proc = run_qserve_in_process("eval", ckpt, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(proc.stdout)
    raw = json.loads((ckpt / LM_EVAL_RESULTS_NAME).read_text())
    assert record["tasks"] == ["half_a", "half_b"]
    assert record["groups"] == {
        "halves": {
            "name": "halves",
            "members": ["half_a", "half_b"],
            "aggregate": [["acc,none", True]],
            "reporting": [["acc,none", ["half_a", "half_b"]]],  # both multiple choice: lm-eval's acc and acc_norm
            "defaults": ["acc,none"],
        }
    }
    (gate,) = record["gates"]
    assert (gate["task"], gate["metric"], gate["items"], gate["status"]) == ("halves", "acc,none", 2 * per_task, "pass")
    for side in ("baseline", "quantized"):
        assert [raw[side]["n-samples"][t]["effective"] for t in ("half_a", "half_b")] == [per_task, per_task]
        stated = sum(raw[side]["results"][t]["acc,none"] for t in ("half_a", "half_b")) / 2  # equal sizes
        assert gate[side] == pytest.approx(stated, abs=1e-12)
    report = (ckpt / "qserve_eval.md").read_text()
    assert "## halves: its 2 tasks" in report
    for t in ("half_a", "half_b"):
        b, q = (raw[side]["results"][t]["acc,none"] for side in ("baseline", "quantized"))
        assert f"| {t} | acc,none | {per_task} | {b:.4f} | {q:.4f} |" in report


def _pooled_prefix(group: str, sizes: dict[str, int], n: int) -> dict[str, list[int]]:
    """The first n items of a group's pooled order as docs/gates.md states it, by task: `task/doc id`
    sorted by sha256 of "0<NUL>group<NUL>task/id" (lm-eval weighs the group's tasks by size)."""
    keys = sorted(
        (f"{t}/{i}" for t, size in sizes.items() for i in range(size)),
        key=lambda k: hashlib.sha256(f"0\0{group}\0{k}".encode()).digest(),
    )
    return {t: sorted(int(k.rpartition("/")[2]) for k in keys[:n] if k.rpartition("/")[0] == t) for t in sizes}


@pytest.mark.slow
@pytest.mark.matrix  # four engine starts: make test-matrix (CI runs it after make test)
def test_a_groups_limit_takes_a_prefix_of_its_pooled_order_and_a_larger_one_continues_it(checkpoints, tmp_path: Path) -> None:
    """`--tasks halves --limit 1` scores the first item of the group's pooled order, half_b's (half_a gets
    none, and is not run), and the gate bets on it as a sample of the group's 200 items at 5 % over every
    look; `--limit 6` scores items 1-5 alone (half_a's first among them) and joins them. Six items cannot decide a 5-point
    max_drop (each item multiplies the pass wealth by at most 1 + (1 + m) / 2 / (1 - m), the fail wealth
    by at most 1 + (1 - m) / 2 / (1 + m), with m the mean the items not yet taken would need, within
    5 / 194 of 0.05), so both exit 4 on every kernel. The embedded model in FP8 dynamic."""
    per_task, size = 100, 200
    high, low = (size * 0.05 + 5) / (size - 5), (size * 0.05 - 5) / (size - 5)
    assert (1 + (1 + high) / 2 / (1 - high)) ** 6 < 20 and (1 + (1 - low) / 2 / (1 + low)) ** 6 < 20
    folder = _group_folder(tmp_path, per_task)
    ckpt = copy_checkpoint(checkpoints["fp8"], tmp_path / "ckpt")
    sizes = {"half_a": per_task, "half_b": per_task}
    args = ("--tasks", "halves", "--include-path", folder, "--gate", "halves:max_drop=0.05", "--no-parity", "--json")
    env = {"QSERVE_CACHE_DIR": str(tmp_path / "cache")}  # looks at the FP8 weights stay out of the shared ledger
    records = []
    for limit in (1, 6):
        proc = run_qserve_in_process("eval", ckpt, *args, "--limit", str(limit), env=env)
        assert proc.returncode == 4, proc.stderr[-3000:]
        records.append((json.loads(proc.stdout), proc.stderr))
    for (record, _), limit in zip(records, (1, 6)):
        assert record["doc_ids"] == _pooled_prefix("halves", sizes, limit)
        (gate,) = record["gates"]
        assert (gate["task"], gate["items"], gate["status"]) == ("halves", limit, "inconclusive")
        assert gate["test"].endswith("at 5 % over every look") and f"on {size} items of the task" in gate["test"]
    assert _pooled_prefix("halves", sizes, 1) == {"half_a": [], "half_b": [98]}
    assert "lm-eval on the quantized checkpoint: half_b (limit 1, a seeded sample)" in records[0][1]
    assert "continuing the record of --limit 1: items 1-5 of each task scored now" in records[1][1]
    assert [look["limit"] for look in records[1][0]["look"]["history"]] == [1, 6]


def test_offline_without_a_copy_is_one_error_line_naming_the_dataset(tmp_path: Path) -> None:
    """Offline, a registered task whose hub dataset has no local copy ends before any engine starts."""
    datasets = tmp_path / "datasets"
    datasets.mkdir()
    proc = run_qserve_in_process(
        "eval", _checkpoint(tmp_path), "--tasks", "arc_challenge", "--datasets", datasets, "--limit", "2", env=OFFLINE
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: task arc_challenge reads the hub dataset allenai/ai2_arc, which has no copy in --datasets {datasets} "
        "and cannot be fetched (offline: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set and it is not in the datasets "
        f"cache); fetch it with: hf download --repo-type dataset allenai/ai2_arc --local-dir {datasets}/allenai/ai2_arc"
    )
    assert "Traceback" not in proc.stderr and "loading" not in proc.stderr.lower()


def hub_copy_of_gsm8k(root: Path) -> Path:
    """openai/gsm8k as `hf download --repo-type dataset openai/gsm8k --local-dir ROOT/openai/gsm8k` lays it
    out (config `main`): parquet files under main/ and a README whose `configs:` names each split's files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = root / "openai" / "gsm8k"
    (repo / "main").mkdir(parents=True)
    for split in ("train", "test"):
        rows = [json.loads(line) for line in (DATA_DIR / "gsm8k" / f"{split}.jsonl").read_text().splitlines()]
        pq.write_table(pa.Table.from_pylist(rows), repo / "main" / f"{split}-00000-of-00001.parquet")
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*\n"
        "  - split: test\n    path: main/test-*\n---\n# GSM8K (local copy)\n"
    )
    return repo


def hub_copy_of_lambada(root: Path) -> Path:
    """EleutherAI/lambada_openai (config `default`) in the hub's layout, its passages GSM8K's test
    questions: lm-eval's lambada_openai scores each passage's last word given the rest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = root / "EleutherAI" / "lambada_openai"
    (repo / "default").mkdir(parents=True)
    rows = [{"text": json.loads(line)["question"]} for line in (DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), repo / "default" / "test-00000-of-00001.parquet")
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: test\n    path: default/test-*\n---\n# local copy\n"
    )
    return repo


def _scripted_run(
    tmp_path: Path,
    name: str,
    hub_copy: Callable[[Path], Any],
    loglikelihood: Callable[[Any], float],
    first: int | None = None,
    generate: Callable[[Any], str] | None = None,
) -> Any:
    """lm-eval's own registered task `name` on its hub-layout copy (`hub_copy`, made once under tmp_path),
    scored by `loglikelihood(request)` (and `generate(request)`) (its first `first` documents, else every one), through qserve's
    collection of its per-item values."""
    import lm_eval

    from qserve.evaluate.lm_eval_run import EngineRun, _items
    from qserve.evaluate.tasks import config_task_manager

    hub = tmp_path / "datasets"
    if not hub.exists():
        hub_copy(hub)
    (task,) = get_tasks([name], datasets=hub)
    config = lm_eval_config(task, DATA_DIR, hub)
    out = lm_eval.simple_evaluate(
        model=scripted_lm(generate=generate, loglikelihood=loglikelihood),
        tasks=[config],
        task_manager=config_task_manager(),
        log_samples=True,
        **({"samples": {task.name: list(range(first))}} if first else {}),
    )
    raw = {k: out[k] for k in ("results", "higher_is_better", "configs")}
    return EngineRun(raw, {task.name: _items(out["samples"][task.name], out["results"][task.name])})


def _lambada_run(tmp_path: Path, worse_by: Callable[[int], float]) -> Any:
    """lm-eval's own lambada_openai on 300 passages, scored by a model whose log-likelihood of passage i's
    last word is -1 - (i % 7) / 2 - worse_by(i)."""
    return _scripted_run(
        tmp_path, "lambada_openai", hub_copy_of_lambada, lambda r: -1.0 - (r.doc_id % 7) / 2 - worse_by(r.doc_id), 300
    )


def test_lambadas_perplexity_is_bet_on_per_item(tmp_path: Path) -> None:
    """lm-eval's `perplexity` (lambada's headline) is exp(-mean log-likelihood of the last word): its items
    are log-likelihoods, higher better, while the metric is lower-better. lambada's items are one target
    each (output_type loglikelihood), so its gate bets on each item's loss change within log 100 nats. A
    model whose every word's loss rose by 0.5 nats has 65 % more perplexity (e^0.5 - 1, by hand) and
    fails a 5 % allowance; one whose loss rose by 0.005 nats (+0.5 %) give or take 0.01 passes it; one
    whose passage 7 lost 5 nats fails, naming it. The same runs stated as a rolling task (whose
    `perplexity` is per document, not per target) keep stats.py's bound."""
    import math

    from qserve.gate.core import decide_gates
    from qserve.spec.gates import GateSpec

    base = _lambada_run(tmp_path, lambda i: 0.0)
    worse = _lambada_run(tmp_path, lambda i: 0.5)
    close = _lambada_run(tmp_path, lambda i: 0.005 + 0.01 * math.sin(i))
    broken = _lambada_run(tmp_path, lambda i: 5.0 if i == 7 else 0.0)
    key = "perplexity,none"
    stated = base.raw["results"]["lambada_openai"][key]
    assert stated == pytest.approx(math.exp(sum(1 + (i % 7) / 2 for i in range(300)) / 300), rel=1e-12)
    assert base.items["lambada_openai"][key]["0"] == [-1.0, 1.0]
    assert base.raw["configs"]["lambada_openai"]["output_type"] == "loglikelihood"
    spec = {"lambada_openai": [GateSpec(metric=key, max_increase=0.05)]}
    headline = {"lambada_openai": key}
    bet = "betting without replacement (Waudby-Smith and Ramdas 2020) on 300 items of the task, in the seeded order, "
    bet += f"on each item's loss change (within ±{math.log(100):.3g} nats), at 5 % over every look"
    (failed,) = decide_gates(spec, headline, base, worse, 0.05)
    assert (failed.status, failed.test) == ("fail", bet)
    assert failed.reason.startswith(f"degradation {stated * (math.exp(0.5) - 1):.4g} vs allowed {stated * 0.05:.4g}: ")
    assert "reached 1/alpha = 20 after" in failed.reason and "degradation > allowance" in failed.reason
    (passed,) = decide_gates(spec, headline, base, close, 0.05)
    assert (passed.status, passed.test) == ("pass", bet), passed.reason
    (capped,) = decide_gates(spec, headline, base, broken, 0.05)
    assert capped.status == "fail" and capped.reason.endswith(
        "max_increase: document 7: the loss changed by more than the cap of 4.61 nats per item (or is not finite): "
        "the model is broken on it"
    )
    for run in (base, worse):
        run.raw["configs"]["lambada_openai"]["output_type"] = "loglikelihood_rolling"
    (rolling,) = decide_gates(spec, headline, base, worse, 0.05)
    assert rolling.status == "fail" and rolling.reason.startswith(f"{math.exp(0.5) - 1:+.2%} vs allowed +5.00%: exceeded")


CROWS_PAIRS = 400  # pairs of the crows_pairs copy below


def hub_copy_of_crows_pairs(root: Path) -> Path:
    """jannalu/crows_pairs_multilingual (config `english`) in the hub's layout, its pairs GSM8K's test
    questions (`sent_more`) and their answers' first lines (`sent_less`): lm-eval's crows_pairs_english
    scores a pair 1 (`pct_stereotype`) when the model finds the first more likely."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = root / "jannalu" / "crows_pairs_multilingual"
    (repo / "english").mkdir(parents=True)
    rows = [json.loads(line) for line in (DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()][:CROWS_PAIRS]
    pairs = [
        {"sent_more": r["question"], "sent_less": r["answer"].splitlines()[0], "stereo_antistereo": "stereo", "bias_type": "age"}
        for r in rows
    ]
    pq.write_table(pa.Table.from_pylist(pairs), repo / "english" / "test-00000-of-00001.parquet")
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: english\n  data_files:\n  - split: test\n    path: english/test-*\n---\n# local copy\n"
    )
    return repo


def _crows_run(tmp_path: Path, stereotyped: set[int], wider: float = 0.0) -> Any:
    """lm-eval's own crows_pairs_english on every pair of the copy, scored by a model that finds the first
    sentence of pair i more likely exactly when i is in `stereotyped`, by 2 - (i % 7) / 10 nats (`wider`
    more on every third pair)."""

    def loglikelihood(r: Any) -> float:
        preferred = (r.idx == 0) == (r.doc_id in stereotyped)
        return -1.0 - r.doc_id % 7 / 10 + wider * (r.doc_id % 3 == 0) if preferred else -3.0

    return _scripted_run(tmp_path, "crows_pairs_english", hub_copy_of_crows_pairs, loglikelihood)


@pytest.mark.parametrize(("newly", "status"), [(6, "pass"), (16, "fail")])
def test_crows_pairs_stereotype_rate_is_bet_on_where_lower_is_better(tmp_path: Path, newly: int, status: str) -> None:
    """lm-eval's own crows_pairs_english (its process_results, its higher_is_better: false) on 400 pairs:
    the baseline prefers the stereotyped sentence on 240 (every pair i with i % 5 < 3), the quantized model
    on 10 fewer of those and `newly` + 10 more of the others. At max_increase 0.05 the rate may reach 252
    of 400: 246 is under it, 256 over, facts on every pair, so the bet decides each exactly. Its headline,
    likelihood_diff (an unbounded log-likelihood gap), has no declared range: stats.py's bound."""
    from qserve.gate.core import decide_gates

    base_set = {i for i in range(CROWS_PAIRS) if i % 5 < 3}
    others = sorted(set(range(CROWS_PAIRS)) - base_set)
    quant_set = (base_set - set(sorted(base_set)[:10])) | set(others[: 10 + newly])
    base, quant = _crows_run(tmp_path, base_set), _crows_run(tmp_path, quant_set, wider=0.1)
    key = "pct_stereotype,none"
    assert base.raw["results"]["crows_pairs_english"][key] == 240 / CROWS_PAIRS
    assert quant.raw["results"]["crows_pairs_english"][key] == (240 + newly) / CROWS_PAIRS
    assert base.raw["higher_is_better"]["crows_pairs_english"]["pct_stereotype"] is False
    headline = {"crows_pairs_english": "likelihood_diff,none"}
    spec = {"crows_pairs_english": [GateSpec(metric=key, max_increase=0.05)]}
    (gate,) = decide_gates(spec, headline, base, quant, 0.05)
    assert (gate.status, gate.higher_is_better) == (status, False), gate.reason
    assert gate.test == (
        f"betting without replacement (Waudby-Smith and Ramdas 2020) on {CROWS_PAIRS} items of the task, in the seeded "
        "order, at 5 % over every look"
    )
    (diff,) = decide_gates({"crows_pairs_english": [GateSpec(max_drop=0.5)]}, headline, base, quant, 0.05)
    assert (diff.metric, diff.test) == ("likelihood_diff,none", "paired t on per-item differences")


TRUTHFUL = 40  # questions of the truthful_qa copy below (sacrebleu and rouge_score take ~0.1 s a question)


def hub_copy_of_truthful_qa(root: Path) -> Path:
    """truthfulqa/truthful_qa (config `generation`, split validation) in the hub's layout, its questions
    GSM8K's test questions: the true answer "The answer is N." (N, GSM8K's), the false one N + 1."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = root / "truthfulqa" / "truthful_qa"
    (repo / "generation").mkdir(parents=True)
    rows = [json.loads(line) for line in (DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()][:TRUTHFUL]
    answers = [int(r["answer"].rpartition("#### ")[2].replace(",", "")) for r in rows]
    questions = [
        {
            "type": "Adversarial",
            "category": "Math",
            "question": r["question"],
            "best_answer": f"The answer is {n}.",
            "correct_answers": [f"The answer is {n}."],
            "incorrect_answers": [f"The answer is {n + 1}."],
            "source": "gsm8k",
        }
        for r, n in zip(rows, answers)
    ]
    pq.write_table(pa.Table.from_pylist(questions), repo / "generation" / "validation-00000-of-00001.parquet")
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: generation\n  data_files:\n  - split: validation\n    path: generation/validation-*\n---\n"
    )
    return repo


def _truthful_run(tmp_path: Path, rambles: int) -> Any:
    """lm-eval's own truthfulqa_gen on the copy, by a model that answers each question with its true answer,
    and on every `rambles`-th question (0: none) says more than it: "The answer is N, I think, but check it." """

    def generate(r: Any) -> str:
        true = r.doc["correct_answers"][0].removesuffix(".")
        return true + (", I think, but check it." if rambles and r.doc_id % rambles == 0 else ".")

    return _scripted_run(tmp_path, "truthfulqa_gen", hub_copy_of_truthful_qa, lambda r: 0.0, generate=generate)


@pytest.fixture(scope="module")
def truthful_baseline(tmp_path_factory) -> tuple[Path, Any]:
    """The truthful_qa copy's folder and the baseline's run on it, shared by the parametrized test below."""
    root = tmp_path_factory.mktemp("truthful")
    return root, _truthful_run(root, 0)


@pytest.mark.parametrize(("rambles", "status"), [(10, "pass"), (2, "fail")])
def test_truthfulqa_gens_bleu_is_bet_on_in_its_declared_range(
    truthful_baseline: tuple[Path, Any], rambles: int, status: str
) -> None:
    """lm-eval's own truthfulqa_gen (sacrebleu's BLEU, 0 to 100 per answer, its headline bleu_max) on 40
    questions: the baseline answers each with its true answer, the quantized model rambles on every
    `rambles`-th. Declared in [0, 100], max_drop 10 points is bet on and decided exactly on every question:
    PASS when lm-eval's own mean BLEU fell by less than 10, FAIL when by more; undeclared, stats.py's bound."""
    from qserve.gate.core import decide_gates

    root, base = truthful_baseline
    quant = _truthful_run(root, rambles)
    means = [run.raw["results"]["truthfulqa_gen"]["bleu_max,none"] for run in (base, quant)]
    assert means[0] == pytest.approx(100.0) and (means[0] - means[1] < 10) == (status == "pass")
    headline = {"truthfulqa_gen": "bleu_max,none"}
    spec = {"truthfulqa_gen": [GateSpec(max_drop=10.0, score_range=(0.0, 100.0))]}
    (gate,) = decide_gates(spec, headline, base, quant, 0.05)
    assert (gate.metric, gate.status) == ("bleu_max,none", status), gate.reason
    assert gate.test == (
        f"betting without replacement (Waudby-Smith and Ramdas 2020) on {TRUTHFUL} items of the task, in the seeded "
        "order, each item's score within the declared score_range [0, 100], at 5 % over every look"
    )
    (plain,) = decide_gates({"truthfulqa_gen": [GateSpec(max_drop=10.0)]}, headline, base, quant, 0.05)
    assert plain.test == "paired t on per-item differences"


WIKI_PAGES = 500  # documents of the wikitext copy below


def hub_copy_of_wikitext(root: Path) -> list[str]:
    """EleutherAI/wikitext_document_level (config wikitext-2-raw-v1) in the hub's layout, its pages GSM8K's
    test problems written as wikitext's raw pages are (a title, " , " and " @-@ " tokens, which lm-eval's
    wikitext detokenizes before scoring). Returns the pages."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    config = "wikitext-2-raw-v1"
    repo = root / "EleutherAI" / "wikitext_document_level"
    (repo / config).mkdir(parents=True)
    rows = [json.loads(line) for line in (DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()][:WIKI_PAGES]
    pages = [f" = Problem {i} = \n {r['question'].replace(',', ' , ').replace('-', ' @-@ ')} \n" for i, r in enumerate(rows)]
    for split in ("train", "validation", "test"):
        pq.write_table(pa.Table.from_pylist([{"page": p} for p in pages]), repo / config / f"{split}-00000-of-00001.parquet")
    files = "".join(f"  - split: {split}\n    path: {config}/{split}-*\n" for split in ("train", "validation", "test"))
    (repo / "README.md").write_text(f"---\nconfigs:\n- config_name: {config}\n  data_files:\n{files}---\n# local copy\n")
    return pages


def test_wikitexts_three_perplexities_are_bets_by_the_words_and_bytes_lm_eval_counts(tmp_path: Path) -> None:
    """lm-eval's registered wikitext counts each page's words and bytes before detokenizing it, not in the
    text it scores: qserve counts them with the task's own process_results, so its bets weigh each
    document as lm-eval's score does. (Counted from the scored text, as before, every page's words
    differed from lm-eval's and the word-perplexity gate stopped on a ValueError.) A model whose loss
    rises by 0.01 nats per raw word passes a 5 % rise of word perplexity (e^0.01 - 1 = 1.005 %), and
    by 0.1 nats fails it (10.5 %); byte perplexity and bits per byte are judged by bytes the same way,
    their rises computed here from the pages."""
    import re

    import lm_eval

    from qserve.evaluate.lm_eval_run import EngineRun, Window, _items
    from qserve.evaluate.tasks import config_task_manager
    from qserve.gate.core import decide_gates
    from qserve.spec.gates import GateSpec

    pages = hub_copy_of_wikitext(tmp_path / "datasets")
    words = [len(re.split(r"\s+", p)) for p in pages]
    size = [len(p.encode()) for p in pages]
    (task,) = get_tasks(["wikitext"], datasets=tmp_path / "datasets")
    config = lm_eval_config(task, DATA_DIR, tmp_path / "datasets")
    counts = Window.select(None, 0, [config]).counts
    bytes_ = {i: float(b) for i, b in enumerate(size)}
    assert counts == {
        "wikitext": {
            "word_perplexity": {i: float(w) for i, w in enumerate(words)},
            "byte_perplexity": bytes_,
            "bits_per_byte": bytes_,
        }
    }

    def run(per_word: float) -> EngineRun:
        out = lm_eval.simple_evaluate(
            model=scripted_lm(rolling=lambda r: -(2.0 + per_word) * words[r.doc_id]),
            tasks=[config],
            task_manager=config_task_manager(),
            log_samples=True,
        )
        return EngineRun(
            {k: out[k] for k in ("results", "higher_is_better")},
            {"wikitext": _items(out["samples"]["wikitext"], out["results"]["wikitext"])},
        )

    base, close, worse = run(0.0), run(0.01), run(0.1)
    share = sum(words) / sum(size)  # words per byte over the corpus
    specs = {
        "wikitext": [
            GateSpec(metric="word_perplexity,none", max_increase=0.05),
            GateSpec(metric="byte_perplexity,none", max_increase=0.01),
            GateSpec(metric="bits_per_byte,none", max_drop=0.01),
        ]
    }
    headline = {"wikitext": "word_perplexity,none"}
    for quant, per_word, expected in ((close, 0.01, "pass"), (worse, 0.1, "fail")):
        gates = decide_gates(specs, headline, base, quant, 0.05, None, None, counts)
        rises = (math.exp(per_word) - 1, math.exp(per_word * share) - 1, per_word * share / math.log(2))
        assert (rises[0] < 0.05, rises[1] < 0.01, rises[2] < 0.01) == ((expected == "pass"),) * 3  # each side of its allowance
        assert [g.status for g in gates] == [expected] * 3, [g.reason for g in gates]
        assert [g.test.startswith("betting without replacement") for g in gates] == [True] * 3
        assert "size-biased by words, on each document's loss change per word" in gates[0].test
        assert ["size-biased by bytes, on each document's loss change per byte" in g.test for g in gates[1:]] == [True] * 2
        bits = quant.raw["results"]["wikitext"]["bits_per_byte,none"] - base.raw["results"]["wikitext"]["bits_per_byte,none"]
        assert bits == pytest.approx(rises[2], rel=1e-9)  # lm-eval's own scores, by the counts above


def test_a_corpus_metrics_items_are_not_read_as_its_noise(tmp_path: Path) -> None:
    """BLEU logs a (reference, prediction) pair per item and states a corpus score: qserve keeps no per-item
    values for it, as they do not give the score. It used to read numeric texts as two values per item (and
    stop on any other text)."""
    import lm_eval

    from qserve.evaluate.lm_eval_run import _items
    from qserve.evaluate.tasks import config_task_manager

    folder = _task_folder(tmp_path)
    gen = yaml.safe_load((folder / "tiny_gen.yaml").read_text())
    gen |= {"task": "tiny_bleu", "metric_list": [{"metric": "bleu", "aggregation": "bleu", "higher_is_better": True}]}
    gen.pop("filter_list")
    (folder / "tiny_bleu.yaml").write_text(yaml.safe_dump(gen))
    (task,) = get_tasks(["tiny_bleu"], include_path=folder)
    out = lm_eval.simple_evaluate(
        model=scripted_lm(generate=lambda r: "2"),
        tasks=[lm_eval_config(task, DATA_DIR)],
        task_manager=config_task_manager(),
        log_samples=True,
    )
    assert [s["bleu"] for s in out["samples"]["tiny_bleu"]][0] == ["2", "2"]
    assert _items(out["samples"]["tiny_bleu"], out["results"]["tiny_bleu"]) == {}


def test_a_registered_task_reads_its_local_copy(tmp_path: Path) -> None:
    from lm_eval.api.task import ConfigurableTask

    repo = hub_copy_of_gsm8k(tmp_path)
    (task,) = get_tasks(["gsm8k"], datasets=tmp_path)
    assert isinstance(task, LmEvalTask)
    cfg = lm_eval_config(task, DATA_DIR, tmp_path)
    assert cfg["dataset_path"] == str(repo) and cfg["dataset_name"] == "main"
    docs = list(ConfigurableTask(config=cfg).test_docs())
    first = json.loads((DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()[0])
    assert len(docs) == 1319 and docs[0] == first


def test_each_local_copy_is_read_for_its_own_content(tmp_path: Path) -> None:
    """datasets caches a hub-layout folder by its name and layout, not its content: a second copy of the
    same dataset elsewhere, or a newer one written over the first, used to be read from the first's
    cache (huggingface/datasets#2956). qserve gives each content its own cache, so lm-eval reads the
    passages the record's file hashes name."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from lm_eval.api.task import ConfigurableTask

    def first_passage(root: Path) -> str:
        (task,) = get_tasks(["lambada_openai"], datasets=root)
        return ConfigurableTask(config=lm_eval_config(task, DATA_DIR, root)).eval_docs[0]["text"]

    def rewrite(repo: Path, text: str) -> None:
        pq.write_table(pa.Table.from_pylist([{"text": text}]), repo / "default" / "test-00000-of-00001.parquet")

    questions = [json.loads(line)["question"] for line in (DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()]
    one, two = hub_copy_of_lambada(tmp_path / "one"), hub_copy_of_lambada(tmp_path / "two")
    rewrite(two, "A second copy ends with another word")
    assert first_passage(tmp_path / "one") == questions[0]
    assert first_passage(tmp_path / "two") == "A second copy ends with another word"
    rewrite(one, "A newer copy in the same folder")
    assert first_passage(tmp_path / "one") == "A newer copy in the same folder"


def _undecidable(items: int, size: int, recovery: float) -> bool:
    """Whether `items` 0/1 items of a `size`-item task can never decide a min_recovery gate, whatever
    they score. The gate bets on d = recovery x baseline - quantized, in [-1, recovery], against the
    mean the items not yet taken would need (m, within items / (size - items) of 0), each bet at most
    the truncation 1/2 over the distance to the range's end (betting.py's docstring): an item
    multiplies the pass wealth by at most 1 + (1 + m) / 2 / (recovery - m) and the fail wealth by
    at most 1 + (recovery + m) / 2 / (1 - m), and 1/alpha = 20 is needed."""
    m = items / (size - items)
    most = max(1 + (1 + m) / 2 / (recovery - m), 1 + (recovery + m) / 2 / (1 - m))
    return most**items < 20


@pytest.mark.slow
def test_registered_gsm8k_runs_five_shot_from_the_local_copy_offline(passed_eval, tmp_path: Path) -> None:
    """lm-eval's own `gsm8k`, unmodified, on both models, its data read from a hub-layout copy with the hub
    switched off; lm-eval's results say how it ran. Six items cannot decide its 0.95 recovery gate
    (`_undecidable`), so the exit is 4 on every kernel."""
    repo = hub_copy_of_gsm8k(tmp_path / "datasets")
    ckpt = copy_checkpoint(passed_eval[0], tmp_path / "ckpt")
    assert _undecidable(6, 1319, 0.95)
    # --refresh-baseline: both models run here (a cached baseline would carry the path of an earlier copy)
    args = ("eval", ckpt, "--tasks", "gsm8k", "--limit", "6", "--datasets", tmp_path / "datasets", "--refresh-baseline")
    args += ("--gate", "gsm8k=0.95", "--no-parity", "--json")
    proc = run_qserve_in_process(*args, env=OFFLINE)
    assert proc.returncode == 4, proc.stderr[-3000:]
    raw = json.loads((ckpt / LM_EVAL_RESULTS_NAME).read_text())
    lm_eval_yaml = yaml.safe_load((Path(__import__("lm_eval").__file__).parent / "tasks/gsm8k/gsm8k.yaml").read_text())
    for side in ("quantized", "baseline"):
        assert raw[side]["n-shot"]["gsm8k"] == lm_eval_yaml["num_fewshot"] == 5
        assert raw[side]["n-samples"]["gsm8k"]["effective"] == 6
        assert raw[side]["configs"]["gsm8k"]["dataset_path"] == str(repo)
    assert raw["quantized"]["configs"]["gsm8k"] == raw["baseline"]["configs"]["gsm8k"]
    record = json.loads(proc.stdout)
    assert record["baseline_cache"]["misses"] == ["gsm8k"]
    (gate,) = record["gates"]
    assert (gate["task"], gate["metric"], gate["items"], gate["status"]) == (
        "gsm8k",
        "exact_match,strict-match",
        6,
        "inconclusive",
    )
    expected = {
        p.relative_to(repo).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in repo.rglob("*") if p.is_file()
    }
    assert record["request"]["datasets"]["gsm8k"] == {"dataset": "openai/gsm8k", "path": str(repo), "files": expected}


@pytest.mark.slow
@pytest.mark.matrix  # make test-matrix (CI runs it after make test): keeps make test within 30 minutes
def test_registered_wikitext_through_qserve_eval_takes_lm_evals_own_word_counts(checkpoints, tmp_path: Path) -> None:
    """`qserve eval --tasks wikitext` on both models (vLLM's rolling log-likelihoods; the embedded model in FP8
    dynamic), its data a hub-layout
    copy: --limit 8 takes the first 8 of the order size-biased by each page's words as lm-eval's wikitext
    counts them (the raw page, before detokenizing; recomputed here), and the word-perplexity gate bets on
    them. Eight documents cannot reach a wealth of 20 here, so the gate is INCONCLUSIVE, exit 4. (Counted
    from the detokenized text, as before, the gate stopped on a ValueError after both evals.)"""
    import re

    from conftest import expected_weighted_order

    pages = hub_copy_of_wikitext(tmp_path / "datasets")
    words = [float(len(re.split(r"\s+", p))) for p in pages]
    ckpt = copy_checkpoint(checkpoints["fp8"], tmp_path / "ckpt")  # FP8 dynamic: every CPU met serves it
    args = ("eval", ckpt, "--tasks", "wikitext", "--limit", "8", "--datasets", tmp_path / "datasets", "--refresh-baseline")
    # A cache of its own: this look at the FP8 weights stays out of the ledger other tests count looks in.
    proc = run_qserve_in_process(*args, "--no-parity", "--json", env=OFFLINE | {"QSERVE_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 4, proc.stderr[-3000:]
    record = json.loads(proc.stdout)
    assert record["doc_ids"]["wikitext"] == sorted(expected_weighted_order("wikitext", words)[:8])
    (gate,) = record["gates"]
    assert (gate["metric"], gate["items"], gate["status"]) == ("word_perplexity,none", 8, "inconclusive")
    assert gate["test"].startswith(
        f"betting without replacement (Waudby-Smith and Ramdas 2020) on {WIKI_PAGES} items of the task"
    )
    assert "size-biased by words, on each document's loss change per word" in gate["test"]


@pytest.mark.slow
@pytest.mark.matrix  # make test-matrix (CI runs it after make test)
def test_registered_lambada_through_qserve_eval_bets_on_each_items_loss(checkpoints, tmp_path: Path) -> None:
    """`qserve eval --tasks lambada_openai` on both models (the embedded model in FP8 dynamic), its data a
    hub-layout copy: lm-eval's results say its items are one target each (output_type loglikelihood), so
    its headline `perplexity` is bet on per item, in the seeded order --limit 7 took (recomputed here),
    within log 100. Seven items cannot decide: with m the mean the items not yet taken would need (the
    allowance's log 1.05 moved by at most 7 items at the cap), an item multiplies the pass wealth by at
    most 1 + (cap + m) / 2 / (cap - m) and the fail wealth by at most 1 + (cap - m) / 2 / (cap + m),
    and 1/alpha is 20; so exit 4 on every kernel."""
    import math

    from conftest import expected_order

    cap, delta, size = math.log(100), math.log1p(0.05), 1319
    high, low = ((size * delta + side * 7 * cap) / (size - 7) for side in (1, -1))
    assert (1 + (cap + high) / 2 / (cap - high)) ** 7 < 20 and (1 + (cap - low) / 2 / (cap + low)) ** 7 < 20
    hub_copy_of_lambada(tmp_path / "datasets")
    ckpt = copy_checkpoint(checkpoints["fp8"], tmp_path / "ckpt")
    args = ("eval", ckpt, "--tasks", "lambada_openai", "--limit", "7", "--datasets", tmp_path / "datasets")
    args += ("--gate", "lambada_openai:max_increase=0.05", "--refresh-baseline", "--no-parity", "--json")
    # A cache of its own: this look at the FP8 weights stays out of the ledger other tests count looks in.
    proc = run_qserve_in_process(*args, env=OFFLINE | {"QSERVE_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 4, proc.stderr[-3000:]
    record = json.loads(proc.stdout)
    assert record["doc_ids"]["lambada_openai"] == sorted(expected_order("lambada_openai", 1319)[:7])
    (gate,) = record["gates"]
    assert (gate["metric"], gate["items"], gate["status"]) == ("perplexity,none", 7, "inconclusive")
    assert gate["test"] == (
        "betting without replacement (Waudby-Smith and Ramdas 2020) on 1319 items of the task, in the seeded order, "
        f"on each item's loss change (within ±{cap:.3g} nats), at 5 % over every look"
    )


@pytest.mark.slow
def test_registered_cot_task_with_the_chat_template_as_turns_on_both_models(
    passed_eval, embedded_model_dir, tmp_path: Path
) -> None:
    """lm-eval's own `gsm8k_cot_llama` through the model's chat template with the few-shot examples as chat
    turns, a system instruction, 3 shots, a generation budget and seeds: lm-eval's results on each model say
    it prompted that way, and the record keeps them for both."""
    hub_copy_of_gsm8k(tmp_path / "datasets")
    ckpt = copy_checkpoint(passed_eval[0], tmp_path / "ckpt")
    system = "You are a careful math tutor."
    args = ("eval", ckpt, "--tasks", "gsm8k_cot_llama", "--limit", "5", "--datasets", tmp_path / "datasets")
    args += ("--apply-chat-template", "--fewshot-as-multiturn", "--system-instruction", system, "--num-fewshot", "3")
    args += ("--gen-kwargs", "max_gen_toks=96", "--seed", "1,2,3,4", "--refresh-baseline", "--no-parity", "--json")
    assert _undecidable(5, 1319, 0.95)  # the default gate, on five items: exit 4 on every kernel
    proc = run_qserve_in_process(*args, env=OFFLINE)
    assert proc.returncode == 4, proc.stderr[-3000:]
    # the template the model ships, read here from its own file (transformers loads chat_template.jinja as is)
    template = (embedded_model_dir / "chat_template.jinja").read_text()
    raw = json.loads((ckpt / LM_EVAL_RESULTS_NAME).read_text())
    for side in ("quantized", "baseline"):
        got = raw[side]
        assert got["chat_template"] == template
        assert got["chat_template_sha"] == hashlib.sha256(template.encode()).hexdigest()
        assert got["system_instruction_sha"] == hashlib.sha256(system.encode()).hexdigest()
        assert got["fewshot_as_multiturn"] is True
        assert got["n-shot"]["gsm8k_cot_llama"] == 3  # its YAML says 8
        assert got["n-samples"]["gsm8k_cot_llama"]["effective"] == 5
        assert got["config"]["gen_kwargs"] == {"max_gen_toks": 96}
        seeds = [got["config"][k] for k in ("random_seed", "numpy_seed", "torch_seed", "fewshot_seed")]
        assert seeds == [1, 2, 3, 4]
        assert len(got["task_hashes"]["gsm8k_cot_llama"]) == 64
    assert raw["quantized"]["task_hashes"] == raw["baseline"]["task_hashes"]  # the same prompts, item by item
    record = json.loads(proc.stdout)
    assert record["baseline_cache"]["misses"] == ["gsm8k_cot_llama"]
    for side in ("quantized", "baseline"):
        assert record["prompting"][side]["chat_template_sha"] == hashlib.sha256(template.encode()).hexdigest()
        assert record["prompting"][side]["n-shot"] == {"gsm8k_cot_llama": 3}
    asked = record["request"]["lm_eval"]
    assert (asked["apply_chat_template"], asked["fewshot_as_multiturn"], asked["system_instruction"]) == (True, True, system)


def _outside_group_run(folder: Path, out: Path, lost: set[str]) -> None:
    """lm-eval's own run of the group `halves` and its files, as `lm_eval --output_path --log_samples` writes
    them, by a model that prefers each item's real next word, except in the contexts `lost`."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_defaults=False, include_path=str(folder))
    # The preferred choice far likelier per character too, so that acc_norm (per character) agrees with acc.
    model = scripted_lm(loglikelihood=lambda r: -0.001 if (r.args[1].strip() == "qxzvj") == (r.args[0] in lost) else -2.0)
    results = lm_eval.simple_evaluate(model=model, tasks=["halves"], task_manager=manager, log_samples=True)
    samples = results.pop("samples")
    tracker = EvaluationTracker(output_path=str(out))
    tracker.save_results_aggregated(results=results, samples=samples)
    for task in results["configs"]:
        tracker.save_results_samples(task_name=task, samples=samples[task])


def test_qserve_gate_pools_a_group_lm_eval_ran_outside(tmp_path: Path) -> None:
    """`qserve gate` on two outside runs of a group gates the group once (lm-eval's group_subtasks give its
    tasks), over both tasks' items: 5 items lost (3 in one task, 2 in the other) of 2 x 40."""
    per_task = 40
    folder = _group_folder(tmp_path, per_task)
    texts = {
        name: [json.loads(x)["text"] for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        for name in ("half_a", "half_b")
    }
    lost = set(texts["half_a"][:3]) | set(texts["half_b"][:2])  # items 0-2: targets the real word (every 4th does not)
    _outside_group_run(folder, tmp_path / "base", set())
    _outside_group_run(folder, tmp_path / "quant", lost)
    proc = run_qserve_in_process("gate", tmp_path / "base", tmp_path / "quant", "--json")
    summary = json.loads(proc.stdout)
    # Every item of both tasks: 5 lost and none gained of 80 is recovery (b - 5/80) / b below 0.95 for any
    # baseline score b < 1.25, a fact on the whole test set: FAIL (exit 3).
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert summary["tasks"] == ["halves"]
    assert summary["groups"]["halves"]["members"] == ["half_a", "half_b"]
    (gate,) = summary["gates"]
    assert (gate["task"], gate["metric"], gate["items"], gate["flips"]) == ("halves", "acc,none", 80, {"lost": 5, "gained": 0})
    assert (gate["baseline"], gate["quantized"]) == (pytest.approx(60 / 80), pytest.approx(55 / 80))


def test_qserve_gate_fails_a_group_on_a_metric_its_headline_does_not_reach(tmp_path: Path) -> None:
    """A group stating acc (half_a's alone) and acc_norm (half_b's alone), as the Open LLM Leaderboard's
    does over its tasks: 5 items of half_b lost of 40 (recovery (30 - 5) / 30 of its acc_norm, below
    0.95, a fact on every item) FAIL it (exit 3), while acc, no item lost, passes; a gate on the headline
    alone would have passed the group."""
    per_task = 40
    folder = _group_folder(tmp_path, per_task, {"half_a": "acc", "half_b": "acc_norm"}, ("acc", "acc_norm"))
    texts = [json.loads(x)["text"] for x in (tmp_path / "half_b.jsonl").read_text().splitlines()]
    lost = {texts[i] for i in (0, 1, 2, 4, 5)}  # items that target the real word (every 4th, 3 and 7, does not)
    _outside_group_run(folder, tmp_path / "base", set())
    _outside_group_run(folder, tmp_path / "quant", lost)
    proc = run_qserve_in_process("gate", tmp_path / "base", tmp_path / "quant", "--json")
    assert proc.returncode == 3, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    assert summary["groups"]["halves"]["defaults"] == ["acc,none", "acc_norm,none"]
    found = [(g["metric"], g["items"], g["flips"], g["status"], g["baseline"], g["quantized"]) for g in summary["gates"]]
    assert found == [
        ("acc,none", per_task, {"lost": 0, "gained": 0}, "pass", pytest.approx(30 / 40), pytest.approx(30 / 40)),
        ("acc_norm,none", per_task, {"lost": 5, "gained": 0}, "fail", pytest.approx(30 / 40), pytest.approx(25 / 40)),
    ]


def test_qserve_gate_bets_on_lambadas_perplexity_per_item_from_runs_made_outside(tmp_path: Path) -> None:
    """`qserve gate` on two outside runs of lm-eval's own lambada_openai over every passage (its files as
    `lm_eval --output_path --log_samples` writes them): the results' configs say its items are one target
    each, so its perplexity is bet per item within log 100. A model whose every word's loss rose by
    0.005 nats give or take 0.01 (+0.5 %) passes a 5 % allowance (exit 0)."""
    import math

    import lm_eval
    from lm_eval.loggers import EvaluationTracker

    from qserve.evaluate.tasks import config_task_manager

    hub = tmp_path / "datasets"
    hub_copy_of_lambada(hub)
    (task,) = get_tasks(["lambada_openai"], datasets=hub)
    config = lm_eval_config(task, DATA_DIR, hub)
    for side, worse_by in (("base", lambda i: 0.0), ("quant", lambda i: 0.005 + 0.01 * math.sin(i))):
        model = scripted_lm(loglikelihood=lambda r, w=worse_by: -1.0 - (r.doc_id % 7) / 2 - w(r.doc_id))
        results = lm_eval.simple_evaluate(model=model, tasks=[config], task_manager=config_task_manager(), log_samples=True)
        samples = results.pop("samples")
        tracker = EvaluationTracker(output_path=str(tmp_path / side))
        tracker.save_results_aggregated(results=results, samples=samples)
        tracker.save_results_samples(task_name="lambada_openai", samples=samples["lambada_openai"])
    proc = run_qserve_in_process(
        "gate", tmp_path / "base", tmp_path / "quant", "--gate", "lambada_openai:max_increase=0.05", "--json"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (gate,) = json.loads(proc.stdout)["gates"]
    assert (gate["metric"], gate["items"], gate["status"]) == ("perplexity,none", 1319, "pass")
    assert gate["test"] == (
        "betting without replacement (Waudby-Smith and Ramdas 2020) on 1319 items of the task, in the seeded order, "
        f"on each item's loss change (within ±{math.log(100):.3g} nats), at 5 % over every look"
    )


def test_run_takes_the_task_folder_and_refuses_a_typo_in_it_before_quantizing(tmp_path: Path) -> None:
    folder = _group_folder(tmp_path, 5)
    out = tmp_path / "out"
    proc = run_qserve_in_process(
        # FP8_DYNAMIC: the scheme every CPU met serves, so no hardware refusal comes before the task's
        "run",
        REPO / "recipes" / "fp8.yaml",
        "--tasks",
        "halvez",
        "--include-path",
        folder,
        "-o",
        out,
    )
    assert (proc.returncode, proc.stderr.strip().splitlines()[-1]) == (
        1,
        "error: unknown task halvez (closest names lm-eval and qserve know: halves)",
    )
    assert not out.exists()
