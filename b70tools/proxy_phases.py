"""The proxy as rendered, with a time noted at each step of a request's way through a worker
(for scripts/bench-proxy --parts phases; never in a unit).

Run: python -m b70tools.proxy_phases DIR LITELLM_ARGV...

It wraps a few functions of uvicorn's HTTP protocol and of the appliance's door, then runs
LiteLLM's command line with the rest of its arguments. gunicorn's master loads the app and
forks the workers, so every worker carries the wrappers. For each request to the model whose
last message is `bench N`, a worker appends one JSON line to DIR/PID.jsonl once the answer has
ended: N and the time.monotonic() of each step, a clock every process on the machine shares,
so the client's and the stand-in runtime's notes line up with these. Each garbage collection
that holds the worker's loop for more than a millisecond is a line too (`gc`: its generation,
start and length).
"""

from __future__ import annotations

import contextvars
import functools
import gc
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from b70tools.stream_source import bench_id

# In the order a request takes them.
STEPS = {
    "accepted": "the worker's loop took the connection from the listening socket",
    "parsed": "the request's head was parsed and its task made",
    "door": "the door was called (the request's task ran)",
    "checked": "route, key, body and request checks done",
    "let_through": "the switch's hold let it go on",
    "connected": "connected to the runtime (on loopback the request is written right after)",
    "first_out": "the answer's first bytes were handed to the client's connection",
}
GC_NOTED_S = 0.001
STAMPS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "b70_bench_stamps", default=None
)


def note(step: str) -> None:
    """The time of `step` for the request this task answers, the first time it is reached."""
    stamps = STAMPS.get()
    if stamps is not None and step not in stamps:
        stamps[step] = time.monotonic()


def noting_after(step: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """An async function that notes `step` once `function` has returned."""

    @functools.wraps(function)
    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = await function(*args, **kwargs)
        note(step)
        return result

    return wrapped


def wrap_uvicorn() -> None:
    """The connection's accept and the request's parse, carried to the door in the ASGI scope."""
    from uvicorn.protocols.http import httptools_impl

    protocol = httptools_impl.HttpToolsProtocol
    made, parsed = protocol.connection_made, protocol.on_headers_complete

    def connection_made(self: Any, transport: Any) -> None:
        self.b70_accepted = time.monotonic()
        made(self, transport)

    def on_headers_complete(self: Any) -> None:
        parsed(self)
        self.scope["b70.bench"] = {"accepted": self.b70_accepted, "parsed": time.monotonic()}

    protocol.connection_made = connection_made  # type: ignore[method-assign]
    protocol.on_headers_complete = on_headers_complete  # type: ignore[method-assign]


def wrap_door(folder: Path) -> None:
    """The door's steps, noted in the request's own context; one line per request at its end."""
    from appliance.proxy import chain, direct, door

    call, init, check = door.Door.__call__, door.Door.__init__, chain.Gate.check_api

    async def door_call(self: Any, scope: Any, receive: Any, send: Any) -> None:
        stamps: dict[str, Any] = {**scope.get("b70.bench", {}), "door": time.monotonic()}
        token = STAMPS.set(stamps)

        async def sending(message: Any) -> None:
            if message.get("type") == "http.response.body" and message.get("body"):
                note("first_out")
            await send(message)

        try:
            await call(self, scope, receive, sending)
        finally:
            STAMPS.reset(token)
        n = _bench_n(stamps.pop("body", None))
        if n is not None:
            _write(folder, {"n": n, **stamps})

    async def checking(self: Any, request: Any) -> Any:
        refusal = await check(self, request)  # the last of the request's own checks
        note("checked")
        stamps = STAMPS.get()
        if stamps is not None and request.checked is not None:
            stamps["body"] = request.checked.body
        return refusal

    def door_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if self.hold is not None:
            self.hold = noting_after("let_through", self.hold)

    door.Door.__call__ = door_call  # type: ignore[method-assign]
    door.Door.__init__ = door_init  # type: ignore[method-assign]
    chain.CHAIN = tuple(checking if c is check else c for c in chain.CHAIN)
    connect = direct._connect_at_once

    def connect_at_once(host: str, port: int) -> Any:
        sock = connect(host, port)
        note("connected")
        return sock

    direct._connect_at_once = connect_at_once


def note_collections(folder: Path) -> None:
    started: list[float] = []

    def collected(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[:] = [time.monotonic()]
        elif started and time.monotonic() - started[0] > GC_NOTED_S:
            took = time.monotonic() - started[0]
            _write(folder, {"gc": info["generation"], "start": started[0], "took_s": took})

    gc.callbacks.append(collected)


def _write(folder: Path, record: dict[str, Any]) -> None:
    with open(folder / f"{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def _bench_n(body: bytes | None) -> int | None:
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return None
    return bench_id(data) if isinstance(data, dict) else None


def read(folder: Path) -> tuple[dict[str, dict[str, float]], list[dict[str, float]]]:
    """Every worker's notes: the requests', by number (a str, like the stand-in's /stamps),
    each with its worker's pid; and the collections."""
    requests: dict[str, dict[str, float]] = {}
    collections: list[dict[str, float]] = []
    for path in folder.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "gc" in record:
                collections.append(record)
            else:
                requests[str(record.pop("n"))] = {**record, "worker": float(path.stem)}
    return requests, collections


def split(
    runs: list[dict[str, Any]], runtime: dict[str, dict[str, float]], folder: Path
) -> dict[str, float]:
    """Medians, in ms, of each step's time after the one before, from the client's `sent` (the
    runs of stream_client.arrivals) through the worker's steps and the runtime's notes (the
    stand-in's /stamps: arrived, first_write) to the client's first token; the requests each
    worker took; and the collections that held a worker's loop during the runs."""
    requests, collections = read(folder)
    order = ["sent", *list(STEPS)[:-1], "arrived", "first_write", "first_out", "first"]
    rows = []
    for run in runs:
        notes, stamps = requests.get(str(run["n"])), runtime.get(str(run["n"]))
        if notes and stamps and run["first"] is not None:
            rows.append({**run, **notes, **stamps})
    out: dict[str, float] = {"requests": float(len(rows))}
    for before, step in itertools.pairwise(order):
        taken = [1000 * (r[step] - r[before]) for r in rows if step in r and before in r]
        if taken:
            out[f"{before}->{step}_ms"] = statistics.median(taken)
    workers = sorted({r["worker"] for r in rows})
    out["most_to_one_worker"] = float(max((sum(r["worker"] == w for r in rows) for w in workers),
                                          default=0))  # fmt: skip
    out["collections"] = float(len(collections))
    out["longest_collection_ms"] = 1000 * max((c["took_s"] for c in collections), default=0.0)
    return out


def forget(folder: Path) -> None:
    for path in folder.glob("*.jsonl"):
        path.unlink()


def main() -> int:
    folder, argv = Path(sys.argv[1]), sys.argv[2:]
    folder.mkdir(parents=True, exist_ok=True)
    wrap_uvicorn()
    wrap_door(folder)
    note_collections(folder)
    from litellm.proxy.proxy_cli import run_server

    sys.argv = argv
    run_server()
    return 0


if __name__ == "__main__":
    sys.exit(main())
