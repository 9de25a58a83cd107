"""The scheduler's settings: the executor's report, checked against the scheduler's own flags.

Only the executor reads model files. It reports the vocabulary, the EOS ids and the limits it
sized its buffers, CUDA graphs and KV cache for (`ExecutorReady`); a scheduler whose flags
disagree would plan steps the executor cannot run, so it refuses to start instead.
"""

from __future__ import annotations

import msgspec

from services.scheduler.scheduler_config import SchedulerConfig
from shared.config import Config, ConfigError
from shared.lora_modules import parse_lora_modules
from shared.protocol import PROTOCOL_VERSION, ExecutorReady, ExecutorVersion
from shared.speculative import parse_speculative_config

# Flags the executor's sizes depend on: the scheduler must plan with the same values.
_SHARED_LIMITS = ("block_size", "max_num_seqs", "max_num_batched_tokens")


def check_protocol(version: int) -> None:
    if version != PROTOCOL_VERSION:
        raise ConfigError(
            f"the executor speaks protocol {version}, this scheduler {PROTOCOL_VERSION}: "
            "run the same kvflow version in both"
        )


def refuse_other_versions(frame: bytes) -> None:
    """A frame that did not decode: if it is another version's ExecutorReady, say so."""
    try:
        hello = msgspec.msgpack.decode(frame, type=ExecutorVersion)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return  # not an ExecutorReady at all
    check_protocol(hello.protocol_version)


def scheduler_config(config: Config, ready: ExecutorReady) -> SchedulerConfig:
    """The scheduler core's settings; raises ConfigError when config and executor disagree."""
    check_protocol(ready.protocol_version)
    mismatches = [
        f"--{name.replace('_', '-')} {getattr(config, name)} (executor: {getattr(ready, name)})"
        for name in _SHARED_LIMITS
        if getattr(config, name) != getattr(ready, name)
    ]
    if config.max_model_len is not None and config.max_model_len != ready.max_model_len:
        mismatches.append(
            f"--max-model-len {config.max_model_len} (executor: {ready.max_model_len})"
        )
    modules = [module.name for module in parse_lora_modules(config.lora_modules)]
    if modules != ready.lora_modules:
        mismatches.append(f"--lora-modules {modules} (executor: {ready.lora_modules})")
    if mismatches:
        raise ConfigError(
            "the scheduler's flags disagree with the executor's: "
            + ", ".join(mismatches)
            + "; start every component with the same engine flags"
        )
    spec = parse_speculative_config(config.speculative_config)
    return SchedulerConfig(
        num_blocks=ready.num_blocks,
        block_size=ready.block_size,
        max_model_len=ready.max_model_len,
        max_num_seqs=ready.max_num_seqs,
        max_num_batched_tokens=ready.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_chunked_prefill=config.enable_chunked_prefill,
        eos_token_ids=tuple(ready.eos_token_ids),
        vocab_size=ready.vocab_size,
        max_queued_requests=config.max_queued_requests,
        max_queued_tokens=config.max_queued_tokens,
        scheduling_policy=config.scheduling_policy,
        max_loras=ready.max_loras,
        kv_events=config.kv_events_address is not None,
        num_speculative_tokens=ready.num_speculative_tokens,
        num_lookahead_tokens=spec.lookahead if spec is not None else 0,
        num_host_blocks=ready.num_host_blocks,
        host_block_bytes=ready.host_block_bytes,
        num_disk_blocks=ready.num_disk_blocks,
        disk_blocks=tuple(ready.disk_blocks),
        kv_transfer=config.prefill_replicas > 0,
        long_rope_after=ready.long_rope_after,
        kv_windows=tuple(ready.kv_windows),
    )
