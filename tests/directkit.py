"""A runtime for the tests of the door's way straight to it (appliance.proxy.direct): a real TCP
server in the test's event loop that answers as each test scripts it, and a client's side."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from appliance.proxy import direct
from appliance.proxy.backend import CHAT

KEY = "sk-b70-right"
BODY = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}).encode()
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Runtime:
    """A TCP server on loopback that reads one request per connection and runs `script`."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[tuple[bytes, bytes]] = []  # head, body
        self.closed = asyncio.Event()  # the proxy closed a connection
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Runtime:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    def target(self) -> direct.Target:
        return direct.Target("127.0.0.1", self.port, "/v1", "smollm2")

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        self.requests.append((head, await reader.readexactly(length)))
        try:
            await self.script(reader, writer)
        finally:
            writer.close()


def answer(status: int, body: bytes, content_type: bytes = b"application/json") -> Script:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\nServer: rt\r\n"
            b"Date: now\r\nConnection: close\r\n\r\n%s" % (status, content_type, len(body), body)
        )
        await writer.drain()

    return script


def stream(events: list[bytes], end: bool = True, status: int = 200) -> Script:
    """A chunked event stream; `end`: it ends as it should, else the runtime dies after it."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 %d OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" % status
        )
        for event in events:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.01)
        if end:
            writer.write(b"0\r\n\r\n")
        await writer.drain()

    return script


class Client:
    """The ASGI side: what the client was sent, and a `receive` that says it left when told."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.leave = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int | None:
        starts = [m for m in self.messages if m["type"] == "http.response.start"]
        return starts[0]["status"] if starts else None

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.messages[0]["headers"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])

    @property
    def finished(self) -> bool:
        return bool(self.messages) and self.messages[-1].get("more_body") is False


def relay(runtime: Runtime, client: Client, kind: str = CHAT, limit_s: float = 10) -> str:
    return asyncio.run(_relay(runtime, client, kind, limit_s))


async def _relay(runtime: Runtime, client: Client, kind: str, limit_s: float) -> str:
    async with runtime:
        return await direct.relay(
            runtime.target(), kind, BODY, client.receive, client.send, limit_s
        )


async def through(door_app: Any, client: Client, path: str, body: bytes) -> None:
    """One POST of `body` to `path` with the key, through an ASGI app (the door), the client's
    side being `client`: its body first, then whatever the client does (it may leave)."""
    scope = {
        "type": "http", "method": "POST", "path": path, "root_path": "", "query_string": b"",
        "headers": [(b"authorization", f"Bearer {KEY}".encode()),
                    (b"content-length", str(len(body)).encode())],
    }  # fmt: skip
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await client.receive()

    await door_app(scope, receive, client.send)
