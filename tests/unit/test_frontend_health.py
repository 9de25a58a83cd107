"""How /health words the engine's state: starting is not failing. Which component counts as
gone is the liveness rule's (tests/unit/test_frontend_liveness.py); here it judges silence."""

from __future__ import annotations

from services.frontend.engine.health import (
    engine_failure,
    tokenizer_pool_reason,
    unavailable_reason,
)
from services.frontend.engine.liveness import Liveness

EXPECTED = ["scheduler", "executor-0"]
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
        gone=gone(last_seen, now),
        stats_at=stats_at,
        down=down,
    )


def gone(last_seen: dict[str, float], now: float = 100.0) -> list[str]:
    """The liveness rule's verdicts on the expected components, with these beats."""
    liveness = Liveness(TIMEOUT)
    for name, at in last_seen.items():
        liveness.beat(name, at)
    verdicts = [liveness.gone(name, now) for name in EXPECTED]
    return [why for why in verdicts if why is not None]


def pool_reason(num_accepting: int, heard_at: float | None) -> str | None:
    return tokenizer_pool_reason(
        now=100.0, timeout=TIMEOUT, num_accepting=num_accepting, heard_at=heard_at
    )


def beating(*names: str, at: float = 99.0) -> dict[str, float]:
    return dict.fromkeys(names or EXPECTED, at)


def test_nothing_heard_yet_is_starting() -> None:
    assert reason({}) == "starting: waiting for scheduler, executor-0"
    assert pool_reason(0, heard_at=None) == "starting: waiting for a tokenizer worker"


def test_waits_only_for_the_components_not_heard_from() -> None:
    assert reason(beating("scheduler")) == "starting: waiting for executor-0"


def test_any_number_of_tokenizer_workers_will_do() -> None:
    assert pool_reason(1, heard_at=99.0) is None
    assert pool_reason(7, heard_at=99.0) is None


def test_tokenizer_workers_that_all_drain_take_no_requests() -> None:
    assert pool_reason(0, heard_at=99.5) == (
        "no tokenizer worker takes requests (every one is draining or unreachable)"
    )


def test_the_last_tokenizer_worker_gone_is_a_failure() -> None:
    assert pool_reason(0, heard_at=85.0) == "no heartbeat from any tokenizer worker for 15 s"


def test_every_component_beating_without_stats_is_loading() -> None:
    assert reason(beating()) == "starting: loading the model"


def test_healthy_once_stats_come() -> None:
    assert reason(beating(), stats_at=99.9) is None
    assert reason(beating(at=90.0), stats_at=90.0) is None  # exactly the timeout: still fine


def test_a_component_heard_then_silent_is_a_failure_with_its_silence() -> None:
    last_seen = {**beating(), "executor-0": 87.6}
    assert reason(last_seen, stats_at=99.9) == "no heartbeat from executor-0 for 12 s"
    last_seen["scheduler"] = 70.0
    assert reason(last_seen, stats_at=99.9) == (
        "no heartbeat from scheduler for 30 s; no heartbeat from executor-0 for 12 s"
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


def test_a_stalled_component_is_a_failure_though_it_beats() -> None:
    stalled = {"executor-0": "step 7 has made no progress for 31 s"}
    assert unavailable_reason(
        now=100.0,
        timeout=TIMEOUT,
        expected=EXPECTED,
        last_seen=beating(),
        gone=[],
        stats_at=99.9,
        down=None,
        stalled=stalled,
    ) == ("executor-0 is stalled: step 7 has made no progress for 31 s")


def test_liveness_ignores_starting_but_not_failures() -> None:
    def failure(last_seen: dict[str, float], stats_at: float | None = None) -> str | None:
        return engine_failure(
            now=100.0, timeout=TIMEOUT, gone=gone(last_seen), stats_at=stats_at, down=None
        )

    assert failure({}) is None  # nothing heard yet: starting, alive
    assert failure(beating()) is None  # loading the model
    assert failure({"scheduler": 80.0}) == "no heartbeat from scheduler for 20 s"
    assert failure(beating(), stats_at=80.0) == "the scheduler has stopped reporting"
