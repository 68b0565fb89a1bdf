"""Recipes: YAML files parsed into typed models, with errors that name the field and line."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from qserve.errors import QserveError
from qserve.gates import GateSpec
from qserve.paths import project_data
from qserve.schemes import SCHEMES, get_scheme


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CalibrationSpec(_Strict):
    """Local calibration text: one sample per record of a jsonl file."""

    source: str | None = Field(None, description="a definition in calibration/ supplying path and text")
    path: str = Field(description="jsonl file; a relative path resolves against --data-dir")
    text: str = Field("{text}", description="Python format string over each record's fields")
    samples: int = Field(64, gt=0)
    seq_len: int = Field(256, gt=8)
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _from_source(cls, data: Any) -> Any:
        """Fill path/text from calibration/<source>.yaml; the recipe's own keys win."""
        if not isinstance(data, dict) or not data.get("source"):
            return data
        defined = calibration_sources()
        if data["source"] not in defined:
            raise ValueError(f"unknown calibration source {data['source']!r}; available: {', '.join(defined) or 'none'}")
        base = {k: v for k, v in defined[data["source"]].items() if k in ("path", "text")}
        return base | data


def calibration_sources() -> dict[str, dict]:
    folder = project_data("calibration")
    return {p.stem: yaml.safe_load(p.read_text()) or {} for p in sorted(folder.glob("*.yaml"))}


class Recipe(_Strict):
    name: str
    description: str = ""
    backend: Literal["llmcompressor"] = "llmcompressor"
    scheme: str
    algorithm: Literal["rtn", "gptq"] = "gptq"
    group_size: int | None = Field(None, gt=0, description="override the preset's weight group size")
    smoothquant: float | None = Field(None, gt=0, lt=1, description="SmoothQuant strength before quantizing")
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    calibration: CalibrationSpec | None = None
    gates: dict[str, list[GateSpec]] = Field(
        default_factory=dict,
        description="task -> minimum recovery, or {metric, min_recovery, max_drop, max_increase}, or a list of those",
    )
    dtype: Literal["auto", "float16", "bfloat16", "float32"] | None = Field(
        None, description="vLLM dtype to record; default chosen per scheme and device"
    )

    @field_validator("scheme")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        try:
            return get_scheme(v).name
        except KeyError as exc:
            raise ValueError(exc.args[0]) from None

    @field_validator("gates", mode="before")
    @classmethod
    def _gate_shorthand(cls, v: Any) -> Any:
        """`gsm8k: 0.95` means a minimum recovery; one mapping means a one-gate list."""
        if not isinstance(v, dict):
            return v
        as_list = {task: spec if isinstance(spec, list) else [spec] for task, spec in v.items()}
        return {
            task: [{"min_recovery": s} if isinstance(s, (int, float)) else s for s in specs] for task, specs in as_list.items()
        }

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        scheme = SCHEMES[self.scheme]
        if self.group_size is not None and not scheme.group_quantized:
            raise ValueError(f"group_size does not apply to {self.scheme} (per-channel weights)")
        needs_data = self.algorithm == "gptq" or self.smoothquant is not None
        if needs_data and self.calibration is None:
            raise ValueError(
                f"algorithm {self.algorithm!r}{' with smoothquant' if self.smoothquant else ''} needs a calibration section"
            )
        return self


def load_recipe(path: str | Path) -> tuple[Recipe, str]:
    """Parse a recipe file; returns the recipe and the file's SHA-256."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise QserveError(f"recipe {path} does not exist") from None
    except OSError as exc:
        raise QserveError(f"recipe {path} cannot be read: {exc.strerror}") from None
    return parse_recipe(raw.decode("utf-8", errors="replace"), str(path)), hashlib.sha256(raw).hexdigest()


def parse_recipe(text: str, source: str = "<recipe>") -> Recipe:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise QserveError(f"{source}{where}: malformed YAML: {problem}") from None
    if not isinstance(data, dict):
        raise QserveError(f"{source}: a recipe must be a YAML mapping of fields (name, scheme, ...)")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise QserveError(_describe(exc, node, source)) from None


def _describe(exc: ValidationError, node: yaml.Node | None, source: str) -> str:
    """First validation error as `file:line: field: message`."""
    err = exc.errors()[0]
    loc = [p for p in err["loc"] if isinstance(p, (str, int))]
    line = _line_of(node, loc)
    where = f"{source}:{line}" if line else source
    field = ".".join(str(p) for p in loc) or "recipe"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        parent = {"calibration": CalibrationSpec, "gates": GateSpec}.get(str(loc[0]), Recipe) if len(loc) > 1 else Recipe
        msg = f"unknown field; valid fields: {', '.join(parent.model_fields)}"
    return f"{where}: {field}: {msg}"


def _line_of(node: yaml.Node | None, loc: list) -> int | None:
    """1-based line of the deepest YAML node on `loc` that exists."""
    line = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        if isinstance(key, int) and not isinstance(node, yaml.SequenceNode):
            continue  # a shorthand the validator wrapped into a list (e.g. one gate mapping)
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == key), None)
            if match is None:
                break
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            break
    return line
