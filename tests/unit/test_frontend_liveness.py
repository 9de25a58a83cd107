"""The liveness rule: slow is not dead. A component counts as gone when its connection closed
and it did not come back, or when it sent nothing for the (generous) silence limit; late
heartbeats alone, however late within that limit, never make it gone. The clock is the test's."""

from __future__ import annotations

from services.frontend.engine.liveness import Liveness
from shared.config import Config
from shared.constants import HEARTBEAT_INTERVAL_S, RECONNECT_GRACE_S

LIMIT = 60.0


def test_never_heard_is_not_gone() -> None:
    assert Liveness(LIMIT).gone("scheduler", now=1e6) is None  # starting, not dead


def test_late_heartbeats_are_slow_not_dead() -> None:
    """A starved process: beats 0.5 s apart, then 10, 30 and 59 s apart (the old 10 s rule
    declared the last three dead); its connection stays open all along."""
    liveness, now = Liveness(LIMIT), 0.0
    for gap in [HEARTBEAT_INTERVAL_S] * 4 + [10.5, 30.0, 59.0]:
        liveness.beat("tokenizer-a", now, connection=7)
        for t in range(int(gap)):  # the watchdog looks all along the gap
            assert liveness.gone("tokenizer-a", now + t) is None
        now += gap
    assert liveness.gone("tokenizer-a", now) is None


def test_silent_past_the_limit_is_gone_and_a_beat_brings_it_back() -> None:
    liveness = Liveness(LIMIT)
    liveness.beat("executor-0", 100.0, connection=7)
    assert liveness.gone("executor-0", 100.0 + LIMIT) is None  # exactly the limit: still fine
    assert liveness.gone("executor-0", 161.0) == "no heartbeat from executor-0 for 61 s"
    liveness.beat("executor-0", 170.0, connection=7)  # it was only stuck
    assert liveness.gone("executor-0", 171.0) is None


def test_a_closed_connection_is_gone_after_the_grace() -> None:
    """A process that exits: the kernel closes its connection, no beat comes again."""
    liveness = Liveness(LIMIT)
    liveness.beat("tokenizer-a", 10.0, connection=7)
    liveness.beat("tokenizer-b", 10.0, connection=8)
    liveness.closed(7, now=10.2)
    assert liveness.gone("tokenizer-a", 10.2 + RECONNECT_GRACE_S - 0.1) is None
    assert liveness.gone("tokenizer-a", 10.2 + RECONNECT_GRACE_S) == (
        "tokenizer-a is gone (its connection closed 10 s ago)"
    )
    assert liveness.gone("tokenizer-b", 10.2 + RECONNECT_GRACE_S) is None  # its own is open


def test_a_closed_connection_then_a_beat_is_a_reconnect() -> None:
    """A live process whose connection broke reconnects (a new descriptor, or the same number
    again) and beats: alive, however long afterwards the grace would have ended."""
    liveness = Liveness(LIMIT)
    liveness.beat("scheduler", 10.0, connection=7)
    liveness.closed(7, now=10.5)
    liveness.beat("scheduler", 11.0, connection=9)
    assert liveness.gone("scheduler", 30.0) is None
    liveness.closed(7, now=31.0)  # the old descriptor again: no longer its
    assert liveness.gone("scheduler", 40.0) is None


def test_a_reused_descriptor_read_out_of_order_is_cleared_by_the_next_beat() -> None:
    """The new connection took the closed one's number, and its first beat was read before the
    notice that the old one closed: suspected for a beat, not gone."""
    liveness = Liveness(LIMIT)
    liveness.beat("executor-0", 10.0, connection=7)
    liveness.beat("executor-0", 10.4, connection=7)  # on the new connection, same number
    liveness.closed(7, now=10.45)  # the old connection's notice, read late
    liveness.beat("executor-0", 10.9, connection=7)
    assert liveness.gone("executor-0", 10.45 + RECONNECT_GRACE_S + 1) is None


def test_closing_an_unknown_connection_or_one_without_a_descriptor_says_nothing() -> None:
    liveness = Liveness(LIMIT)
    liveness.beat("tokenizer-a", 10.0)  # over inproc://: no descriptor, silence alone judges
    liveness.closed(7, now=10.1)  # the launcher's notice socket, a fuzzer, a client gone
    assert liveness.gone("tokenizer-a", 10.1 + RECONNECT_GRACE_S) is None
    silent = liveness.gone("tokenizer-a", 10.0 + LIMIT + 1)
    assert silent == "no heartbeat from tokenizer-a for 61 s"


def test_a_forgotten_component_is_not_judged() -> None:
    liveness = Liveness(LIMIT)
    liveness.beat("tokenizer-a", 10.0, connection=7)
    liveness.closed(7, now=11.0)
    liveness.forget("tokenizer-a")
    assert liveness.gone("tokenizer-a", 100.0) is None and "tokenizer-a" not in liveness.last_seen


def test_the_default_silence_limit_is_generous() -> None:
    """Many missed beats before silence counts: a loaded 2-core machine missed 20 (10 s)."""
    assert Config().component_timeout >= 100 * HEARTBEAT_INTERVAL_S
