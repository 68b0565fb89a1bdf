"""The eval task registry: evals/*.yaml, each an lm-eval task plus where its local data lives."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from qserve.errors import QserveError
from qserve.paths import project_data


class TaskDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    lm_eval_task: str | None = None  # start from this registered lm-eval task's config
    config: dict[str, Any] = {}  # lm-eval task config keys (override the base task's)
    data_files: dict[str, str]  # split -> file, relative to the data dir
    metric: str  # "<metric>,<filter>" key in lm-eval's results; which way is better: lm-eval's own higher_is_better


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


def get_tasks(names: list[str]) -> list[TaskDef]:
    known = registry()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise QserveError(f"unknown task {', '.join(unknown)}; available: {', '.join(known)}")
    return [known[n] for n in names]


def lm_eval_config(task: TaskDef, data_dir: Path) -> dict[str, Any]:
    """A complete lm-eval task config dict that reads the task's data from local files."""
    files = {}
    for split, rel in task.data_files.items():
        path = (data_dir / rel).resolve()
        if not path.is_file():
            raise QserveError(
                f"task {task.name} needs {path}, which does not exist (set --data-dir / QSERVE_DATA_DIR; now {data_dir})"
            )
        files[split] = str(path)
    cfg = _base_config(task.lm_eval_task) if task.lm_eval_task else {}
    cfg.update(task.config)
    cfg.update(task=task.name, dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": files})
    return cfg


def _base_config(name: str) -> dict[str, Any]:
    from lm_eval.tasks._yaml_loader import load_yaml

    path = _declaring_yaml(name)
    if path is not None:
        return dict(load_yaml(path, resolve_func=True))
    entry = _lm_eval_task_index().get(name)
    if entry is None or entry.yaml_path is None:
        raise QserveError(f"lm-eval has no task named {name!r}")
    return dict(load_yaml(entry.yaml_path, resolve_func=True))


def _declaring_yaml(name: str) -> Path | None:
    """The one lm-eval task YAML whose own `task:` line is `name`, found by reading the files as text
    (0.2 s here) rather than parsing all 14k of them into lm-eval's index (4-9 s, once per `qserve
    eval`); None when that is not exactly one file, and the index decides."""
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    line = re.compile(rb"^task:[ \t]*['\"]?" + re.escape(name.encode()) + rb"['\"]?[ \t]*$", re.MULTILINE)
    root = Path(lm_eval.tasks.__file__).parent
    found = [p for p in sorted(root.rglob("*.yaml")) if line.search(p.read_bytes())]
    if len(found) != 1 or load_yaml(found[0], resolve_func=False).get("task") != name:
        return None
    return found[0]


@functools.cache
def _lm_eval_task_index() -> dict[str, Any]:
    """lm-eval's index of its own task YAMLs (every file parsed: 4-9 s here), built once per process."""
    from lm_eval.tasks import TaskManager

    return TaskManager().task_index


def config_task_manager() -> Any:
    """The task manager simple_evaluate runs qserve's configs with. qserve hands lm-eval complete
    config dicts, so nothing needs lm-eval's index of its built-in tasks; simple_evaluate's default
    TaskManager() would parse all of them on every call (4.2 s a run here, a fifth of an eval of
    100 gsm8k_ppl documents). `metadata` is what that default gets when given a model object."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=False, metadata={})
