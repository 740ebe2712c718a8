"""Stored responses of `/v1/responses`: a bounded in-memory LRU, per router process.

A response stored (its request's `store` not false) keeps its answer object (what
`GET /v1/responses/{id}` returns) and its whole conversation: the stored conversation of its
`previous_response_id`, then its own input items, then its output items, so a follow-up
continues from it alone even after its ancestors were evicted. Bounded by a count and by bytes
(the JSON size of both); the least recently used go first. An entry larger than the byte bound
is not kept. Routers do not share the store: behind several routers, a follow-up must reach
the router that answered (sticky sessions), or it gets `previous_response_not_found`.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object
    items: list[dict[str, Any]]  # the conversation up to and including its output
    nbytes: int


class ResponseStore:
    def __init__(self, max_responses: int, max_bytes: int) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(self, response_id: str, body: dict[str, Any], items: list[dict[str, Any]]) -> bool:
        """Keep it (evicting the least recently used over the bounds); False if it alone is
        over the byte bound or nothing may be stored."""
        nbytes = len(json.dumps(body)) + len(json.dumps(items))
        if self.max_responses <= 0 or nbytes > self.max_bytes:
            return False
        self.delete(response_id)
        self._entries[response_id] = StoredResponse(body, items, nbytes)
        self.nbytes += nbytes
        while len(self._entries) > self.max_responses or self.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.nbytes -= entry.nbytes
        return True
