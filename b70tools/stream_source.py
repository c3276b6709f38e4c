"""A stand-in for a runtime that streams: OpenAI-shaped SSE answers, as fast as it can or paced
like a real card, over raw asyncio HTTP/1.1 so that it costs little next to what it serves.

It answers GET /v1/models as vLLM does (the served name and its max_model_len), so that the
proxy's door learns the runtime's facts once and keeps them, as it does with a real runtime;
a runtime that cannot say is asked again every second, beside the requests.

It notes, for every request whose last user message is `bench N`, when the request arrived
whole and when its first event was written (time.monotonic, which every process on the machine
shares); GET /stamps hands those notes out, so a benchmark can split a request's time into the
way to the runtime, the runtime, and the way back.

GET /metrics says, in llama-server's words, how many answers it is writing now.

Run: python -m b70tools.stream_source PORT [--pace TOKENS_PER_S_PER_STREAM]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from typing import Any

BENCH_ID = re.compile(r"^bench (\d+)$")
# vLLM's answer to GET /v1/models, as the door reads it (appliance.proxy.backend)
MODELS = {
    "object": "list",
    "data": [{"id": "smollm2", "object": "model", "owned_by": "vllm", "max_model_len": 8192}],
}


def sse_response(path: str, request: dict[str, Any], per_write: int) -> list[bytes]:
    """The HTTP chunks of one streamed answer of max_tokens one-token events."""
    n = int(request.get("max_tokens") or 16)
    model = json.dumps(request.get("model", "m"))
    if "chat" in path:
        head = f'{{"id":"c","object":"chat.completion.chunk","created":1,"model":{model},'
        event = f'data: {head}"choices":[{{"index":0,"delta":{{"content":"x"}}}}]}}\n\n'
        last = f'data: {head}"choices":[{{"index":0,"delta":{{}},"finish_reason":"length"}}]}}\n\n'
    else:
        head = f'{{"id":"c","object":"text_completion","created":1,"model":{model},'
        event = f'data: {head}"choices":[{{"index":0,"text":"x"}}]}}\n\n'
        last = f'data: {head}"choices":[{{"index":0,"text":"","finish_reason":"length"}}]}}\n\n'
    writes = []
    for start in range(0, n, per_write):
        payload = (event * min(per_write, n - start)).encode()
        writes.append(b"%x\r\n%s\r\n" % (len(payload), payload))
    tail = (last + "data: [DONE]\n\n").encode()
    writes.append(b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail))
    return writes


def bench_id(request: dict[str, Any]) -> int | None:
    """The N of a request whose last message (or prompt) is `bench N`."""
    messages = request.get("messages")
    text = messages[-1].get("content") if isinstance(messages, list) and messages else None
    text = text if isinstance(text, str) else request.get("prompt")
    found = BENCH_ID.match(text) if isinstance(text, str) else None
    return int(found[1]) if found else None


class Source:
    def __init__(self, per_write: int, stream_tokens_per_s: float) -> None:
        self.per_write, self.rate = per_write, stream_tokens_per_s
        self.stamps: dict[int, dict[str, float]] = {}
        self.streaming = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                request_line, *lines = head.split("\r\n")
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (line.partition(":") for line in lines)
                    if v
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                arrived = time.monotonic()
                method, path = request_line.split(" ")[:2]
                if method == "GET":
                    self.answer_get(writer, path)
                else:
                    await self.stream(writer, path, json.loads(body or b"{}"), arrived)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def answer_get(self, writer: asyncio.StreamWriter, path: str) -> None:
        if path == "/stamps":
            text = json.dumps(self.stamps).encode()
            self.stamps = {}
        elif path == "/metrics":
            text = b"llamacpp:requests_processing %d\n" % self.streaming
        elif path == "/v1/models":
            text = json.dumps(MODELS).encode()
        else:
            text = b'{"status":"ok"}'
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(text), text)
        )

    async def stream(
        self, writer: asyncio.StreamWriter, path: str, request: dict[str, Any], arrived: float
    ) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        n = bench_id(request)
        self.streaming += 1
        try:
            for i, chunk in enumerate(sse_response(path, request, self.per_write)):
                if i and self.rate:
                    await asyncio.sleep(self.per_write / self.rate)
                writer.write(chunk)
                await writer.drain()
                if i == 0 and n is not None:
                    self.stamps[n] = {"arrived": arrived, "first_write": time.monotonic()}
        finally:
            self.streaming -= 1


async def serve(port: int, per_write: int = 8, stream_tokens_per_s: float = 0) -> None:
    """Answer as fast as possible, or, paced, at `stream_tokens_per_s` per stream."""
    source = Source(per_write, stream_tokens_per_s)
    server = await asyncio.start_server(source.handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--pace", type=float, default=0, help="tokens/s of each stream")
    args = parser.parse_args()
    asyncio.run(serve(args.port, 1 if args.pace else 8, args.pace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
