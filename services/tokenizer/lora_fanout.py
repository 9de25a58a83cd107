"""Runtime LoRA loads and unloads on every engine replica (--data-parallel-size), carried out by
the tokenizer worker a frontend sent them to, in rounds: a round's requests go out together,
and the next round starts once each of them is answered.

    load:    load on replica 0 (its scheduler names the id) ─▶ load on the others, as that id
             ─▶ commit on the others ─▶ commit on replica 0 ─▶ success
             a refusal in any round: discard on the others that took it ─▶ discard on replica 0
             ─▶ that refusal
    unload:  unload on replica 0, which answers with the next id it would give ─▶ unload on
             the others, if taken before that id ─▶ success if any replica had it

Nothing is named before every replica holds it, so a request that names an adapter finds it on
whichever replica it is sent to, and a load that one replica refuses leaves nothing behind.
With one replica the same rounds run, with no others.

Replica 0 is where two changes of one name meet, so the replicas never end up disagreeing
(tests/unit/test_lora_fanout.py delivers concurrent changes in random orders):
- a load holds the name there from its first round to its last: no other load of the name
  starts meanwhile, and as it commits there last, one named there is named everywhere;
- an unload passes there first and ends any load of the name still under way there (whose
  commit or load then fails there, so that it is discarded everywhere); on the others it
  unloads only an adapter taken before the next id replica 0 would give, never a load that
  started after it;
- discards and commits name the load's id, which no other load has.

A change not answered within LORA_LOAD_TIMEOUT_S (a replica gone or stuck) ends with an error,
and its load is discarded wherever it may be held.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.constants import LORA_LOAD_TIMEOUT_S
from shared.protocol import (
    LoraAdapterListing,
    LoraAdapterRequest,
    LoraAdapterResult,
    ParameterError,
    RequestError,
)

logger = logging.getLogger(__name__)
Send = Callable[[int, LoraAdapterRequest], None]  # (replica, request to its scheduler)
Answer = Callable[[LoraAdapterResult], None]  # to the frontend that asked


@dataclass(frozen=True)
class Round:
    action: str  # what each replica's scheduler is asked: load, commit, discard, unload
    replicas: list[int]


@dataclass
class LoraChange:
    """One load or unload on its way through the replicas."""

    request: LoraAdapterRequest  # the frontend's
    deadline: float  # time.monotonic()
    rounds: deque[Round]  # those still to come
    action: str = ""  # the current round's
    waiting: set[int] = field(default_factory=set)  # replicas the current round waits for
    # A load's id, once replica 0 named it; an unload's bound: the next id replica 0 would give
    lora_id: int | None = None
    holders: set[int] = field(default_factory=set)  # replicas that took the load
    unloaded: bool = False  # an unload found the adapter on some replica
    error: RequestError | None = None  # the first refusal
    listings: dict[int, LoraAdapterListing] = field(default_factory=dict)  # each one's last


class LoraFanout:
    def __init__(self, num_replicas: int, send: Send, answer: Answer) -> None:
        self.num_replicas = num_replicas
        self._send, self._answer = send, answer
        self.changes: dict[str, LoraChange] = {}  # by request_id

    def start(self, request: LoraAdapterRequest, now: float) -> None:
        others = list(range(1, self.num_replicas))
        if request.action == "load":
            rounds = [
                Round("load", [0]),
                Round("load", others),
                Round("commit", others),
                Round("commit", [0]),
            ]
        elif request.action == "unload":
            rounds = [Round("unload", [0]), Round("unload", others)]
        else:
            error = RequestError.of(ParameterError("action", "must be load or unload"))
            self._answer(LoraAdapterResult(request_id=request.request_id, error=error))
            return
        change = LoraChange(request, now + LORA_LOAD_TIMEOUT_S, deque(rounds))
        self.changes[request.request_id] = change
        self._next_round(change)

    def on_result(self, replica: int, result: LoraAdapterResult) -> None:
        """A replica's scheduler answered; answers of changes that ended are dropped."""
        change = self.changes.get(result.request_id)
        if change is None or replica not in change.waiting:
            return
        change.waiting.discard(replica)
        for listing in result.listings:
            change.listings[listing.replica] = listing
        if replica == 0 and change.lora_id is None:  # a load's id, an unload's bound
            change.lora_id = result.lora_id
        if result.error is None and change.action == "load":
            change.holders.add(replica)
        elif result.error is None:
            change.unloaded |= change.action == "unload"
        elif change.action != "discard" and change.error is None:
            change.error = result.error
        if not change.waiting:
            self._next_round(change)

    def expire(self, now: float) -> None:
        """End the changes past their deadline with an error; discard their loads."""
        for change in [c for c in self.changes.values() if now >= c.deadline]:
            late = sorted(change.waiting)
            message = f"replicas {late} did not answer in {LORA_LOAD_TIMEOUT_S:g} s"
            request = change.request
            logger.error("LoRA %s of %r: %s", request.action, request.lora_name, message)
            if change.request.action == "load":  # discard is idempotent
                # Without the id (replica 0 still reading), replica 0 finds the load by its
                # request; no other replica has it yet.
                for replica in sorted(change.holders | change.waiting):
                    self._send(replica, self._message(change, "discard"))
            change.error = RequestError.unavailable(message)
            change.unloaded = False
            self._finish(change)

    def _next_round(self, change: LoraChange) -> None:
        loading = change.request.action == "load"
        if change.action and change.lora_id is None:
            change.rounds.clear()  # replica 0 refused the load, or could not take the unload
        elif loading and change.error is not None and change.action != "discard":
            # A refusal: forget the load on the others first, then free its name on replica 0.
            others = sorted(change.holders - {0})
            first = [0] if 0 in change.holders else []
            change.rounds = deque([Round("discard", others), Round("discard", first)])
            if change.holders:
                logger.warning(
                    "LoRA adapter %r: a replica refused it (%s); discarding it on replicas %s",
                    change.request.lora_name,
                    change.error.message,
                    sorted(change.holders),
                )
        while change.rounds:
            next_round = change.rounds.popleft()
            if next_round.replicas:
                change.action, change.waiting = next_round.action, set(next_round.replicas)
                for replica in next_round.replicas:
                    self._send(replica, self._message(change, next_round.action))
                return
        self._finish(change)

    def _message(self, change: LoraChange, action: str) -> LoraAdapterRequest:
        request = change.request
        return LoraAdapterRequest(
            request_id=request.request_id,
            action=action,
            lora_name=request.lora_name,
            lora_path=request.lora_path if action == "load" else None,
            lora_id=change.lora_id,
        )

    def _finish(self, change: LoraChange) -> None:
        del self.changes[change.request.request_id]
        error = None if change.unloaded else change.error
        result = LoraAdapterResult(
            request_id=change.request.request_id,
            error=error,
            lora_id=change.lora_id if error is None and change.request.action == "load" else None,
            listings=[change.listings[r] for r in sorted(change.listings)],
        )
        self._answer(result)
