"""The usher: one proxy worker keeps the fair turns of every runtime port for all the workers, in
memory, and the others ask it over a Unix socket.

Which worker: the one that holds held/turns.lock (an flock, taken without waiting). It listens on
an abstract Unix socket named after the state directory, and takes only connections of its own
user (SO_PEERCRED). Every other worker connects there and sends, one JSON line each:
- `enter`: a request of its waits for a place (its key, priority and cost, the runtime's slots);
- `cancel`: it will not run after all (its client left, or its hold ran out);
- `leave`: it ran and ended;
- `running`: it runs (said again to a new usher, with every request still waiting).
The usher answers `granted` for each request it admits, when it admits it. Each operation costs
the same however many wait: a deque per key, and a choice among the keys' oldest requests
(appliance.proxy.share.turns).

A worker that dies closes its connection: the usher drops its requests, waiting and running,
and gives their places to the next. The usher that dies lets its lock go: the first worker to
take it is the usher from then on, and every worker tells it again what of its own runs and
waits. For SETTLE_S after it begins, the new usher admits no one, so that the requests that
still run are counted first. The usher's own requests take the same way in its process, with
no socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.hold import HELD_DIR, start_time
from appliance.proxy.asgi import log
from appliance.proxy.share.turns import Entry, Turns, fill

LOCK_FILE = "turns.lock"
SETTLE_S = 0.3  # a new usher's wait for the running requests to be told again
RETRY_S = 0.05  # between tries to reach the usher, or to become it
MOST_LINE = 4096  # bytes of one message, at most


def socket_name(state_dir: Path) -> str:
    """The usher's abstract socket: a name of the state directory, not a file (no path limit,
    nothing left behind)."""
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:24]
    return f"\0b70-turns-{digest}"


@dataclass
class Port:
    """One runtime port's turns, as the usher keeps them."""

    turns: Turns = field(default_factory=Turns)
    slots: int = 1
    batch_wait_s: float = 30.0
    keep_free: int = 0
    owner: dict[str, Any] = field(default_factory=dict)  # request id -> the worker it waits in


class Keeper:
    """The usher's state: every port's turns, and which worker each request is in."""

    def __init__(self, send: Callable[[Any, int, str], None]) -> None:
        self.ports: dict[int, Port] = {}
        self.send = send  # (owner, port, id): tell the owner its request is admitted
        self.hold_until = time.monotonic() + SETTLE_S

    def enter(
        self, owner: Any, port: int, entry: Entry, slots: int, wait_s: float, keep: int
    ) -> None:
        p = self.ports.setdefault(port, Port())
        p.slots, p.batch_wait_s, p.keep_free = slots, wait_s, keep
        p.turns.add(entry)
        p.turns.seen[entry.key] = entry.since
        p.owner[entry.id] = owner
        self.fill(port)

    def running(self, owner: Any, port: int, entry_id: str, key: str) -> None:
        p = self.ports.setdefault(port, Port())
        p.turns.start(entry_id, key)
        p.owner[entry_id] = owner

    def end(self, port: int, entry_id: str) -> None:
        """A request that ran ended, or one that waited will not run (cancel): its place, or its
        place in line, to the next."""
        p = self.ports.get(port)
        if p is None:
            return
        p.owner.pop(entry_id, None)
        if p.turns.end(entry_id) or p.turns.leave_queue(entry_id):
            self.fill(port)

    def gone(self, owner: Any) -> None:
        """A worker that died: its requests out, running and waiting."""
        for port, p in self.ports.items():
            mine = [i for i, o in p.owner.items() if o is owner]
            for entry_id in mine:
                del p.owner[entry_id]
                if not p.turns.end(entry_id):
                    p.turns.leave_queue(entry_id)
            if mine:
                self.fill(port)

    def fill(self, port: int) -> None:
        if time.monotonic() < self.hold_until:
            return
        p = self.ports[port]
        keep = min(p.keep_free, p.slots - 1)  # one place at least for anyone
        for entry in fill(p.turns, p.slots, time.time(), p.batch_wait_s, keep):
            owner = p.owner.get(entry.id)
            if owner is not None:
                self.send(owner, port, entry.id)

    def fill_all(self) -> None:
        for port in list(self.ports):
            self.fill(port)


class Usher:
    """This worker's way to the turns: the usher itself, or a connection to it. Requests of this
    worker, waiting (their futures) and running, are kept here to be told again to a new usher."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.name = socket_name(state_dir)
        pid = os.getpid()
        self.me = f"{pid}:{start_time(pid)}"
        self.numbers = itertools.count()
        self.waiting: dict[str, tuple[int, Entry, int, float, int, asyncio.Future[None]]] = {}
        self.running: dict[str, tuple[int, str]] = {}
        self.keeper: Keeper | None = None  # while this worker is the usher
        self.writer: asyncio.StreamWriter | None = None  # while it talks to the usher
        self.task: asyncio.Task[None] | None = None
        self.lock_fd: int | None = None
        self.said: str | None = None

    def new_id(self) -> str:
        return f"{self.me}:{next(self.numbers)}"

    # --- what a request does ---------------------------------------------------------------

    def enter(
        self, port: int, entry: Entry, slots: int, wait_s: float, keep: int
    ) -> asyncio.Future[None]:
        """The request in line; its future is done when it may run."""
        self._started()
        future = asyncio.get_running_loop().create_future()
        self.waiting[entry.id] = (port, entry, slots, wait_s, keep, future)
        self._tell_enter(entry.id)
        return future

    def cancel(self, port: int, entry_id: str) -> None:
        """A request that waited and will not run (or was admitted and will not run)."""
        self.waiting.pop(entry_id, None)
        self.running.pop(entry_id, None)
        self._tell({"op": "cancel", "port": port, "id": entry_id}, lambda k: k.end(port, entry_id))

    def leave(self, port: int, entry_id: str) -> None:
        if self.running.pop(entry_id, None) is not None:
            self._tell(
                {"op": "leave", "port": port, "id": entry_id}, lambda k: k.end(port, entry_id)
            )

    def granted(self, port: int, entry_id: str) -> None:
        """The usher admitted a request of this worker's."""
        got = self.waiting.pop(entry_id, None)
        if got is None or got[5].done():  # it left meanwhile: its place goes back
            self._tell(
                {"op": "leave", "port": port, "id": entry_id}, lambda k: k.end(port, entry_id)
            )
            return
        self.running[entry_id] = (port, got[1].key)
        got[5].set_result(None)

    # --- the usher, or the way to it ---------------------------------------------------------

    def _tell_enter(self, entry_id: str) -> None:
        port, entry, slots, wait_s, keep, _ = self.waiting[entry_id]
        message = {"op": "enter", "port": port, "entry": entry.as_json(), "slots": slots,
                   "wait_s": wait_s, "keep": keep}  # fmt: skip
        self._tell(message, lambda k: k.enter(self, port, entry, slots, wait_s, keep))

    def _tell(self, message: dict[str, Any], here: Callable[[Keeper], None]) -> None:
        """To the usher: in this process when it is this worker, else over its connection; with
        neither (the usher changes), nothing: all is told again to the next."""
        if self.keeper is not None:
            here(self.keeper)
        elif self.writer is not None and not self.writer.is_closing():
            self.writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    def _started(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._run())

    async def ready(self, limit_s: float = 5.0) -> bool:
        """Start, and wait until this worker is the usher or talks to it."""
        self._started()
        deadline = time.monotonic() + limit_s
        while self.keeper is None and self.writer is None and time.monotonic() < deadline:
            await asyncio.sleep(RETRY_S / 5)
        return self.keeper is not None or self.writer is not None

    async def _run(self) -> None:
        while True:
            try:
                if self._take_lock():
                    await self._serve()
                    return
                if not await self._follow():
                    await asyncio.sleep(RETRY_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug: said once, and tried again
                problem = f"b70: the fair turns' usher failed ({type(e).__name__}: {e})"
                if problem != self.said:
                    self.said = problem
                    log(problem + "; it tries again")
                await asyncio.sleep(RETRY_S)

    def _take_lock(self) -> bool:
        path = self.state_dir / HELD_DIR / LOCK_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.lock_fd = fd  # held as long as this worker lives
        return True

    async def _serve(self) -> None:
        """This worker is the usher: its own requests in, then every other worker's."""
        keeper = Keeper(self._grant)
        self.keeper, self.writer = keeper, None
        for entry_id, (port, key) in self.running.items():
            keeper.running(self, port, entry_id, key)
        for entry_id in list(self.waiting):
            self._tell_enter(entry_id)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.name)
        sock.listen(128)
        server = await asyncio.start_unix_server(self._serve_one, sock=sock, limit=MOST_LINE)
        await asyncio.sleep(SETTLE_S)
        keeper.fill_all()
        async with server:
            await server.serve_forever()

    def _grant(self, owner: Any, port: int, entry_id: str) -> None:
        if owner is self:
            self.granted(port, entry_id)
        else:
            with contextlib.suppress(Exception):  # a worker that is gone: its connection ends
                owner.write(
                    b'{"op":"granted","port":%d,"id":%s}\n' % (port, json.dumps(entry_id).encode())
                )

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One other worker's connection, until it ends."""
        keeper = self.keeper
        assert keeper is not None
        sock = writer.get_extra_info("socket")
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        if struct.unpack("3i", creds)[1] != os.getuid():  # another user's: not a worker
            writer.close()
            return
        try:
            while line := await reader.readline():
                self._apply(keeper, writer, json.loads(line))
        except (ValueError, KeyError, TypeError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            keeper.gone(writer)
            writer.close()

    @staticmethod
    def _apply(keeper: Keeper, owner: asyncio.StreamWriter, m: dict[str, Any]) -> None:
        port, op = int(m["port"]), m["op"]
        if op == "enter":
            entry = Entry.of_json(m["entry"])
            keeper.enter(owner, port, entry, int(m["slots"]), float(m["wait_s"]), int(m["keep"]))
        elif op == "running":
            keeper.running(owner, port, str(m["id"]), str(m["key"]))
        elif op in ("leave", "cancel"):
            keeper.end(port, str(m["id"]))

    async def _follow(self) -> bool:
        """Another worker is the usher: what of this worker's runs and waits, told to it, and its
        answers taken until it ends. False when it could not be reached."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, self.name)
        except OSError:
            sock.close()
            return False
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MOST_LINE)
        self.writer = writer
        try:
            for entry_id, (port, key) in self.running.items():
                self._tell(
                    {"op": "running", "port": port, "id": entry_id, "key": key}, lambda k: None
                )
            for entry_id in list(self.waiting):
                self._tell_enter(entry_id)
            while line := await reader.readline():
                m = json.loads(line)
                if m.get("op") == "granted":
                    self.granted(int(m["port"]), str(m["id"]))
        except (ValueError, KeyError, TypeError, ConnectionError):
            pass
        finally:
            self.writer = None
            writer.close()
        return True
