"""The engine's health, judged from what the frontend has heard: heartbeats, stats, deaths,
closed connections (which component counts as gone is services/frontend/engine/liveness.py's rule).

Pure: the engine client passes in what it has seen and when, and gets back why the engine
(or the tokenizer pool) cannot serve now, or None when it can.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def unavailable_reason(
    *,
    now: float,
    timeout: float,
    expected: Sequence[str],
    last_seen: Mapping[str, float],
    gone: Sequence[str],
    stats_at: float | None,
    down: str | None,
    stalled: Mapping[str, str] | None = None,
) -> str | None:
    """Why the engine cannot serve at `now`, or None when it can (readiness: /ready).

    `last_seen` holds each component heard from and when it last beat, `gone` why each expected
    component that counts as gone does (services/frontend/engine/liveness.py), `stats_at` the
    scheduler's last snapshot (None before the first), `down` why a component is gone for good,
    `stalled` what each component whose main loop is stuck says of it. A component never heard
    from is still starting; a failure is said first, as it is what an operator must act on.
    """
    failure = engine_failure(
        now=now, timeout=timeout, gone=gone, stats_at=stats_at, down=down, stalled=stalled
    )
    return failure or starting_reason(expected=expected, last_seen=last_seen, stats_at=stats_at)


def starting_reason(
    *, expected: Sequence[str], last_seen: Mapping[str, float], stats_at: float | None
) -> str | None:
    """What the engine still waits for before it serves (it is alive meanwhile), or None."""
    unseen = [name for name in expected if name not in last_seen]
    if unseen:
        return f"starting: waiting for {', '.join(unseen)}"
    if stats_at is None:
        return "starting: loading the model"  # every process beats; the executor is loading
    return None


def engine_failure(
    *,
    now: float,
    timeout: float,
    gone: Sequence[str],
    stats_at: float | None,
    down: str | None,
    stalled: Mapping[str, str] | None = None,
) -> str | None:
    """Why the engine has failed (liveness: /health), or None while it is alive, starting
    or not, slow or not: a component gone (exited, disconnected, or silent past the timeout),
    stuck while it still beats, or a scheduler whose snapshots stopped for `timeout`."""
    if down is not None:
        return down
    if stalled:
        return "; ".join(f"{name} is stalled: {why}" for name, why in sorted(stalled.items()))
    if gone:
        return "; ".join(gone)
    if stats_at is not None and now - stats_at > timeout:
        return "the scheduler has stopped reporting"  # alive but stuck
    return None


def tokenizer_pool_reason(
    *, now: float, timeout: float, num_accepting: int, heard_at: float | None
) -> str | None:
    """Why no new request can be taken by a tokenizer worker, or None when one can.

    Workers come and go (the pool is whoever beats): `num_accepting` take requests now (alive,
    not draining), and one beat last at `heard_at` (None: never). This refuses new requests
    only: the requests a worker held end when it goes, the others run on.
    """
    if heard_at is None:
        return "starting: waiting for a tokenizer worker"
    if num_accepting:
        return None
    if now - heard_at > timeout:
        return f"no heartbeat from any tokenizer worker for {now - heard_at:.0f} s"
    return "no tokenizer worker takes requests (every one is draining or unreachable)"
