"""Recipes: YAML files parsed into typed models, with errors that name the field and line."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from qserve.errors import InvalidSpec, QserveError
from qserve.paths import project_data
from qserve.schemes.backends import ALGORITHMS, BACKENDS
from qserve.schemes.catalog import MIX_SEPARATOR, QUARK_GROUP_SIZES, SCHEMES, get_scheme, mix_name
from qserve.spec.gates import GateSpec, shorthand
from qserve.spec.lm_eval_args import LmEvalArgs


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateSpec(_Strict):
    """Data-free calibration: the model writes its own text, continuing these seed prompts."""

    prompts: list[str] = Field(min_length=1, description="seed prompts, used in turn (chat template applied)")
    max_new_tokens: int = Field(128, gt=0)
    temperature: float = Field(0.8, ge=0)


class DataSource(_Strict):
    """Where calibration text comes from: a local file, a Hugging Face dataset, or the model itself."""

    source: str | None = Field(None, description="a definition in calibration/ supplying the fields below")
    description: str = ""
    path: str | None = Field(None, description="jsonl/json/txt/parquet; a relative path resolves against --data-dir")
    dataset: str | None = Field(None, description="Hugging Face dataset id (needs network access)")
    subset: str | None = Field(None, description="the dataset's configuration name")
    split: str = "train"
    text: str | None = Field(None, description="Python format string over each record's fields (default {text})")
    messages: str | None = Field(None, description="field holding chat messages; rendered with the model's chat template")
    generate: GenerateSpec | None = None
    weight: float = Field(1.0, gt=0, description="share of the samples in a mix")

    @model_validator(mode="before")
    @classmethod
    def _from_source(cls, data: Any) -> Any:
        """Fill fields from calibration/<source>.yaml; the recipe's own keys win."""
        if not isinstance(data, dict) or not data.get("source"):
            return data
        defined = calibration_sources()
        if not isinstance(data["source"], str):
            raise InvalidSpec(f"source names one calibration source ({', '.join(defined) or 'none'}); got {data['source']!r}")
        if data["source"] not in defined:
            raise InvalidSpec(f"unknown calibration source {data['source']!r}; available: {', '.join(defined) or 'none'}")
        return defined[data["source"]] | data

    @model_validator(mode="after")
    def _one_origin(self) -> DataSource:
        origins = [k for k in ("path", "dataset", "generate") if getattr(self, k) is not None]
        if len(origins) > 1:
            raise InvalidSpec(f"give one of path, dataset or generate, not {' and '.join(origins)}")
        if not origins and not getattr(self, "mix", None):  # CalibrationSpec adds `mix`
            raise InvalidSpec("needs a source, path, dataset, generate or mix")
        if self.text is not None and self.messages is not None:
            raise InvalidSpec("give text or messages, not both")
        return self

    @property
    def kind(self) -> str:
        return "generate" if self.generate else "dataset" if self.dataset else "file"


DEFAULT_SEQ_LEN = 256  # calibration tokens per sample


class CalibrationSpec(DataSource):
    """One data source, or a weighted `mix` of them, plus how much to draw."""

    mix: list[DataSource] | None = Field(None, min_length=1, description="weighted sources; samples split by weight")
    samples: int = Field(64, gt=0)
    seq_len: int = Field(DEFAULT_SEQ_LEN, gt=8)
    seed: int = 0
    all_experts: bool = Field(
        True,
        description="mixture of experts: every expert calibrates on every token, the router still picks "
        "the outputs (llm-compressor's moe_calibrate_all_experts); false: only on the tokens routed to it",
    )

    @model_validator(mode="after")
    def _mix_alone(self) -> CalibrationSpec:
        if self.mix and any(getattr(self, k) is not None for k in ("path", "dataset", "generate")):
            raise InvalidSpec("a mix lists its sources under mix; remove path/dataset/generate from the calibration section")
        return self

    def sources(self) -> list[DataSource]:
        return list(self.mix) if self.mix else [self]


def calibration_sources() -> dict[str, dict]:
    folder = project_data("calibration")
    return {p.stem: yaml.safe_load(p.read_text()) or {} for p in sorted(folder.glob("*.yaml"))}


class KvCacheSpec(_Strict):
    """Quantized KV cache with static per-tensor k/v scales calibrated on the recipe's data."""

    dtype: Literal["fp8"] = Field(description="vLLM kv_cache_dtype the checkpoint will need")


class LayerOverride(_Strict):
    """Layers quantized with another scheme than the recipe's (compressed-tensors config group targets)."""

    scheme: str = Field(description="a plain scheme, e.g. W4A16")
    group_size: int | None = Field(None, gt=0, description="override the preset's weight group size")
    targets: list[str] = Field(min_length=1, description="layer names or `re:` regexes (compressed-tensors targets)")

    @field_validator("scheme")
    @classmethod
    def _plain_scheme(cls, v: str) -> str:
        name = get_scheme(v, "llmcompressor").name
        if MIX_SEPARATOR in name:
            raise InvalidSpec(f"an override names one plain scheme, not the mix {name}")
        return name


class EvalSpec(_Strict):
    """lm-eval's evaluation options for both models, named as simple_evaluate's keywords; `qserve eval`'s and
    `qserve run`'s options of the same names win over them."""

    num_fewshot: int | None = Field(None, ge=0, description="few-shot examples per item (default: each task's own)")
    apply_chat_template: bool | str | None = Field(
        None, description="true: prompt through the model's chat template; a name picks one of several"
    )
    fewshot_as_multiturn: bool | None = Field(None, description="few-shot examples as chat turns (default: with the template)")
    system_instruction: str | None = Field(None, description="a system prompt for both models")
    gen_kwargs: str | dict[str, Any] | None = Field(
        None, description="generation settings over each task's (k=v,k=v or a mapping)"
    )
    seed: int | str | list[int | None] | None = Field(None, description="lm-eval's --seed: one, or python,numpy,torch,fewshot")

    @model_validator(mode="after")
    def _as_lm_eval_takes_them(self) -> EvalSpec:
        self.args().check(cli=False)  # parsed as lm-eval parses them, and refused where lm-eval would refuse
        return self

    def args(self) -> LmEvalArgs:
        return LmEvalArgs.from_recipe(self.model_dump())


# Calibration for llm-compressor modifiers that need data but came without any (plain recipes).
DEFAULT_CALIBRATION = {"source": "gsm8k-train", "samples": 32, "seq_len": DEFAULT_SEQ_LEN}


# awq protects weight-only schemes by design; qserve offers AutoRound (Intel's signed-gradient rounding)
# for weight-only INT4, the family its authors and llm-compressor document and that vLLM-CPU runs.
WEIGHT_ONLY_ALGORITHMS = ("awq", "autoround")


class Recipe(_Strict):
    name: str
    description: str = ""
    model: str | None = Field(None, description="model to quantize (default: the embedded SmolLM2); --model wins")
    output: str | None = Field(None, description="checkpoint directory (default out-<name>); --output wins")
    backend: Literal[tuple(BACKENDS)] = "llmcompressor"  # type: ignore[valid-type]
    scheme: str | None = Field(None, description=f"one of {', '.join(SCHEMES)}")
    modifiers: dict[str, Any] | None = Field(
        None, description="llm-compressor modifiers or stages, passed to oneshot as is (instead of scheme)"
    )
    algorithm: Literal[ALGORITHMS] = "rtn"  # type: ignore[valid-type]
    algorithm_options: dict[str, Any] = Field(
        default_factory=dict, description="extra arguments for the algorithm's llm-compressor modifier, e.g. {n_grid: 10} for awq"
    )
    group_size: int | None = Field(None, gt=0, description="override the preset's weight group size")
    smoothquant: float | None = Field(None, gt=0, lt=1, description="SmoothQuant strength before quantizing")
    sparsity: Literal["2:4"] | None = Field(
        None,
        description="prune every quantized Linear to 2 nonzero weights in each 4 with SparseGPT before quantizing "
        "(needs calibration; vLLM 0.32 runs the result with its dense kernels)",
    )
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    overrides: list[LayerOverride] = Field(
        default_factory=list, description="layers quantized with another scheme (a per-layer mix; llmcompressor only)"
    )
    calibration: CalibrationSpec | None = None
    kv_cache: KvCacheSpec | None = None
    eval: EvalSpec | None = Field(None, description="lm-eval's options for both models (num_fewshot, apply_chat_template, ...)")
    gates: dict[str, list[GateSpec]] = Field(
        default_factory=dict,
        description="task -> minimum recovery, or {metric, min_recovery, max_drop, max_increase}, or a list of those",
    )
    dtype: Literal["auto", "float16", "bfloat16", "float32"] | None = Field(
        None, description="vLLM dtype to record; default chosen per scheme and device"
    )
    execution: Literal["auto", "in_memory", "model_free", "offload"] = Field(
        "auto",
        description="in_memory: load the model, run oneshot; model_free: llm-compressor's model_free_ptq, one "
        "safetensors shard at a time (data-free recipes only); offload: oneshot with the weights that do not fit "
        "in memory offloaded to disk (compressed-tensors); auto: in_memory if it fits, else model_free, else offload",
    )

    @property
    def target_scheme(self) -> str | None:
        """The scheme the checkpoint will hold: the recipe's, or the mix of it with its overrides."""
        if self.scheme is None or not self.overrides:
            return self.scheme
        return mix_name([self.scheme, *(o.scheme for o in self.overrides)])

    @property
    def seq_len(self) -> int:
        """Calibration tokens per sample (both backends truncate to it)."""
        return self.calibration.seq_len if self.calibration else DEFAULT_SEQ_LEN

    @field_validator("scheme")
    @classmethod
    def _known_scheme(cls, v: str | None) -> str | None:
        return v and get_scheme(v).name

    @field_validator("gates", mode="before")
    @classmethod
    def _gate_shorthand(cls, v: Any) -> Any:
        """`gsm8k: 0.95` means a minimum recovery; one mapping means a one-gate list."""
        return {task: shorthand(spec) for task, spec in v.items()} if isinstance(v, dict) else v

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        if (self.scheme is None) == (self.modifiers is None):
            raise InvalidSpec("give either scheme or modifiers (an llm-compressor recipe)")
        if self.modifiers is not None and self.sparsity is not None:
            raise InvalidSpec("sparsity goes with scheme; with modifiers, put SparseGPTModifier in them")
        if self.modifiers is not None:
            if self.backend != "llmcompressor":
                raise InvalidSpec("modifiers are llm-compressor's; they need backend: llmcompressor")
            return self
        scheme = get_scheme(self.scheme, self.backend)
        if MIX_SEPARATOR in scheme.name:
            raise InvalidSpec(f"{scheme.name} is a per-layer mix: give one scheme and list the other's layers under overrides")
        self._check_overrides()
        self._check_sparsity()
        if self.backend == "quark" and (self.algorithm != "rtn" or self.smoothquant or self.algorithm_options):
            raise InvalidSpec(
                "with backend quark, qserve runs Quark's plain (rtn) quantization: drop algorithm, algorithm_options, smoothquant"
            )
        if self.backend == "quark" and scheme.group_quantized and (self.group_size or 128) not in QUARK_GROUP_SIZES:
            raise InvalidSpec(f"Quark's {self.scheme} takes group_size {', '.join(map(str, QUARK_GROUP_SIZES))}")
        if self.group_size is not None and not scheme.group_quantized:
            raise InvalidSpec(f"group_size does not apply to {self.scheme} (fixed or per-channel groups)")
        if self.algorithm in WEIGHT_ONLY_ALGORITHMS and scheme.activations != "fp16":
            raise InvalidSpec(f"{self.algorithm} is offered for weight-only schemes; {self.scheme} quantizes activations too")
        return self

    def _check_sparsity(self) -> None:
        if self.sparsity is None:
            return
        if self.backend != "llmcompressor":
            raise InvalidSpec("sparsity 2:4 is llm-compressor's SparseGPT; it needs backend: llmcompressor")
        if self.algorithm != "rtn":
            # Round to nearest maps a pruned 0 to 0; GPTQ's error feedback and AWQ's scaling would move it.
            raise InvalidSpec(
                f"sparsity 2:4 is quantized with rtn, which keeps the pruned zeros; drop algorithm {self.algorithm}"
            )
        if self.overrides or self.kv_cache is not None:
            raise InvalidSpec("sparsity with overrides or kv_cache was never run on vLLM by qserve; drop one")
        if SCHEMES[self.scheme].weight_bits != 8:
            raise InvalidSpec(f"sparsity 2:4 is offered with 8-bit weights (FP8 or INT8 schemes), not {self.scheme}")

    def _check_overrides(self) -> None:
        if not self.overrides:
            return
        if self.backend != "llmcompressor":
            raise InvalidSpec("overrides (per-layer schemes) need backend: llmcompressor")
        if self.kv_cache is not None:
            raise InvalidSpec("overrides and kv_cache together were never run on vLLM by qserve; drop one")
        mix = self.target_scheme
        if mix not in SCHEMES:
            known = [n for n in SCHEMES if MIX_SEPARATOR in n]
            raise InvalidSpec(f"the mix {mix} was never run on vLLM by qserve; known mixes: {', '.join(known)}")
        for o in self.overrides:
            if o.group_size is not None and not SCHEMES[o.scheme].group_quantized:
                raise InvalidSpec(f"group_size does not apply to {o.scheme} (fixed or per-channel groups)")

    @model_validator(mode="after")
    def _has_data(self) -> Recipe:
        reasons = [
            f"algorithm {self.algorithm}" * (self.algorithm != "rtn"),
            "smoothquant" * (self.smoothquant is not None),
            "sparsity 2:4 (SparseGPT)" * (self.sparsity is not None),
            f"{self.scheme}'s static activation scales" * bool(self.scheme and SCHEMES[self.scheme].needs_calibration),
            "kv_cache scales" * (self.kv_cache is not None),
        ]
        reasons = [r for r in reasons if r]
        if reasons and self.calibration is None:
            raise InvalidSpec(f"{' and '.join(reasons)} need a calibration section")
        return self

    @model_validator(mode="after")
    def _model_free_possible(self) -> Recipe:
        if self.execution == "model_free" and (why := self.model_free_obstacle()):
            raise InvalidSpec(f"execution model_free quantizes weights shard by shard without data; {why}")
        if self.execution == "offload" and self.backend != "llmcompressor":
            raise InvalidSpec("execution offload is compressed-tensors' disk offloading; it needs backend: llmcompressor")
        return self

    def model_free_obstacle(self) -> str | None:
        """Why llm-compressor's model_free_ptq cannot run this recipe (None: it can)."""
        if self.backend != "llmcompressor" or self.scheme is None:
            return "it needs backend llmcompressor and a scheme (not modifiers)"
        if self.calibration is not None or self.kv_cache is not None or self.smoothquant is not None:
            return "drop calibration, kv_cache and smoothquant (they need data), or use execution in_memory"
        if self.overrides:
            return "overrides are not supported there; use execution in_memory"
        return None

    @property
    def lm_eval(self) -> LmEvalArgs:
        """lm-eval's options this recipe names for both models (none named: lm-eval's defaults)."""
        return self.eval.args() if self.eval else LmEvalArgs()

    @property
    def label(self) -> str:
        """What the recipe does, for progress lines."""
        what = (self.target_scheme or "llm-compressor modifiers") + f" {self.sparsity}-sparse" * bool(self.sparsity)
        return f"{what} with {self.backend}" + (f" ({self.algorithm})" if self.scheme else "")


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
    if is_llmcompressor_recipe(data):
        data = wrap_llmcompressor_recipe(data, source)
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise QserveError(_describe(exc, node, source)) from None


def is_llmcompressor_recipe(data: dict) -> bool:
    """llm-compressor's own layout: only `<x>_stage:` / `<x>_modifiers:` at the top level."""
    return bool(data) and all(str(k).endswith(("_stage", "_modifiers")) for k in data)


def wrap_llmcompressor_recipe(data: dict, source: str) -> dict:
    """A plain llm-compressor recipe as a qserve recipe: its modifiers run as is (calibration: see quantize)."""
    name = Path(source).stem if source != "<recipe>" else "llmcompressor-recipe"
    return {"name": name, "description": "plain llm-compressor recipe", "modifiers": data}


def _describe(exc: ValidationError, node: yaml.Node | None, source: str) -> str:
    """First validation error as `file:line: field: message`."""
    err = exc.errors()[0]
    loc = [p for p in err["loc"] if isinstance(p, (str, int))]
    line = _line_of(node, loc)
    where = f"{source}:{line}" if line else source
    field = ".".join(str(p) if str(p).isprintable() and str(p).strip() else repr(p) for p in loc) or "recipe"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = f"unknown field; valid fields: {', '.join(_model_at(loc).model_fields)}"
    return f"{where}: {field}: {msg}"


def _model_at(loc: list) -> type[BaseModel]:
    """The model whose field `loc` names (for listing its valid fields)."""
    parents = [str(p) for p in loc[:-1] if isinstance(p, str)]
    if not parents:
        return Recipe
    if parents[0] == "gates":
        return GateSpec
    named = {"generate": GenerateSpec, "mix": DataSource, "calibration": CalibrationSpec, "kv_cache": KvCacheSpec}
    return {**named, "overrides": LayerOverride, "eval": EvalSpec}.get(parents[-1], Recipe)


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
