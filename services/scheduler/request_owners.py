"""Which tokenizer worker each unfinished request came from, and how many each has now (what
the KV events tell routers: each worker's share of an engine's load)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator


class RequestOwners:
    def __init__(self) -> None:
        self._owner: dict[str, bytes] = {}  # request_id -> identity of its tokenizer worker
        self.counts: Counter[bytes] = Counter()  # identity -> its requests here

    def add(self, request_id: str, owner: bytes) -> None:
        self.pop(request_id)
        self._owner[request_id] = owner
        self.counts[owner] += 1

    def get(self, request_id: str) -> bytes | None:
        return self._owner.get(request_id)

    def pop(self, request_id: str) -> bytes | None:
        """Forget a request (ended); its owner, or None if it had none here."""
        owner = self._owner.pop(request_id, None)
        if owner is not None:
            self.counts[owner] -= 1
            if not self.counts[owner]:
                del self.counts[owner]
        return owner

    def __iter__(self) -> Iterator[str]:
        return iter(self._owner)

    def __len__(self) -> int:
        return len(self._owner)
