"""A lean streaming client for the proxy benchmarks: raw asyncio HTTP/1.1 (chunked framing,
counting `data:` events), so that it costs little next to what it measures.

Two ways to load a server:
- `steady`: N connections that each send one streamed request after another for a while
  (keep-alive), as a steady load;
- `arrivals`: one request per connection, each starting at a given moment, with its times noted
  (sent, first token, done): all at once is the burst `vllm bench serve` sends, spread out is the
  stagger.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import statistics
import time
from dataclasses import dataclass
from typing import Any


def request_bytes(key: str, model: str, tokens: int, text: str) -> bytes:
    body = json.dumps(
        {
            "model": model,
            "stream": True,
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0,
            "messages": [{"role": "user", "content": text}],
        }
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nAuthorization: Bearer %s\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (key.encode(), len(body), body)
    )


@dataclass
class Answer:
    ok: bool
    events: int  # content events, less the last and [DONE]
    first: float | None  # when the first event arrived (time.monotonic)
    keep: bool = True  # the server keeps the connection open for the next request
    answered: bool = True  # False: the server closed the connection before any answer


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    status = await reader.readline()
    if not status:  # closed before an answer: the request was not taken
        return Answer(False, 0, None, keep=False, answered=False)
    chunked, length, keep = False, 0, True
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        if name.lower() == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
        elif name.lower() == "content-length":
            length = int(value)
        elif name.lower() == "connection" and "close" in value.lower():
            keep = False  # llama-server closes after each streamed answer
    events, done, first = 0, False, None
    if chunked:
        while size_line := (await reader.readline()).split(b";")[0].strip():
            if not (size := int(size_line, 16)):
                break
            data = await reader.readexactly(size + 2)
            if first is None and b"data: " in data:
                first = time.monotonic()
            events += data.count(b"data: ")
            done = done or b"data: [DONE]" in data
        else:  # the connection ended before the last chunk: whole only if [DONE] came
            whole = done and b" 200 " in status
            return Answer(whole, max(events - 2, 0) if whole else 0, first, keep=False)
        await reader.readline()
    else:
        await reader.readexactly(length)
    ok = b" 200 " in status and done
    return Answer(ok, max(events - 2, 0) if ok else 0, first, keep)


# --- steady --------------------------------------------------------------------------------------


async def _steady_worker(
    port: int, request: bytes, deadline: float, totals: dict[str, float]
) -> None:
    """Requests one after another, on one connection while the server keeps it open."""
    while time.monotonic() < deadline:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            answer = Answer(True, 0, None)
            while answer.keep and time.monotonic() < deadline:
                writer.write(request)
                answer = await read_answer(reader)
                totals["chunks"] += answer.events
                if answer.answered:  # not a connection the server had closed meanwhile
                    totals["ok" if answer.ok else "failed"] += 1
        finally:
            writer.close()


async def steady_run(
    port: int, key: str, model: str, streams: int, tokens: int, seconds: float
) -> dict[str, float]:
    totals = {"chunks": 0.0, "ok": 0.0, "failed": 0.0}
    request = request_bytes(key, model, tokens, "Tell me a long story.")
    start = time.monotonic()
    await asyncio.gather(
        *(_steady_worker(port, request, start + seconds, totals) for _ in range(streams))
    )
    totals["wall_s"] = time.monotonic() - start
    return totals


def steady(
    port: int, key: str, model: str, streams: int, tokens: int, seconds: float
) -> dict[str, float]:
    """Chunks, requests ok and failed, and the wall time of a steady load."""
    return asyncio.run(steady_run(port, key, model, streams, tokens, seconds))


# --- arrivals ------------------------------------------------------------------------------------


async def _one(
    port: int, key: str, model: str, tokens: int, n: int, at: float,
    tls: ssl.SSLContext | None = None,
) -> dict[str, Any]:  # fmt: skip
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    sent = time.monotonic()
    host = "localhost" if tls is not None else None  # a TLS connection: its handshake counts
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls, server_hostname=host)
    try:
        writer.write(request_bytes(key, model, tokens, f"bench {n}"))
        answer = await read_answer(reader)
    finally:
        writer.close()
    return {"n": n, "sent": sent, "first": answer.first, "done": time.monotonic(),
            "tokens": answer.events, "ok": answer.ok}  # fmt: skip


async def _arrivals(
    port: int, key: str, model: str, tokens: int, starts: list[float], first_n: int,
    tls: ssl.SSLContext | None,
) -> list[dict[str, Any]]:  # fmt: skip
    t0 = time.monotonic() + 0.1
    return await asyncio.gather(
        *(_one(port, key, model, tokens, first_n + i, t0 + s, tls) for i, s in enumerate(starts))
    )


def arrivals(
    port: int, key: str, model: str, tokens: int, starts: list[float], first_n: int = 0,
    tls: ssl.SSLContext | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """One request per start (seconds from now), numbered from `first_n`: each one's times,
    each on a connection of its own (over TLS with `tls`, which trusts the proxy's
    certificate)."""
    return asyncio.run(_arrivals(port, key, model, tokens, starts, first_n, tls))


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    """tokens/s over the whole run (first sent to last done), and times to first token."""
    ok = [r for r in runs if r["ok"]]
    wall = max(r["done"] for r in runs) - min(r["sent"] for r in runs)
    ttft = sorted(r["first"] - r["sent"] for r in ok if r["first"] is not None)
    return {
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_median_ms": 1000 * statistics.median(ttft) if ttft else float("nan"),
        "ttft_max_ms": 1000 * ttft[-1] if ttft else float("nan"),
        "request_median_s": statistics.median(r["done"] - r["sent"] for r in ok) if ok else 0.0,
        "failed": float(len(runs) - len(ok)),
    }


def phases(runs: list[dict[str, Any]], stamps: dict[str, dict[str, float]]) -> dict[str, float]:
    """Medians, in ms, of a request's way to the runtime (sent to arrived whole) and of the
    first event's way back (written by the runtime to read by the client)."""
    to, back = [], []
    for r in runs:
        s = stamps.get(str(r["n"]))
        if s and r["first"] is not None:
            to.append(s["arrived"] - r["sent"])
            back.append(r["first"] - s["first_write"])
    if not to:
        return {}
    return {
        "to_runtime_median_ms": 1000 * statistics.median(to),
        "to_runtime_max_ms": 1000 * max(to),
        "back_median_ms": 1000 * statistics.median(back),
        "back_max_ms": 1000 * max(back),
    }
