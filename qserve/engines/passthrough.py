"""What reaches a served vLLM besides qserve's own arguments: the options a user may pass after `--`
and the environment variables. Both are allowlists: what is served must be what was gated.
(Plain data and stdlib only: `qserve serve --help` prints the option list.)"""

from __future__ import annotations

from collections.abc import Mapping

from qserve.errors import QserveError

# The only `vllm serve` settings (argparse dests, vLLM 0.32) a user may change after `--`, by family:
# none changes what the model computes from a prompt or who may reach it. Everything else (weights,
# tokenizer, numerics, adapters, plugins, extra endpoints) is refused: what is served is what was gated.
# Laid out by hand (one family a line), so the formatter leaves it:
# fmt: off
PASS_THROUGH = {
    "served model name": ("served_model_name", "response_role"),
    "context length and scheduling limits": (
        "max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_num_queued_reqs", "max_num_queued_tokens",
        "scheduling_policy", "max_logprobs", "seed",
    ),
    "memory and capacity": ("kv_cache_memory_bytes", "gpu_memory_utilization", "max_parallel_loading_workers"),
    "prefix caching": ("enable_prefix_caching", "prefix_caching_hash_algo"),
    "chunked prefill": ("enable_chunked_prefill", "long_prefill_token_threshold"),
    "tool calling (vLLM's built-in parsers)": ("enable_auto_tool_choice", "tool_call_parser", "exclude_tools_when_tool_choice_none"),
    "reasoning (vLLM's built-in parsers)": ("reasoning_parser",),
    "structured output": ("structured_outputs_config",),
    "parallelism and placement": (
        "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "data_parallel_size_local",
        "data_parallel_rank", "data_parallel_start_rank", "data_parallel_address", "data_parallel_rpc_port",
        "data_parallel_backend", "distributed_executor_backend", "enable_expert_parallel", "master_addr",
        "master_port", "nnodes", "node_rank", "headless", "api_server_count", "distributed_timeout_seconds",
    ),
    "CORS": ("allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials"),
    "TLS": ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "ssl_ciphers", "enable_ssl_refresh"),
    "logging and metrics": (
        "disable_log_stats", "enable_log_requests", "max_log_len", "uvicorn_log_level", "disable_uvicorn_access_log",
        "disable_access_log_for_endpoints", "log_level", "log_error_stack", "aggregate_engine_logging",
        "enable_prompt_tokens_details", "enable_server_load_tracking", "enable_force_include_usage",
        "enable_request_id_headers", "otlp_traces_endpoint", "collect_detailed_traces",
    ),
}
# fmt: on
ALLOWED = {dest: family for family, dests in PASS_THROUGH.items() for dest in dests}
# Why some refused settings are refused, for the error line (the default: not on the allowlist).
REFUSED_BECAUSE = {
    "lora": "LoRA adapters change what the model computes, and no adapter was gated with this checkpoint",
    "plugin": "a plugin runs code of its own inside the server",
    "middleware": "a middleware runs code of its own in front of every route",
    "grpc": "vLLM's gRPC server does not check the API key",
    "enforce_eager": "the engine would run differently from the one the gate decided with",
}


def pass_through_help() -> str:
    """Both allowlists as `qserve serve --help` prints them."""
    options = "; ".join(
        f"{family}: {', '.join('--' + d.replace('_', '-') for d in dests)}" for family, dests in PASS_THROUGH.items()
    )
    return (
        f"Options allowed after `--`, by family: {options}. Any other (LoRA, plugins, --middleware, --grpc, "
        "--logprobs-mode, --disable-sliding-window, model, tokenizer or loader settings) is refused. Environment: "
        f"vLLM sees only {', '.join(sorted(VLLM_ENV_PASS))}, the variables {', '.join(sorted(ENV_PASS))} and those "
        f"starting {', '.join(ENV_PASS_PREFIXES)}; any other VLLM_* variable (VLLM_SERVER_DEV_MODE, ...) is refused."
    )


def refused_because(dest: str) -> str:
    """Why the `vllm serve` setting `dest` may not be passed through."""
    found = [why for key, why in REFUSED_BECAUSE.items() if key in dest]
    return found[0] if found else "qserve passes only options that leave what the model computes, and who may reach it, unchanged"


# The environment a served vLLM sees: these names and prefixes pass, any other variable is dropped.
# Laid out by hand (grouped by kind), so the formatter leaves it:
# fmt: off
ENV_PASS = {
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "PYTHONPATH",
    "VIRTUAL_ENV", "LD_LIBRARY_PATH", "CUDA_HOME", "ROCM_PATH", "SSL_CERT_FILE", "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
    "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR", "QSERVE_CACHE_DIR",
    "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
}
# fmt: on
ENV_PASS_PREFIXES = ("LC_", "OMP_", "KMP_", "MKL_", "NCCL_", "GLOO_")
# vLLM's own variables that leave what is served, and who may reach it, alone: logging, caches,
# timeouts, CPU placement, how workers start. Any other VLLM_* variable is refused: VLLM_SERVER_DEV_MODE=1 alone
# opens /collective_rpc and /update_weights on the served model.
# Laid out by hand (grouped by kind), so the formatter leaves it:
# fmt: off
VLLM_ENV_PASS = {
    "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM", "VLLM_LOGGING_PREFIX", "VLLM_CONFIGURE_LOGGING",
    "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK", "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "VLLM_RPC_TIMEOUT",
    "VLLM_ENGINE_READY_TIMEOUT_S", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "VLLM_HOST_IP", "VLLM_PORT",
    "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_WORKER_MULTIPROC_METHOD",
    "VLLM_ENABLE_V1_MULTIPROCESSING",  # in-process worker or not: qserve's own CPU plan sets it (serve/plan.py)
}
# fmt: on
# The key is the caller's choice (`api_key`), never an inherited one.
VLLM_ENV_DROPPED = {"VLLM_API_KEY"}


def served_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` a served vLLM may see; a vLLM variable off the list is an error."""
    refused = sorted(k for k in environ if k.startswith("VLLM_") and k not in VLLM_ENV_PASS | VLLM_ENV_DROPPED)
    if refused:
        raise QserveError(
            f"the environment sets {', '.join(refused)}, which qserve does not pass to a served vLLM (it could change "
            "what is served or open endpoints); unset it (the variables that pass: `qserve serve --help`)"
        )
    return {k: v for k, v in environ.items() if k in ENV_PASS | VLLM_ENV_PASS or k.startswith(ENV_PASS_PREFIXES)}
