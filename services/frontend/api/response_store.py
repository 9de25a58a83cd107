"""The responses a frontend keeps (`store: true`): for `previous_response_id`, and for
`GET` and `DELETE /v1/responses/{id}`. Bounded: the oldest go first. In memory, per
frontend process: with several frontends (--api-server-count, or replicas behind a balancer)
a follow-up must reach the frontend that answered, as with vLLM's store."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # id -> (the response object, the conversation up to and including its output)
        self._kept: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        if self.capacity <= 0:
            return
        self._kept[response["id"]] = (response, items)
        self._kept.move_to_end(response["id"])
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def response(self, response_id: str) -> dict[str, Any] | None:
        kept = self._kept.get(response_id)
        return None if kept is None else kept[0]

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        kept = self._kept.get(response_id)
        return None if kept is None else kept[1]

    def delete(self, response_id: str) -> bool:
        return self._kept.pop(response_id, None) is not None
