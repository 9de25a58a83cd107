"""What `Config` checks when it is made: one function per flag group, each raising a
ConfigError that names the flag (`--max-num-seqs: must be >= 1`), never an assert."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from shared.config.fields import ConfigFields
from shared.config.options import ConfigError, flag
from shared.lora_modules import LoraModuleError, parse_lora_modules
from shared.speculative import SpeculativeConfigError, parse_speculative_config

# vLLM's other spellings of a value, which a command line copied from vLLM may hold: the value
# each one means here (the field's choices list both).
VLLM_SPELLINGS: dict[str, dict[str, str]] = {
    "dtype": {"half": "float16", "float": "float32"},
    "quantization": {"awq_marlin": "awq", "gptq_marlin": "gptq"},
    "kv_cache_dtype": {"fp8_e4m3": "fp8"},
}
# What one request may ask for: each at least 1 where it is set.
LIMITS = (
    "max_request_body_bytes",
    "max_num_messages",
    "max_num_prompts",
    "max_prompt_chars",
    "max_n",
    "max_tokens_limit",
    "max_logprobs",
    "max_stop_strings",
    "max_stop_string_chars",
    "max_logit_bias",
)


def canonical_spellings(config: ConfigFields) -> dict[str, Any]:
    """The fields that hold one of vLLM's other spellings, with the value it means here."""
    changes = {}
    for name, spellings in VLLM_SPELLINGS.items():
        value = getattr(config, name)
        if value in spellings:
            changes[name] = spellings[value]
    return changes


def validate(config: ConfigFields) -> None:
    """Raise a ConfigError for the first value out of range, checking group by group."""
    for check in _CHECKS:
        check(config)


def require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"--{flag(name)}: {message}")


def _at_least_one(config: ConfigFields, *names: str) -> None:
    """Each of these fields, where it is set, is >= 1."""
    for name in names:
        value = getattr(config, name)
        require(value is None or value >= 1, name, "must be >= 1")


def _check_model(config: ConfigFields) -> None:
    _at_least_one(config, "max_model_len")


def _check_lora(config: ConfigFields) -> None:
    require(config.max_loras >= 1, "max_loras", "must be >= 1")
    require(
        config.enable_lora or not (config.lora_modules or config.allow_runtime_lora_updating),
        "enable_lora",
        "--lora-modules and --allow-runtime-lora-updating need --enable-lora",
    )
    try:
        parse_lora_modules(config.lora_modules)
    except LoraModuleError as exc:
        raise ConfigError(str(exc)) from None
    require(config.max_lora_rank >= 1, "max_lora_rank", "must be >= 1")
    require(
        config.max_cpu_loras is None or config.max_cpu_loras >= config.max_loras,
        "max_cpu_loras",
        "must be >= --max-loras",
    )


def _check_parallel(config: ConfigFields) -> None:
    _at_least_one(config, "tensor_parallel_size")
    require(
        config.pipeline_parallel_size == 1,
        "pipeline_parallel_size",
        "pipeline parallelism is not supported: split the model with "
        "--tensor-parallel-size instead",
    )
    _at_least_one(config, "data_parallel_size")
    require(
        config.prefill_replicas == 0 or 0 < config.prefill_replicas < config.data_parallel_size,
        "prefill_replicas",
        "must leave at least one decode replica: 0..--data-parallel-size - 1",
    )
    size = config.kv_buffer_size
    require(0 < size < math.inf, "kv_buffer_size", "must be a number of GiB above 0")
    require(
        config.kv_buffer_device != "cuda" or config.device != "cpu",
        "kv_buffer_device",
        "cuda holds the handed-over KV in GPU memory: not with --device cpu",
    )
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for name in ("kv_buffer_device", "kv_buffer_size"):
        require(
            config.prefill_replicas > 0 or getattr(config, name) == defaults[name],
            name,
            "holds the KV a prefill replica hands over: it needs --prefill-replicas",
        )


def _check_cache(config: ConfigFields) -> None:
    require(config.block_size in (8, 16, 32, 64, 128), "block_size", "must be 8..128, a power of 2")
    require(
        0.0 < config.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]"
    )
    _at_least_one(config, "num_gpu_blocks_override")
    size = config.kv_offloading_size
    require(size is None or size > 0, "kv_offloading_size", "must be > 0 GiB")
    require(
        size is None or config.enable_prefix_caching,
        "kv_offloading_size",
        "the host tier holds the prefix cache's blocks: it needs prefix caching",
    )
    _check_disk_tier(config)


def _check_disk_tier(config: ConfigFields) -> None:
    path, disk_size = config.kv_offloading_disk_path, config.kv_offloading_disk_size
    require(disk_size is None or disk_size > 0, "kv_offloading_disk_size", "must be > 0 GiB")
    require(
        (path is None) == (disk_size is None),
        "kv_offloading_disk_path",
        "the disk tier needs both --kv-offloading-disk-path and --kv-offloading-disk-size",
    )
    require(
        path is None or config.kv_offloading_size is not None,
        "kv_offloading_disk_path",
        "the disk tier is behind the host tier: it needs --kv-offloading-size",
    )


def _check_scheduler(config: ConfigFields) -> None:
    _at_least_one(config, "max_num_seqs", "max_num_batched_tokens")
    try:
        spec = parse_speculative_config(config.speculative_config)
    except SpeculativeConfigError as exc:
        raise ConfigError(f"--speculative-config: {exc}") from exc
    require(
        config.kv_offloading_size is None or spec is None or spec.method in ("ngram", "suffix"),
        "kv_offloading_size",
        "the host tier does not hold a draft model's or an EAGLE-3 head's own KV cache yet:"
        " use it with ngram or suffix speculation",
    )
    require(
        not config.prefill_replicas or spec is None or spec.method in ("ngram", "suffix"),
        "prefill_replicas",
        "a handover does not carry a draft model's or an EAGLE-3 head's own KV cache yet:"
        " use it with ngram or suffix speculation",
    )


def _check_server(config: ConfigFields) -> None:
    _at_least_one(config, "tokenizer_pool_size", "api_server_count")
    require(1 <= config.port <= 65535, "port", "must be in 1..65535")
    _at_least_one(config, "max_queued_requests", "max_queued_tokens")
    require(
        config.request_timeout is None or config.request_timeout > 0,
        "request_timeout",
        "must be > 0 seconds",
    )
    require(config.drain_timeout >= 0, "drain_timeout", "must be >= 0 seconds")
    require(
        not config.enable_auto_tool_choice or config.tool_call_parser is not None,
        "tool_call_parser",
        "--enable-auto-tool-choice needs --tool-call-parser",
    )


def _check_limits(config: ConfigFields) -> None:
    _at_least_one(config, *LIMITS)
    _positive_seconds(config, "grammar_compile_timeout")


def _check_components(config: ConfigFields) -> None:
    require(config.worker_index is None or config.worker_index >= 0, "worker_index", "must be >= 0")
    _positive_seconds(config, "startup_timeout", "engine_stall_timeout", "component_timeout")
    require(
        config.data_parallel_rank is None
        or 0 <= config.data_parallel_rank < config.data_parallel_size,
        "data_parallel_rank",
        "must be in 0..--data-parallel-size - 1",
    )
    for name in ("scheduler_address", "kv_events_address", "kv_transfer_address"):
        count = len(config.addresses(name))
        require(
            count in (0, config.data_parallel_size),
            name,
            f"{count} addresses for {config.data_parallel_size} engine replicas",
        )


def _check_choices(config: ConfigFields) -> None:
    for f in dataclasses.fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        if choices and value is not None and value not in choices:
            raise ConfigError(f"--{flag(f.name)}: must be one of {', '.join(choices)}")


def _positive_seconds(config: ConfigFields, *names: str) -> None:
    for name in names:
        require(getattr(config, name) > 0, name, "must be > 0 seconds")


# In the order --help lists the flag groups (of several bad values, the one reported is in the
# earliest group); the choices last, as they cover every group.
_CHECKS: tuple[Callable[[ConfigFields], None], ...] = (
    _check_model,
    _check_lora,
    _check_parallel,
    _check_cache,
    _check_scheduler,
    _check_server,
    _check_limits,
    _check_components,
    _check_choices,
)
