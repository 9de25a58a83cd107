"""Which tokenizer workers the frontend can send to, and which of them holds each request.

The pool is whoever beats: a worker joins with its first heartbeat and leaves when it counts as
gone (services/frontend/engine/liveness.py: its connection closed, or silent past the timeout), so
compose `--scale` and Kubernetes replicas grow and shrink it with no configuration.
A request stays with the worker that took it (its detokenizer lives there, and the engine
sends its outputs there), so a worker that goes, or comes back as a new process under the
same name (a new heartbeat session), takes its requests with it: the caller fails them.

Pure: no sockets, no clock; the engine client passes the time in.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class _Worker:
    session: str  # the process's heartbeat session: a new one means a restart
    draining: bool = False  # finishing its requests before it exits: it takes no new ones
    request_ids: set[str] = dataclasses.field(default_factory=set)


class TokenizerPool:
    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        self._owner: dict[str, str] = {}  # request_id -> worker name
        self.last_heard: float | None = None  # when any worker last beat

    @property
    def names(self) -> list[str]:
        return sorted(self._workers)

    @property
    def accepting(self) -> list[str]:
        """The workers that take new requests (alive, not draining)."""
        return sorted(n for n, w in self._workers.items() if not w.draining)

    def beat(self, name: str, session: str, now: float, draining: bool = False) -> list[str]:
        """A worker's heartbeat. Returns the requests it held before a restart (lost)."""
        self.last_heard = now
        worker = self._workers.get(name)
        lost = []
        if worker is None or worker.session != session:
            lost = self.leave(name)
            worker = self._workers[name] = _Worker(session)
        worker.draining = draining
        return lost

    def draining(self, name: str) -> bool:
        worker = self._workers.get(name)
        return worker is not None and worker.draining

    def leave(self, name: str) -> list[str]:
        """Drop a worker (gone, restarted, unreachable); returns the requests it held."""
        worker = self._workers.pop(name, None)
        if worker is None:
            return []
        for request_id in worker.request_ids:
            del self._owner[request_id]
        return sorted(worker.request_ids)

    def assign(self, request_id: str) -> str | None:
        """Give a new request to the least-loaded worker; None when none takes requests."""
        accepting = self.accepting
        if not accepting:
            return None
        name = min(accepting, key=lambda n: (len(self._workers[n].request_ids), n))
        self._workers[name].request_ids.add(request_id)
        self._owner[request_id] = name
        return name

    def owner(self, request_id: str) -> str | None:
        return self._owner.get(request_id)

    def check_invariants(self) -> None:
        """Each owned request is held by its owner alone, and only by it."""
        held = {r: n for n, w in self._workers.items() for r in w.request_ids}
        assert held == self._owner, (held, self._owner)

    def release(self, request_id: str) -> None:
        """The request is over here: it no longer counts against its worker."""
        name = self._owner.pop(request_id, None)
        if name is not None:
            self._workers[name].request_ids.discard(request_id)
