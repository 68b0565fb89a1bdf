"""The eval record's schema (qserve_eval.json): what `qserve eval` decided, typed, as every report,
`serve` and `sign` read it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from qserve.gate.core import Group
from qserve.gate.decisions import Gate, Status

EVAL_SCHEMA_VERSION = 1


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Check(BaseModel):
    """A check beside the gate (engine parity, the KV cache's scales): its status and why. Keys of
    earlier versions are kept (extra allowed), so an older record still reads."""

    model_config = ConfigDict(extra="allow")
    status: Literal["pass", "fail", "skipped"]
    reason: str = ""


class ParityTolerance(_Part):
    max_mean_abs_logprob_diff: float
    min_top1_agreement: float
    why: str


class ScreeningKL(_Part):
    mean_nats: float
    positions: int
    note: str = ""


class ParityCheck(Check):
    """Engine parity (evaluate/parity.py): vLLM's greedy tokens teacher-forced through transformers."""

    positions: int | None = None
    top1_agreement: float | None = None
    mean_abs_logprob_diff: float | None = None
    max_abs_logprob_diff: float | None = None
    max_greedy_shortfall: float | None = None
    tolerance: ParityTolerance | None = None
    kl_to_baseline: ScreeningKL | None = None  # beside the gate, never part of it
    seconds: float | None = None
    dtype: str | None = None  # transformers' for the checkpoint (absent in records before it was recorded)


class KvCacheCheck(Check):
    """The calibrated k/v scales as vLLM loaded them (engines/kv_scales.py): (least, largest) over layers."""

    kv_cache_dtype: str | None = None
    engine_kv_cache_dtype: str | None = None  # as vLLM resolved it (absent in records before it was read)
    layers: int | None = None
    k_scale: tuple[float, float] | None = None
    v_scale: tuple[float, float] | None = None


class Look(_Part):
    # None for evals that decide nothing (tune's search): they are no look at the weights
    number: int | None
    level: float
    earlier: list[dict[str, Any]]
    counted: bool
    weights: str | None = None
    history: list[dict[str, Any]] = []


class SupportClaim(_Part):
    runs: bool
    evidence: str
    needs: str | None = None
    serves: bool = False
    serve_evidence: str | None = None
    failure: str | None = None


class DeviceRecord(_Part):
    kind: str
    detail: str
    parallel: list[Any] = []


class EngineArgs(_Part):
    quantized: dict[str, Any]  # vllm.LLM's (or, emulated, lm-eval HFLM's) arguments
    baseline: dict[str, Any]


class BaselineModel(_Part):
    id: str
    path: str
    sha256: str


class BaselineCache(_Part):
    hits: list[str]
    misses: list[str]
    refresh: bool


class Prompting(_Part):
    """How lm-eval prompted each model, in its own results' fields (chat_template, chat_template_sha,
    system_instruction, system_instruction_sha, fewshot_as_multiturn, n-shot, task_hashes, config's
    gen_kwargs and seeds): equal on both, or the eval refused to gate."""

    quantized: dict[str, Any]
    baseline: dict[str, Any]


class Waiver(_Part):
    accepted_by: str
    override: str = "--accept-gate-difference"
    policy: str | None = None
    differences: list[str]


class OutsideRun(_Part):
    """One lm-eval run made outside qserve (`qserve gate --checkpoint`), as its results file states it."""

    results: str  # the results_<date>.json read, resolved; its samples files lie beside it
    results_sha256: str
    model: str | None = None  # lm-eval's --model (vllm, hf, ...)
    model_args: dict[str, Any] | str | None = None
    lm_eval_version: str | None = None
    date: float | None = None  # when lm-eval started it (Unix seconds), as it records


class OutsideRuns(_Part):
    baseline: OutsideRun
    quantized: OutsideRun


class EvalRecord(BaseModel):
    """The schema of qserve_eval.json (what `qserve eval` decided), checked when written and read.

    serve, sign, inspect and the policy read the first four fields; the rest describe the run.
    Records written before `schema_version` existed are version 1.
    """

    model_config = ConfigDict(extra="forbid")
    manifest_sha256: str
    decided_at: str
    verdict: Status
    gates: list[Gate]
    schema_version: int = EVAL_SCHEMA_VERSION
    purpose: Literal["gate", "tune search"] = "gate"
    checkpoint: str | None = None
    parity: ParityCheck | None = None
    kv_cache: KvCacheCheck | None = None
    emulated: bool = False  # true: scores come from transformers, not vLLM
    engine: Literal["vllm", "transformers"] | None = None
    scoring: str | None = None  # qserve's lm-eval class by name and source hash; None: lm-eval's own
    vllm_support: SupportClaim | None = None
    decode: dict[str, float] | None = None
    scheme: str | None = None
    recipe: str | None = None
    tasks: list[str] | None = None
    groups: dict[str, Group] | None = None  # lm-eval groups gated over their tasks' pooled items
    limit: int | None = None
    offset: int = 0
    doc_ids: dict[str, list[int]] | None = None  # per task, lm-eval's ids of the documents a --limit scored
    order: str | None = None  # how a --limit picked the items (gate/order.ORDER); None: every item, or file order
    n_samples: dict[str, dict[str, int] | None] | None = None
    device: DeviceRecord | None = None
    engine_args: EngineArgs | None = None
    baseline_model: BaselineModel | None = None
    baseline_cache: BaselineCache | None = None
    versions: dict[str, str] | None = None
    timings: dict[str, float] | None = None
    look: Look | None = None
    request: dict[str, Any] | None = None  # what was asked, as reusable_eval compares it (a fingerprint)
    # sha256 of qserve_eval_items.json (both models' runs and per-item values) for a limited eval from the
    # first item: a larger --limit of the same request scores only the items after them (evaluation.py)
    items_sha256: str | None = None
    prompting: Prompting | None = None
    waivers: list[Waiver] | None = None  # gate differences an operator accepted (--accept-gate-difference)
    # Set when `qserve gate --checkpoint` decided from lm-eval runs made elsewhere; None: qserve's own runs
    outside_runs: OutsideRuns | None = None
