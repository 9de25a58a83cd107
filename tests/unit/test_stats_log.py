"""The serving scheduler's periodic one-line stats log."""

from __future__ import annotations

import msgspec

from services.scheduler.stats_log import StatsLog
from shared.protocol import StatsSnapshot
from tests.unit.snapshots import stats

IDLE = stats(num_blocks=100)


def busy(**fields: float) -> StatsSnapshot:
    return msgspec.structs.replace(IDLE, **fields)


def test_a_line_every_interval_with_rates_over_that_interval() -> None:
    log = StatsLog(interval=10.0)
    assert log.line(0.0, IDLE) is None  # the first snapshot starts the clock
    working = busy(
        num_running=3,
        num_waiting=1,
        kv_usage=0.125,
        prefix_cache_queries=400,
        prefix_cache_hits=100,
        num_prompt_tokens=2000,
        num_generation_tokens=500,
        device_busy_seconds=9.25,
    )
    assert log.line(5.0, working) is None  # not yet
    assert log.line(10.0, working) == (
        "prompt throughput: 200.0 tok/s, generation throughput: 50.0 tok/s, "
        "running: 3 reqs, waiting: 1 reqs, KV cache usage: 12.5%, "
        "prefix cache hit rate: 25.0%, preemptions: 0, device busy: 92.5%"
    )
    later = busy(num_running=3, num_prompt_tokens=2000, num_generation_tokens=1500)
    line = log.line(30.0, later)
    assert line is not None and "generation throughput: 50.0 tok/s" in line  # 1000 in 20 s


def test_idle_intervals_log_once_then_stay_quiet() -> None:
    log = StatsLog(interval=1.0)
    log.line(0.0, IDLE)
    assert log.line(1.0, IDLE) is None  # idle from the start: nothing to say
    worked = busy(num_generation_tokens=10)
    assert log.line(2.0, worked) is not None
    assert log.line(3.0, worked) is not None  # the first idle interval: throughput 0
    assert log.line(4.0, worked) is None
    assert log.line(5.0, busy(num_generation_tokens=20)) is not None
