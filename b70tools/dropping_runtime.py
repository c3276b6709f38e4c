"""A stand-in for a runtime that dies on every request: it says it is healthy, names its model,
and closes the connection of each POST without a word, as a runtime that crashes on a request
does. GET /count says how many POSTs reached it, so a test can count how often the proxy sent
one request.

Run: python -m b70tools.dropping_runtime PORT
"""

from __future__ import annotations

import argparse
import asyncio
import json

MODELS = {"object": "list", "data": [{"id": "smollm2", "object": "model", "owned_by": "b70"}]}


class Dropping:
    def __init__(self) -> None:
        self.posts = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ", 2)[:2]
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                if length:
                    await reader.readexactly(length)
                if method == b"POST":
                    self.posts += 1
                    return  # closed without an answer
                writer.write(self.answer(path.decode()))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            return
        finally:
            writer.close()

    def answer(self, path: str) -> bytes:
        if path == "/count":
            body = json.dumps({"posts": self.posts}).encode()
        elif path.startswith("/v1/models"):
            body = json.dumps(MODELS).encode()
        elif path == "/metrics":
            body = b"llamacpp:requests_processing 0\n"
        else:
            body = b'{"status":"ok"}'
        kind = b"text/plain" if path == "/metrics" else b"application/json"
        return b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (
            kind,
            len(body),
            body,
        )


async def main_async(port: int) -> None:
    server = await asyncio.start_server(Dropping().serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("port", type=int)
    asyncio.run(main_async(parser.parse_args().port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
