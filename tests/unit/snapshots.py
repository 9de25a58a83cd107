"""Scheduler stats snapshots for the tests that read them (health, metrics, the stats log)."""

from __future__ import annotations

from typing import Any

from shared.protocol import StatsSnapshot


def stats(**fields: Any) -> StatsSnapshot:
    """An idle engine of 10 blocks and a 512-token context, with `fields` changed."""
    values: dict[str, Any] = dict(
        num_running=0,
        num_waiting=0,
        kv_usage=0.0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        num_prompt_tokens=0,
        num_generation_tokens=0,
        device_busy_seconds=0.0,
        num_blocks=10,
        max_model_len=512,
    )
    values.update(fields)
    return StatsSnapshot(**values)
