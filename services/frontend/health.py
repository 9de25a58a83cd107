"""The engine's health, judged from what the frontend has heard: heartbeats, stats, deaths.

Pure: the engine client passes in what it has seen and when, and gets back why the engine
cannot serve now, or None when it can.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def unavailable_reason(
    *,
    now: float,
    timeout: float,
    expected: Sequence[str],
    last_seen: Mapping[str, float],
    stats_at: float | None,
    down: str | None,
    num_tokenizers: int,
    tokenizer_heard_at: float | None,
) -> str | None:
    """Why the engine cannot serve at `now`, or None when it can.

    `last_seen` holds each expected component's last heartbeat time, `stats_at` the
    scheduler's last snapshot (None before the first), `down` why a component is gone for
    good. Tokenizer workers come and go (the pool is whoever beats): the engine needs one
    that takes requests, `num_tokenizers` do (alive, not draining), and one beat last at
    `tokenizer_heard_at` (None: never). A
    component never heard from is still starting; one heard from and then silent has failed,
    and that is said first, as it is what an operator must act on.
    """
    if down is not None:
        return down
    silent = [
        f"{name} for {now - last_seen[name]:.0f} s"
        for name in expected
        if name in last_seen and now - last_seen[name] > timeout
    ]
    if num_tokenizers == 0 and tokenizer_heard_at is not None:
        if now - tokenizer_heard_at <= timeout:
            return "every tokenizer worker is draining"
        silent.append(f"any tokenizer worker for {now - tokenizer_heard_at:.0f} s")
    if silent:
        return f"no heartbeat from {', '.join(silent)}"
    unseen = [name for name in expected if name not in last_seen]
    if tokenizer_heard_at is None:
        unseen.append("a tokenizer worker")
    if unseen:
        return f"starting: waiting for {', '.join(unseen)}"
    if stats_at is None:
        return "starting: loading the model"  # every process beats; the executor is loading
    if now - stats_at > timeout:
        return "the scheduler has stopped reporting"  # alive but stuck
    return None
