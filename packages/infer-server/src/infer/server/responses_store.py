"""The responses that `previous_response_id` continues and GET /v1/responses/{id} answers: kept in
the server's memory (lost on restart), the most recently stored `MAX_STORED_RESPONSES` of them.

An entry is a response object, its request's input items (as sent; its instructions are not
part of the conversation, as OpenAI does not carry them over) and the entry it continued, so a
chain of follow-ups holds each turn once. A follow-up's conversation is the stored one's, its
input, then its output. A response sent with `store: false` is not kept (nor can it be
continued); an entry dropped from the store lives on while a kept follow-up continues it.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# Bounded by count, not bytes: an entry holds one request's input items (at most a body,
# --max-request-bytes) and its answer, the earlier turns being shared with the entry before it.
# 1024 keep a long agent loop (one entry per turn) continuable; the least recently used goes first.
MAX_STORED_RESPONSES = 1024


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as the client got it
    input_items: list[Any]  # its own request's input
    previous: "StoredResponse | None" = None  # the response it continued

    def conversation(self) -> list[Any]:
        """The items a follow-up continues: every turn of the chain, each its input then its
        output, oldest first."""
        turns, stored = [], self
        while stored is not None:  # a loop, not recursion: a chain may be thousands of turns
            turns.append(stored.input_items + stored.response["output"])
            stored = stored.previous
        return [item for turn in reversed(turns) for item in turn]


class ResponseStore:
    """Least recently used out first: storing or reading an entry makes it the newest."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES):
        self.max_responses = max_responses
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        response_id = stored.response["id"]
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_responses:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        """Forgets the response; False when it was not stored."""
        return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)
