"""Run through scripts/bench-client-headroom.

A stream source on CPU 1 answers /v1/completions with as many SSE token events as asked, as fast
as it can: one event per token, 1 or 8 events per write (a busy server's socket carries several).
The client of `b70ctl bench` (appliance.measure.bench) runs on CPU 0 and counts what it receives.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


async def serve(port: int, per_write: int) -> None:
    running = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal running
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *header_lines = head.decode().split("\r\n")
                headers = {
                    h.split(":", 1)[0].lower(): h.split(":", 1)[1].strip()
                    for h in header_lines
                    if ":" in h
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if request_line.startswith("GET /metrics"):
                    text = f"llamacpp:requests_processing {running}\n".encode()
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(text), text)
                    )
                    await writer.drain()
                    continue
                n = json.loads(body)["max_tokens"]
                running += 1
                writer.write(STREAM_HEAD)
                event = b'data: {"choices":[{"index":0,"text":"tok"}]}\n\n'
                for start in range(0, n, per_write):
                    payload = event * min(per_write, n - start)
                    writer.write(b"%x\r\n%s\r\n" % (len(payload), payload))
                    await writer.drain()
                usage = json.dumps(
                    {"choices": [], "usage": {"completion_tokens": n, "prompt_tokens": 1}}
                )
                tail = f"data: {usage}\n\ndata: [DONE]\n\n".encode()
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail))
                await writer.drain()
                running -= 1
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=256)
    async with server:
        await server.serve_forever()


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        os.sched_setaffinity(0, {1 % os.cpu_count()})  # type: ignore[operator]
        asyncio.run(serve(int(sys.argv[2]), int(sys.argv[3])))
        return
    from appliance.measure import bench

    os.sched_setaffinity(0, {0})
    for per_write in (1, 8):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        source = subprocess.Popen(
            [sys.executable, "-m", "b70tools.bench_headroom", "--serve", str(port), str(per_write)]
        )
        try:
            time.sleep(1.0)
            url = f"http://127.0.0.1:{port}"
            w = bench.Workload(
                url=url,
                model="fast",
                api_key="none",
                requests=256,
                concurrency=64,
                output_tokens=1024,
            )
            cpu0 = time.process_time()
            results, _samples, wall = asyncio.run(bench.run(w, ["x"] * w.requests, None))
            cpu = time.process_time() - cpu0
            # Count what arrived, not what the server claims in its usage record.
            received = sum(len(r.itls_s) + 1 for r in results if r.ok)
            failed = sum(1 for r in results if not r.ok)
            print(
                f"{per_write} event(s) per write, "
                f"{w.requests} requests x {w.output_tokens} tokens, "
                f"{w.concurrency} in flight: {received / wall:8.0f} tokens/s received on one core "
                f"({received / cpu:8.0f} per CPU-second of the client), {failed} failed",
                flush=True,
            )
        finally:
            source.kill()
            source.wait()


if __name__ == "__main__":
    main()
