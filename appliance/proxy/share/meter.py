"""The tokens of an answer, as the runtime counted them, read from the answer on its way to the
client: the `usage` object of a JSON answer, or of the events of a stream (OpenAI's last chunk,
Responses' `response.completed`, Anthropic's `message_start` and `message_delta`).

A chat or completion stream carries its usage only when the client asks for it
(`stream_options.include_usage`). When the client did not, the door asks for it (`ask_usage`)
and takes the chunk that carries it, which has no choices, out of the stream again
(`Meter(strip=True)`): the client gets the stream it asked for, and the key its tokens.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from appliance.proxy import Message, Send

MAX_KEPT = 1 << 20  # of a JSON answer, or of one stream line, read for its usage


def ask_usage(data: dict[str, Any]) -> bool:
    """Ask a streamed chat or completion request for its usage, if it did not; whether it did
    not (its answer's usage chunk is then the door's, and taken out)."""
    options = data.get("stream_options")
    if data.get("stream") is not True or (
        isinstance(options, dict) and options.get("include_usage")
    ):
        return False
    data["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }
    return True


def usage_in(value: Any) -> tuple[int, int] | None:
    """(tokens in, tokens out) of the first `usage` object found in a parsed answer or event."""
    if isinstance(value, dict):
        usage = value.get("usage")
        if isinstance(usage, dict):
            tokens_in = _int(usage.get("prompt_tokens", usage.get("input_tokens")))
            tokens_out = _int(usage.get("completion_tokens", usage.get("output_tokens")))
            return tokens_in, tokens_out
        for inner in ("response", "message"):  # Responses' and Anthropic's events nest it
            if isinstance(value.get(inner), dict):
                return usage_in(value[inner])
    return None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


class Meter:
    """A `send` that passes the answer on and reads its usage on the way (`tokens_in`,
    `tokens_out`: the most any usage object of the answer said). `strip`: the answer's usage
    chunk was asked for by the door, and is not sent on."""

    def __init__(self, send: Send, strip: bool = False) -> None:
        self.send = send
        self.strip = strip
        self.status = 0
        self.stream = False
        self.tokens_in = 0
        self.tokens_out = 0
        self.kept = bytearray()  # a JSON answer so far, or a stream's unfinished line or event

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message.get("status", 0))
            self.stream = any(
                k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                for k, v in message.get("headers", ())
            )
        elif message["type"] == "http.response.body":
            body = bytes(message.get("body", b""))
            more = bool(message.get("more_body", False))
            if self.stream:
                body = self.events(body, more)
            else:
                self.whole(body, more)
            message = {**message, "body": body}
        await self.send(message)

    def whole(self, body: bytes, more: bool) -> None:
        if len(self.kept) + len(body) <= MAX_KEPT:
            self.kept += body
        if not more and self.status < 400:
            with contextlib.suppress(ValueError):  # not JSON: no usage to read
                self.saw(json.loads(bytes(self.kept)))
            self.kept.clear()

    def events(self, body: bytes, more: bool) -> bytes:
        """What goes on of these stream bytes: all of them, but the door's usage chunk."""
        if not self.strip:
            self.scan(body)
            return body
        self.kept += body
        out = bytearray()
        while (end := _event_end(self.kept)) is not None:
            event = bytes(self.kept[:end])
            del self.kept[:end]
            if not self.usage_chunk(event):
                out += event
        if not more or len(self.kept) > MAX_KEPT:  # the end, or no event boundary in sight
            out += self.kept
            self.kept.clear()
        return bytes(out)

    def scan(self, body: bytes) -> None:
        """Read the usage of the whole lines in `body` (and the line the last one began)."""
        data = bytes(self.kept) + body if self.kept else body
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            line = data[start:end]
            start = end + 1
            if b'"usage"' in line and line.startswith(b"data:"):
                self.saw_line(line)
        rest = data[start:]
        self.kept = bytearray(rest if len(rest) <= MAX_KEPT else b"")

    def usage_chunk(self, event: bytes) -> bool:
        """Whether `event` is the chunk of usage alone the door asked for (read, then dropped)."""
        found = False
        for line in event.splitlines():
            if b'"usage"' in line and line.startswith(b"data:"):
                parsed = self.saw_line(line)
                found = found or (isinstance(parsed, dict) and parsed.get("choices") == [])
        return found

    def saw_line(self, line: bytes) -> Any:
        try:
            parsed = json.loads(line[5:])
        except ValueError:
            return None
        self.saw(parsed)
        return parsed

    def saw(self, parsed: Any) -> None:
        found = usage_in(parsed)
        if found is not None:
            self.tokens_in = max(self.tokens_in, found[0])
            self.tokens_out = max(self.tokens_out, found[1])


def _event_end(data: bytearray) -> int | None:
    """Where the first whole event of a stream ends (after its blank line), or None."""
    ends = [i + n for sep, n in ((b"\n\n", 2), (b"\r\n\r\n", 4)) if (i := data.find(sep)) >= 0]
    return min(ends) if ends else None
