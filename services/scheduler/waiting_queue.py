"""The requests that wait to run, in the order they will be admitted, with exact counts.

Two policies, as vLLM's `--scheduling-policy`:
- `fcfs`: by arrival; a preempted request goes back to the front (it was admitted first).
- `priority`: by (priority, arrival), lower first; a preempted request goes back to its place.

The queue counts its requests and the tokens they owe (prompt, plus outputs for a preempted
request that recomputes them), as they were when each entered: admission control bounds both
exactly (--max-queued-requests, --max-queued-tokens).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator

from services.scheduler.request import Request

POLICIES = ("fcfs", "priority")


def priority_key(request: Request) -> tuple[int, float, int]:
    """The order of the priority policy: lower priority value first, then earlier arrival."""
    return (request.priority, request.arrival_time, request.arrival_index)


class WaitingQueue:
    def __init__(self, policy: str = "fcfs") -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.policy = policy
        self._requests: deque[Request] = deque()  # fcfs: arrival order; priority: sorted
        self._tokens: dict[str, int] = {}  # request_id -> tokens owed when it entered
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def add(self, request: Request) -> None:
        """A new request, behind every request that runs before it."""
        if self.policy == "priority":
            self._requests.insert(self._place(request), request)
        else:
            self._requests.append(request)
        self._count(request)

    def requeue(self, request: Request) -> None:
        """A preempted request: first under fcfs, at its place under priority."""
        if self.policy == "priority":
            self._requests.insert(self._place(request), request)
        else:
            self._requests.appendleft(request)
        self._count(request)

    def peek(self) -> Request:
        return self._requests[0]

    def first(self, admissible: Callable[[Request], bool]) -> Request | None:
        """The first request in order that `admissible` takes; those before it keep their
        places (e.g. requests of a LoRA adapter that has no slot this step)."""
        return next((request for request in self._requests if admissible(request)), None)

    def pop(self) -> Request:
        request = self._requests.popleft()
        self._uncount(request)
        return request

    def remove(self, request: Request) -> None:
        self._requests.remove(request)
        self._uncount(request)

    def _place(self, request: Request) -> int:
        return bisect.bisect_right(self._requests, priority_key(request), key=priority_key)

    def _count(self, request: Request) -> None:
        self._tokens[request.request_id] = request.num_tokens
        self.num_tokens += request.num_tokens

    def _uncount(self, request: Request) -> None:
        self.num_tokens -= self._tokens.pop(request.request_id)

    def check_invariants(self) -> None:
        assert self.num_tokens == sum(self._tokens.values()), "token count drifted"
        assert set(self._tokens) == {r.request_id for r in self._requests}
        if self.policy == "priority":
            keys = [priority_key(r) for r in self._requests]
            assert keys == sorted(keys), "the priority queue is out of order"
