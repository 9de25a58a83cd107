"""How /health words the engine's state: starting is not failing."""

from __future__ import annotations

from services.frontend.health import unavailable_reason

EXPECTED = ["scheduler", "executor-0", "tokenizer-0", "tokenizer-1"]
TIMEOUT = 10.0


def reason(
    last_seen: dict[str, float],
    stats_at: float | None = None,
    down: str | None = None,
    now: float = 100.0,
) -> str | None:
    return unavailable_reason(
        now=now,
        timeout=TIMEOUT,
        expected=EXPECTED,
        last_seen=last_seen,
        stats_at=stats_at,
        down=down,
    )


def beating(*names: str, at: float = 99.0) -> dict[str, float]:
    return dict.fromkeys(names or EXPECTED, at)


def test_nothing_heard_yet_is_starting() -> None:
    assert reason({}) == "starting: waiting for scheduler, executor-0, tokenizer-0, tokenizer-1"


def test_waits_only_for_the_components_not_heard_from() -> None:
    assert reason(beating("scheduler", "executor-0")) == (
        "starting: waiting for tokenizer-0, tokenizer-1"
    )


def test_every_component_beating_without_stats_is_loading() -> None:
    assert reason(beating()) == "starting: loading the model"


def test_healthy_once_stats_come() -> None:
    assert reason(beating(), stats_at=99.9) is None
    assert reason(beating(at=90.0), stats_at=90.0) is None  # exactly the timeout: still fine


def test_a_component_heard_then_silent_is_a_failure_with_its_silence() -> None:
    last_seen = {**beating(), "tokenizer-1": 87.6}
    assert reason(last_seen, stats_at=99.9) == "no heartbeat from tokenizer-1 for 12 s"
    last_seen["executor-0"] = 70.0
    assert reason(last_seen, stats_at=99.9) == (
        "no heartbeat from executor-0 for 30 s, tokenizer-1 for 12 s"
    )


def test_failure_is_said_before_starting() -> None:
    last_seen = {"scheduler": 50.0}  # heard once, then silent; the others never heard
    assert reason(last_seen) == "no heartbeat from scheduler for 50 s"


def test_a_scheduler_that_stops_reporting_is_stuck() -> None:
    assert reason(beating(), stats_at=80.0) == "the scheduler has stopped reporting"


def test_a_dead_component_wins_over_everything() -> None:
    assert reason({}, down="executor-0 exited with code 1") == "executor-0 exited with code 1"
    assert reason(beating(), 99.9, "tokenizer-0 exited with code 9") == (
        "tokenizer-0 exited with code 9"
    )
