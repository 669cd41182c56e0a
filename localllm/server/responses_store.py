"""The Responses API's stored responses: what ``GET /v1/responses/{id}`` answers and what
``previous_response_id`` continues from.

The store lives in the server's memory only (a restart forgets it) and is bounded two ways: at most
:data:`MAX_RESPONSES` responses and at most :data:`MAX_BYTES` bytes of them (each counted as its
body's, its conversation's and its input items' JSON size). Past either limit the oldest are evicted
first; a response larger than the whole byte budget is not stored at all. An evicted or never stored
id is a 404, as an unknown one is.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: Responses kept at most.
MAX_RESPONSES = 1024
#: Bytes of stored responses (bodies and conversations, as JSON) kept at most.
MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class StoredResponse:
    """A response as ``GET`` returns it, the whole conversation it ended (chat messages: the
    earlier turns, the input and the reply, without the instructions, which a continuation does not
    inherit), and its own request's input items as ``GET .../input_items`` lists them."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]]
    input_items: list[dict[str, Any]]
    size: int


class ResponseStore:
    """Stored responses by id, oldest evicted first past :data:`MAX_RESPONSES` or :data:`MAX_BYTES`.
    Used from the event loop only."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]], input_items: list[dict[str, Any]]) -> bool:
        """Store ``body`` under its ``id``; False where it alone is over the byte budget (not stored)."""
        size = sum(len(json.dumps(part, ensure_ascii=False)) for part in (body, conversation, input_items))
        if size > self.max_bytes:
            return False
        self.delete(body["id"])
        self._items[body["id"]] = StoredResponse(body, conversation, input_items, size)
        self.bytes += size
        while len(self._items) > self.max_responses or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size
        return True

    def get(self, rid: str) -> StoredResponse | None:
        return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        old = self._items.pop(rid, None)
        if old is None:
            return False
        self.bytes -= old.size
        return True
