"""Eval tasks: qserve's own evals/*.yaml (each an lm-eval task plus where its local data lives, the
offline demo's), and every task lm-eval's TaskManager resolves (registered, or in an --include-path
folder), whose hub datasets are read from local copies (--datasets) when the hub is out of reach."""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from qserve import paths
from qserve.checkpoint.hashing import sha256_file
from qserve.errors import QserveError
from qserve.gate.core import Group, group
from qserve.gate.stats import WEIGHTED
from qserve.paths import project_data
from qserve.progress import info


class TaskDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    lm_eval_task: str | None = None  # start from this registered lm-eval task's config
    config: dict[str, Any] = {}  # lm-eval task config keys (override the base task's)
    data_files: dict[str, str]  # split -> file, relative to the data dir
    metric: str  # "<metric>,<filter>" key in lm-eval's results; which way is better: lm-eval's own higher_is_better


@dataclass(frozen=True)
class LmEvalTask:
    """A task lm-eval's TaskManager resolves, with its complete config from its YAML (functions resolved)
    and its headline metric as lm-eval reports it."""

    name: str
    config: dict[str, Any]
    metric: str
    yaml_path: Path


Task = TaskDef | LmEvalTask


@dataclass(frozen=True)
class Resolved:
    """What --tasks names: the leaf tasks lm-eval runs, the groups gated over their pooled items, and the
    units gated by default (each group and each task named, a tag's tasks)."""

    tasks: list[Task]
    groups: dict[str, Group]
    units: list[str]


def registry(evals_dir: Path | None = None) -> dict[str, TaskDef]:
    folder = evals_dir or project_data("evals")
    out = {}
    for path in sorted(folder.glob("*.yaml")):
        try:
            task = TaskDef.model_validate(yaml.safe_load(path.read_text()))
        except (ValidationError, yaml.YAMLError) as exc:
            raise QserveError(f"eval definition {path} is invalid: {str(exc).splitlines()[0]}") from None
        out[task.name] = task
    return out


def get_tasks(names: list[str], include_path: Path | None = None, datasets: Path | None = None) -> list[Task]:
    """The leaf tasks the names resolve to, in order (resolve_tasks)."""
    return resolve_tasks(names, include_path, datasets).tasks


def resolve_tasks(names: list[str], include_path: Path | None = None, datasets: Path | None = None) -> Resolved:
    """The tasks named, in order: qserve's own eval of that name first, else what lm-eval resolves (a tag
    gives its tasks, a group its leaf tasks and itself). An own eval built on a registered task yields to
    it when `datasets` holds a copy of its hub dataset: the user brought lm-eval's data, so lm-eval's
    task reads it."""
    own = registry()
    builds_on = datasets is not None and any(own[n].lm_eval_task for n in names if n in own)
    index = TaskIndex(include_path) if builds_on or any(n not in own for n in names) else None
    out: dict[str, Task] = {}
    groups: dict[str, Group] = {}
    units: list[str] = []
    unknown = []
    for name in names:
        if name in own and not _yields(own[name], index, datasets):
            out.setdefault(name, own[name])
            units.append(name)
        elif index is not None and name in index.entries:
            leaves = index.resolve(name)
            out.update((t.name, t) for t in leaves if t.name not in out)
            group = index.group(name, leaves)
            if group is not None:
                groups[name] = group
            units += [name] if group is not None else [t.name for t in leaves]
        else:
            unknown.append(name)
    if unknown:  # then the index was built: an unknown name is not qserve's
        known = sorted(set(index.entries) | set(own))
        raise QserveError("; ".join(_unknown(n, known) for n in unknown))
    return Resolved(list(out.values()), groups, list(dict.fromkeys(units)))


def _yields(task: TaskDef, index: TaskIndex | None, datasets: Path | None) -> bool:
    if index is None or datasets is None or task.lm_eval_task not in index.entries:
        return False
    repo = index.resolve(task.lm_eval_task)[0].config.get("dataset_path")
    return isinstance(repo, str) and (datasets / repo).is_dir()


def _unknown(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=5)
    return f"unknown task {name}" + (f" (closest names lm-eval and qserve know: {', '.join(close)})" if close else "")


class TaskIndex:
    """lm-eval's TaskManager index by name (kind, YAML file, a tag's tasks, a group's members): its own
    tasks from a cache file per lm-eval install, since building it parses every YAML it ships (seconds
    on each eval otherwise); an --include-path folder's tasks fresh, over them, as lm-eval orders them."""

    def __init__(self, include_path: Path | None = None) -> None:
        self.entries = dict(_default_entries())
        if include_path is not None:
            if not Path(include_path).is_dir():
                raise QserveError(f"--include-path {include_path} is not a directory")
            from lm_eval.tasks import TaskManager

            self.entries.update(_entries(TaskManager(include_defaults=False, include_path=str(include_path)).task_index))

    def resolve(self, name: str, overrides: dict[str, Any] | None = None) -> list[LmEvalTask]:
        """The leaf tasks `name` stands for, each config with the overrides a group sets on its members (as
        lm-eval's TaskFactory builds them: a member's own over its group's)."""
        entry = self.entries[name]
        if entry["kind"] == "TAG":
            return [t for member in entry["tags"] if member in self.entries for t in self.resolve(member, overrides)]
        if not entry["yaml_path"]:
            raise QserveError(
                f"lm-eval {entry['kind'].lower()} {name} has no YAML config (Python-only); qserve runs tasks from YAML"
            )
        if entry["kind"] == "GROUP":
            path = Path(entry["yaml_path"])
            return self._leaves(name, _load_yaml("group", name, path), overrides or {}, path)
        return [_lm_eval_task(name, Path(entry["yaml_path"]), overrides)]

    def group(self, name: str, leaves: list[LmEvalTask]) -> Group | None:
        """The group gated as one, or None for a tag, a task, or a group lm-eval gives no score of its own
        (no aggregate_metric_list: its tasks are gated one by one, as lm-eval reports them)."""
        entry = self.entries[name]
        if entry["kind"] != "GROUP":
            return None
        from lm_eval.config.group import GroupConfig

        raw = _load_yaml("group", name, Path(entry["yaml_path"]))
        config = GroupConfig(**{k: v for k, v in raw.items() if k in _group_fields()})
        if not config.aggregate_metric_list:
            info(f"note: lm-eval's group {name} has no aggregate score: its {len(leaves)} tasks are gated one by one")
            return None
        aggregate = []
        for agg in config.aggregate_metric_list:
            filters = agg.filter_list or _filters_of(agg.metric, leaves)
            aggregate += [(f"{agg.metric},{f}", bool(agg.weight_by_size)) for f in filters]
        reported = {t.name: set(reported_metrics(t.config)) for t in leaves}
        reporting = {m: [t for t, keys in reported.items() if m in keys] for m, _ in aggregate}
        return group(name, [t.name for t in leaves], aggregate, reporting, {t.name: t.metric for t in leaves})

    def _leaves(self, name: str, raw: dict[str, Any], overrides: dict[str, Any], source: Path) -> list[LmEvalTask]:
        """A group's leaf tasks (`raw`: its YAML, `source`: the file it is in)."""
        fields = _group_fields()
        merged = {k: v for k, v in raw.items() if k not in fields} | overrides
        members = raw.get("task") or []
        out: list[LmEvalTask] = []
        for item in [members] if isinstance(members, (str, dict)) else members:
            if isinstance(item, str):
                out += self.resolve(item, merged)
            elif isinstance(item, dict) and ("group" in item or "task" in item):
                key = "group" if "group" in item else "task"
                base, own = item[key], {k: v for k, v in item.items() if k != key}
                if base in self.entries:
                    out += self.resolve(base, merged | own)
                elif key == "group":
                    out += self._leaves(f"{name}::{base}", item, merged, source)
                else:  # an inline task, named under its group as lm-eval names it
                    cfg = merged | item | {"task": f"{name}::{base}"}
                    out.append(LmEvalTask(cfg["task"], cfg, headline_metric(cfg), source))
            else:
                raise QserveError(f"lm-eval group {name} has a member qserve cannot read: {item!r}")
        return out


def _lm_eval_task(name: str, yaml_path: Path, overrides: dict[str, Any] | None = None) -> LmEvalTask:
    """The task's full config as lm-eval's TaskFactory builds it from the YAML (includes merged,
    `!function` hooks resolved, a group's overrides applied, the index's structural keys dropped)."""
    cfg = _load_yaml("task", name, yaml_path) | (overrides or {})
    for key in ("tag", "group", "task_list"):
        cfg.pop(key, None)
    cfg["task"] = name
    return LmEvalTask(name, cfg, headline_metric(cfg), yaml_path)


def _load_yaml(kind: str, name: str, yaml_path: Path) -> dict[str, Any]:
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        return dict(load_yaml(yaml_path, resolve_func=True))
    except (ImportError, OSError, ValueError, yaml.YAMLError) as exc:  # e.g. a hook's optional dependency is missing
        raise QserveError(f"lm-eval {kind} {name} cannot be loaded from {yaml_path}: {str(exc).splitlines()[0]}") from None


def _group_fields() -> set[str]:
    """A group YAML's own keys (lm-eval's GroupConfig); the rest are overrides for its members."""
    from dataclasses import fields

    from lm_eval.config.group import GroupConfig

    return {f.name for f in fields(GroupConfig)}


def _filters_of(metric: str, leaves: list[LmEvalTask]) -> list[str]:
    """The filter of an aggregate metric that names none: lm-eval then aggregates every filter its tasks
    report the metric under; the headline takes the filter of the first task whose headline is that metric."""
    return [next((t.metric.partition(",")[2] for t in leaves if t.metric.partition(",")[0] == metric), "none")]


def headline_metric(cfg: dict[str, Any]) -> str:
    """The "<metric>,<filter>" key lm-eval reports first (`reported_metrics`)."""
    return reported_metrics(cfg)[0]


def reported_metrics(cfg: dict[str, Any]) -> list[str]:
    """The "<metric>,<filter>" keys a task's results hold, in lm-eval's order: each metric of metric_list
    (else lm-eval's defaults for the output type) under each filter of filter_list ("none" without one)."""
    from lm_eval.api.registry import DEFAULT_METRIC_REGISTRY

    metrics = cfg.get("metric_list") or [{"metric": m} for m in DEFAULT_METRIC_REGISTRY[cfg.get("output_type", "generate_until")]]
    names = [m if isinstance(m, str) else getattr(m, "__name__", str(m)) for m in (x["metric"] for x in metrics)]
    filters = [f["name"] for f in cfg.get("filter_list") or []] or ["none"]
    return [f"{m},{f}" for f in filters for m in names]


@functools.cache
def _default_entries() -> dict[str, dict[str, Any]]:
    """lm-eval's own index, read from the cache (written once per lm-eval install, rebuilt if a file it
    names is gone)."""
    import lm_eval
    import lm_eval.tasks

    root = Path(lm_eval.tasks.__file__).parent
    stamp = f"{getattr(lm_eval, '__version__', '?')}|{root}|{root.stat().st_mtime_ns}"
    path = paths.cache_dir() / "lm_eval_task_index.json"
    try:
        cached = json.loads(path.read_text())
        if cached["stamp"] == stamp and all(Path(e["yaml_path"]).is_file() for e in cached["entries"].values() if e["yaml_path"]):
            return cached["entries"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or stale: rebuilt below
    from lm_eval.tasks import TaskManager

    from qserve.progress import step

    with step("indexing lm-eval's tasks (once per lm-eval install)"):
        entries = _entries(TaskManager().task_index)
    paths.write_json(path, {"stamp": stamp, "entries": entries})
    return entries


def _entries(index: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, e in index.items():
        members = (e.cfg or {}).get("task") if e.kind.name == "GROUP" else None
        out[name] = {
            "kind": e.kind.name,
            "yaml_path": str(e.yaml_path) if e.yaml_path else None,
            "tags": sorted(e.tags) if e.kind.name == "TAG" else [],
            "members": [m if isinstance(m, str) else str(m.get("task") or m.get("group")) for m in members or []],
        }
    return out


def datasets_dir(explicit: str | Path | None = None) -> Path | None:
    """--datasets, else QSERVE_DATASETS_DIR, else none: local copies of hub datasets as DIR/<org>/<name>."""
    chosen = explicit or os.environ.get("QSERVE_DATASETS_DIR")
    return Path(chosen).expanduser().resolve() if chosen else None


def lm_eval_config(task: Task, data_dir: Path, datasets: Path | None = None) -> dict[str, Any]:
    """A complete lm-eval task config dict that reads the task's data from local files: an own eval's
    data files, or a registered task's hub dataset from its copy in `datasets` (else the hub, checked
    reachable now, before any engine starts)."""
    if isinstance(task, LmEvalTask):
        return _registered_config(task, datasets)
    files = {}
    for split, rel in task.data_files.items():
        path = (data_dir / rel).resolve()
        if not path.is_file():
            raise QserveError(
                f"task {task.name} needs {path}, which does not exist (set --data-dir / QSERVE_DATA_DIR; now {data_dir})"
            )
        files[split] = str(path)
    cfg = _lm_eval_task(task.lm_eval_task, _yaml_of(task.lm_eval_task)).config if task.lm_eval_task else {}
    cfg.update(task.config)
    cache = content_cache({split: sha256_file(Path(path)) for split, path in files.items()})
    cfg.update(
        task=task.name, dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": files, "cache_dir": str(cache)}
    )
    return cfg


def _yaml_of(name: str) -> Path:
    entry = TaskIndex().entries.get(name)
    if entry is None or not entry["yaml_path"] or entry["kind"] != "TASK":
        raise QserveError(f"lm-eval has no task named {name!r}")
    return Path(entry["yaml_path"])


def _registered_config(task: LmEvalTask, datasets: Path | None) -> dict[str, Any]:
    cfg = dict(task.config)
    repo = cfg.get("dataset_path")
    if not _on_the_hub(cfg):
        return cfg
    copy = datasets / repo if datasets is not None else None
    if copy is not None and copy.is_dir():
        cfg["dataset_path"] = str(copy)  # datasets.load_dataset reads a hub repo's layout from a folder
        cfg["dataset_kwargs"] = {**(cfg.get("dataset_kwargs") or {}), "cache_dir": str(content_cache(copy_files(copy)))}
        return cfg
    _check_reachable(task.name, repo, cfg.get("dataset_name"), datasets)
    return cfg


def _on_the_hub(cfg: dict[str, Any]) -> bool:
    """Whether the task's data is a hub dataset repository (not a packaged builder such as json, a local
    folder, or a task's own Python loader)."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    repo = cfg.get("dataset_path")
    if not isinstance(repo, str) or cfg.get("custom_dataset") or repo in _PACKAGED_DATASETS_MODULES:
        return False
    return not Path(repo).expanduser().exists()


def _check_reachable(task: str, repo: str, name: str | None, datasets: Path | None) -> None:
    """One error line, before any engine starts, when the dataset is neither copied nor fetchable: lm-eval
    would otherwise fail deep in a run (or wait on the network)."""
    reason = _unreachable(repo, name)
    if reason is None:
        return
    has = f"has no copy in --datasets {datasets}" if datasets is not None else "has no local copy (no --datasets DIR)"
    target = datasets if datasets is not None else "DIR"
    raise QserveError(
        f"task {task} reads the hub dataset {repo}, which {has} and cannot be fetched ({reason}); "
        f"fetch it with: hf download --repo-type dataset {repo} --local-dir {target}/{repo}"
        + ("" if datasets is not None else " and pass --datasets DIR")
    )


def _unreachable(repo: str, name: str | None) -> str | None:
    """Why the hub dataset cannot be loaded now, or None: offline, only from the datasets cache; online,
    the hub must answer for it (a gated one is left to lm-eval and the user's token)."""
    if any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        import datasets

        try:
            datasets.load_dataset_builder(repo, name)
            return None
        except Exception:  # noqa: BLE001 (whatever the cache lookup raises, the data is not there)
            return "offline: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set and it is not in the datasets cache"
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().dataset_info(repo, timeout=10)
    except GatedRepoError:
        return None
    except RepositoryNotFoundError:
        return "the hub has no such dataset"
    except Exception as exc:  # noqa: BLE001 (any network failure: the hub is out of reach)
        return f"the hub is out of reach: {type(exc).__name__}"
    return None


def copy_files(folder: Path) -> dict[str, str]:
    """A local dataset copy's files by content (relative path -> sha256), without hidden entries such as
    the `.cache/` folder `hf download` keeps its own bookkeeping in."""
    files = sorted(
        p for p in folder.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.relative_to(folder).parts)
    )
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in files}


def content_cache(files: dict[str, str]) -> Path:
    """Where datasets caches data qserve hands lm-eval (`files`: name -> sha256): a folder per content in
    qserve's cache. datasets keys a hub-layout folder by its name and layout, and a data file by its path
    and mtime, not by content (huggingface/datasets#2956, #6465): another copy, a newer one in its place,
    or a file rewritten with its old mtime would be read from the first one's cache."""
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return paths.cache_dir() / "datasets" / digest[:16]


def dataset_copies(tasks: list[Task], configs: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """For the record: each registered task that read a local copy, its hub dataset, folder and files."""
    out = {}
    for task in tasks:
        path = configs[task.name].get("dataset_path")
        if isinstance(task, LmEvalTask) and path != task.config.get("dataset_path"):
            out[task.name] = {"dataset": task.config.get("dataset_path"), "path": path, "files": copy_files(Path(path))}
    return out


def config_task_manager() -> Any:
    """The task manager simple_evaluate runs qserve's configs with. qserve hands lm-eval complete
    config dicts, so nothing needs lm-eval's index of its built-in tasks; simple_evaluate's default
    TaskManager() would parse all of them on every call (seconds a run, a large share of a short
    eval). `metadata` is what that default gets when given a model object."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=False, metadata={})


def task_size(config: dict[str, Any]) -> int:
    """How many documents lm-eval evaluates of a task (a complete `lm_eval_config`), read before any model runs."""
    return len(_eval_docs(config))


def task_counts(config: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Each document's words or bytes by the corpus perplexities a rolling log-likelihood task reports
    (word_perplexity: words; byte_perplexity, bits_per_byte: bytes), by lm-eval's doc id, before any
    model runs. Counted by the task's own process_results on a log-likelihood of 0, so a task that counts
    its own way (lm-eval's wikitext counts the page before detokenizing it) is counted as lm-eval will."""
    if config.get("output_type") != "loglikelihood_rolling":
        return {}
    from lm_eval.api.task import ConfigurableTask

    task = ConfigurableTask(config=config)
    out: dict[str, dict[int, float]] = {}
    for i, doc in enumerate(_eval_docs(config, task)):
        for metric, value in task.process_results(doc, [0.0]).items():
            if metric in WEIGHTED and isinstance(value, (tuple, list)) and len(value) == 2:
                out.setdefault(metric, {})[i] = float(value[1])
    return out


def _eval_docs(config: dict[str, Any], task: Any = None) -> list[Any]:
    from lm_eval.api.task import ConfigurableTask

    docs = list((task or ConfigurableTask(config=config)).eval_docs)
    if not docs:
        raise QserveError(f"task {config['task']} has no documents to evaluate")
    return docs
