"""A response's stream events, as OpenAI names them, each with its ``sequence_number``. Pure.

The sequence is a function of the response's chunks (in ``seq`` order) and its end, so a stream
replayed from the chunks topic numbers every event as the first one did, and a resumed stream
(``starting_after=N``) gives each event once:

0. ``response.created`` (the response queued), 1. ``response.in_progress``,
2. ``response.output_item.added``, 3. ``response.content_part.added``,
4… one ``response.output_text.delta`` per chunk with text, then ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` and ``response.completed`` (or
``response.incomplete``, when it stopped at max_output_tokens). A response that failed or was
cancelled ends with ``response.failed`` (its ``status`` says which: OpenAI names no stream event
for a cancel).
"""

from __future__ import annotations

import json
from typing import Any

from pipeline.openai_api.responses import output_item, render
from pipeline.responses.record import COMPLETED, IN_PROGRESS, INCOMPLETE, QUEUED, StoredResponse, message_id


class Events:
    def __init__(self, rec: StoredResponse):
        self.rec = rec
        self.seq = 0
        self.item_id = message_id(rec.id)
        self.text: list[str] = []

    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type_, **fields, "sequence_number": self.seq}
        self.seq += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        rec = self.rec
        return [self._event("response.created", response=render(rec, QUEUED)),
                self._event("response.in_progress", response=render(rec, IN_PROGRESS)),
                self._event("response.output_item.added", output_index=0,
                            item=output_item(rec, None, "in_progress")),
                self._event("response.content_part.added", item_id=self.item_id, output_index=0, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def delta(self, text: str) -> dict[str, Any] | None:
        if not text:
            return None
        self.text.append(text)
        return self._event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                           delta=text, logprobs=[])

    def closing(self, final: StoredResponse) -> list[dict[str, Any]]:
        doc = render(final)
        if final.status not in (COMPLETED, INCOMPLETE):
            return [self._event("response.failed", response=doc)]
        text = final.output_text if final.output_text is not None else "".join(self.text)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = output_item(final, text, "completed" if final.status == COMPLETED else "incomplete")
        return [self._event("response.output_text.done", item_id=self.item_id, output_index=0, content_index=0,
                            text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=self.item_id, output_index=0, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=0, item=item),
                self._event("response.completed" if final.status == COMPLETED else "response.incomplete",
                            response=doc)]


def sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
