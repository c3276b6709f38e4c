"""Streams of the APIs of appliance.proxy.apis that the official SDKs' helpers cannot read as a
runtime sends them, mended on their way to the client.

llama-server's Responses stream (build 11434) gives each event its `type` and `item_id` but
leaves out what OpenAI's Responses streaming events carry besides, and what the OpenAI SDK's
`responses.stream()` reads to put the answer together:

- `sequence_number` on every event;
- `output_index` on the output item and content part events and the text events, and
  `content_index` on the content part and text events;
- the `response` of `response.created` and `response.in_progress` has no `output` (nor
  `created_at` or `model`), which the SDK's snapshot appends each output item to;
- `logprobs` on the text events.

The SDK raised `TypeError: list indices must be integers or slices, not NoneType` there. The mend
adds each missing field, counting the items and parts as they come; a field the runtime gives is
never changed, and the events keep their order, their text and their timing (each is passed on
as soon as it is whole). vLLM's Responses stream, which has them, passes as it comes (the mend
knows it by its first event).

llama-server's Messages stream (build 11434) now and then begins without its `message_start`,
with the `content_block_start` that should follow it: 3 of 19 streams in a row, three clients at
once, straight to the runtime on the demo. Without it the Anthropic SDK's `messages.stream()`
has no message to put the content in and raised a bare AssertionError from
`get_final_message()`. That mend looks at the first event only: a `message_start` (and an
`error`) passes with all that follows as it comes; any other event gets a `message_start` before
it, with the model the request named and the usage the runtime did not say (0 tokens).

Imported by the proxy: nothing from the rest of the controller but appliance.proxy's own.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from appliance.proxy.apis import MESSAGES, RESPONSES
from appliance.proxy.direct import Mend

MAX_EVENT_BYTES = 8 << 20  # one event held whole before it is passed on unmended


def mend_for(kind: str, streams: bool, model: str = "") -> Mend | None:
    """What a streamed answer of `kind` passes through; None: it goes as the runtime sends it.
    Which runtime answers is not known for sure before it answers (the door's facts about the
    runtime may be from before a switch), so every Responses stream gets the mend, and the mend
    tells by the stream's first event whether it needs mending: one that carries a
    `sequence_number` (vLLM's) passes on as it comes, unparsed."""
    if kind == RESPONSES and streams:
        return ResponsesMend()
    if kind == MESSAGES and streams:
        return MessagesMend(model)
    return None


class Events:
    """Server-sent events cut from a byte stream: each whole event, as its bytes."""

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        self.pending += data
        events = []
        while True:
            end, size = _event_end(self.pending)
            if end < 0:
                break
            events.append(self.pending[: end + size])
            self.pending = self.pending[end + size :]
        return events

    def rest(self) -> bytes:
        rest, self.pending = self.pending, b""
        return rest


def _event_end(data: bytes) -> tuple[int, int]:
    """Where the first event of `data` ends (its blank line), and the blank line's size."""
    ends = [(i, len(sep)) for sep in (b"\n\n", b"\r\n\r\n") if (i := data.find(sep)) >= 0]
    return min(ends) if ends else (-1, 0)


class ResponsesMend:
    """llama-server's Responses stream, with the fields OpenAI's events carry (see the module)."""

    def __init__(self) -> None:
        self.events = Events()
        self.sequence = 0
        self.items: dict[str, int] = {}  # item id -> its output_index
        self.parts: dict[str, int] = {}  # item id -> its content parts so far
        self.faithful = False  # its first event has what OpenAI's carry: the rest passes as is

    def feed(self, data: bytes) -> bytes:
        if self.faithful:
            return data
        out = b"".join(self.mend(event) for event in self.events.feed(data))
        if self.faithful:  # found in this data: what is left of it passes as it is
            return out + self.events.rest()
        if len(self.events.pending) > MAX_EVENT_BYTES:
            out += self.events.rest()  # not an event stream this mend knows: as it is
        return out

    def end(self) -> bytes:
        return self.events.rest()

    def mend(self, event: bytes) -> bytes:
        lines = event.rstrip(b"\r\n").splitlines()
        for i, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            try:
                data = json.loads(line[5:])
            except ValueError:
                return event  # [DONE], or not JSON: as it is
            if not isinstance(data, dict) or not isinstance(data.get("type"), str):
                return event
            self.add_fields(data)
            if self.faithful:
                return event
            lines[i] = b"data: " + json.dumps(data, ensure_ascii=False).encode()
            return b"\n".join(lines) + b"\n\n"
        return event

    def add_fields(self, data: dict[str, Any]) -> None:
        kind: str = data["type"]
        if self.sequence == 0 and "sequence_number" in data:
            self.faithful = True
            return
        data.setdefault("sequence_number", self.sequence)
        self.sequence += 1
        if kind in ("response.created", "response.in_progress"):
            response = data.get("response")
            if isinstance(response, dict):
                response.setdefault("output", [])
                response.setdefault("created_at", int(time.time()))
                response.setdefault("object", "response")
        elif kind in ("response.output_item.added", "response.output_item.done"):
            item = data.get("item")
            item_id = item.get("id") if isinstance(item, dict) else None
            if isinstance(item_id, str):
                index = self.items.setdefault(item_id, len(self.items))
                data.setdefault("output_index", index)
        elif "item_id" in data and isinstance(data["item_id"], str):
            item_id = data["item_id"]
            data.setdefault("output_index", self.items.get(item_id, 0))
            if kind == "response.content_part.added":
                self.parts[item_id] = self.parts.get(item_id, 0) + 1
            if kind.startswith(("response.content_part.", "response.output_text.")):
                data.setdefault("content_index", max(self.parts.get(item_id, 1) - 1, 0))
            if kind in ("response.output_text.delta", "response.output_text.done"):
                data.setdefault("logprobs", [])


class MessagesMend:
    """A Messages stream with its `message_start` first, which llama-server sometimes leaves
    out (see the module); a stream that has it passes as it comes, unparsed."""

    FIRST = (b"message_start", b"error")

    def __init__(self, model: str) -> None:
        self.events = Events()
        self.model = model
        self.looked = False  # the first event was seen: the rest passes as it comes

    def feed(self, data: bytes) -> bytes:
        if self.looked:
            return data
        events = self.events.feed(data)
        if not events:
            if len(self.events.pending) > MAX_EVENT_BYTES:  # not a stream this mend knows
                self.looked = True
                return self.events.rest()
            return b""
        self.looked = True
        start = b"" if _kind(events[0]) in self.FIRST else self.start()
        return start + b"".join(events) + self.events.rest()

    def end(self) -> bytes:
        return self.events.rest()

    def start(self) -> bytes:
        message: dict[str, Any] = {
            "id": "msg_" + os.urandom(12).hex(), "type": "message", "role": "assistant",
            "model": self.model, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }  # fmt: skip
        data = json.dumps({"type": "message_start", "message": message}).encode()
        return b"event: message_start\ndata: " + data + b"\n\n"


def _kind(event: bytes) -> bytes:
    """An event's name: its `event:` line, else its data's `type`."""
    for line in event.splitlines():
        if line.startswith(b"event:"):
            return line[6:].strip()
        if line.startswith(b"data:"):
            try:
                data = json.loads(line[5:])
            except ValueError:
                return b""
            kind = data.get("type") if isinstance(data, dict) else None
            return kind.encode() if isinstance(kind, str) else b""
    return b""
