"""The door's fair turns, in one proxy worker: a request takes its turn (`Fair.enter`) before it
is sent to the runtime and gives it back when its answer ends (`Fair.leave`), through the record
the workers share (appliance.proxy.share.turns).

How the door knows how many requests the runtime runs at once:
- llama.cpp says it: `total_slots` in its /props, asked with its context (`--parallel`, or the
  slots it chose itself when `--parallel` is auto);
- vLLM does not say it over HTTP: the renderer reads `--max-num-seqs` from the runtime's
  arguments, or takes vLLM's default (256 on a card under 70 GiB, vLLM 0.32's
  `EngineArgs.get_batch_defaults`), and hands it to the proxy as B70_SLOTS ("PORT/ENGINE=N ...").
Until the runtime has said what it is (down, loading), requests take no turn: the hold keeps
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path

from appliance.hold import start_time
from appliance.people import Person
from appliance.proxy import log
from appliance.proxy.backend import Backend
from appliance.proxy.share.turns import (
    FULL_LOOK_S,
    POLL_S,
    RECORD_ERRORS,
    Entry,
    Record,
    Turns,
    fill,
)
from appliance.proxy.waiting import HoldTimeout

DEFAULT_BATCH_WAIT_S = 30.0


def parse_slots(text: str) -> dict[tuple[int, str], int]:
    """B70_SLOTS: "8001/vLLM=256 8002/llama.cpp=4" -> {(8001, "vLLM"): 256, ...}."""
    out: dict[tuple[int, str], int] = {}
    for word in text.split():
        where, _, n = word.partition("=")
        port, _, engine = where.partition("/")
        if port.isdigit() and engine and n.isdigit() and int(n) > 0:
            out[(int(port), engine)] = int(n)
    return out


class Turn:
    """A request's place among those running: given back once (`Fair.leave`)."""

    def __init__(self, share: Share, key: str) -> None:
        self.share, self.key = share, key


class Share:
    """The turns of one runtime port, as this worker takes them."""

    def __init__(
        self, state_dir: Path, port: int | None, batch_wait_s: float, keep_free: int = 0,
        batch_share: float = 1.0,
    ) -> None:  # fmt: skip
        self.record = Record(state_dir, port)
        self.batch_wait_s = batch_wait_s
        self.keep_free, self.batch_share = keep_free, batch_share
        self.waiters: dict[str, asyncio.Future[None]] = {}
        self.entries: dict[str, Entry] = {}
        self.slots = 1
        self.poller: asyncio.Task[None] | None = None
        pid = os.getpid()
        self.me = f"{pid}:{start_time(pid)}"
        self.numbers = itertools.count()

    def enter_now(self, key: str, priority: str, cost: int, slots: int) -> Turn | Waiting:
        """The request's turn if it runs now (fewer than `slots` run), else its place in line
        (then `wait`); without leaving the request's task."""
        self.slots = slots
        entry = Entry(f"{self.me}:{next(self.numbers)}", key, priority, cost, time.time())
        with self.record.open() as turns:
            turns.add(entry)
            turns.seen[key] = entry.since
            self._fill(turns)
            now = self._take_mine(turns)
        if entry.id in now:
            now.discard(entry.id)
            self._wake(now)
            return Turn(self, key)
        self._wake(now)
        waiter = asyncio.get_running_loop().create_future()
        self.waiters[entry.id] = waiter
        self.entries[entry.id] = entry
        if self.poller is None or self.poller.done():
            self.poller = asyncio.ensure_future(self._poll())
        return Waiting(self, entry, waiter)

    async def wait(self, waiting: Waiting, limit_s: float | None) -> Turn:
        """Wait for the turn of a request in line (HoldTimeout after `limit_s`; None: no limit).
        Its turn may have come before this wait began (another request ended meanwhile): the
        future is the request's own, not looked up. A request cancelled while it waits (its
        client left) leaves its place."""
        entry, waiter = waiting.entry, waiting.waiter
        started = time.monotonic()
        try:
            await asyncio.wait_for(
                asyncio.shield(waiter), None if limit_s is None else max(0.0, limit_s)
            )
        except BaseException as e:
            self.waiters.pop(entry.id, None)
            self.entries.pop(entry.id, None)
            with contextlib.suppress(*RECORD_ERRORS):  # a record that cannot be kept: no place
                self._give_up(entry, admitted=waiter.done() and not waiter.cancelled())
            if isinstance(e, TimeoutError):
                raise HoldTimeout(
                    f"the runtime runs {self.slots} requests at once and this one waited its "
                    "turn", time.monotonic() - started, retry_after_s=5,
                ) from None  # fmt: skip
            raise
        return Turn(self, entry.key)

    async def enter(
        self, key: str, priority: str, cost: int, slots: int, limit_s: float | None
    ) -> Turn:
        """`enter_now`, then `wait` if it must."""
        got = self.enter_now(key, priority, cost, slots)
        return got if isinstance(got, Turn) else await got.turn(limit_s)

    def leave(self, turn: Turn) -> None:
        with self.record.open() as turns:
            turns.end(self.me, turn.key)
            self._fill(turns)
            mine = self._take_mine(turns)
        self._wake(mine)

    def _fill(self, turns: Turns) -> None:
        keep = min(self.keep_free, self.slots - 1)  # one place at least for anyone
        fill(turns, self.slots, time.time(), self.batch_wait_s, keep, self.batch_share)

    def _take_mine(self, turns: Turns) -> set[str]:
        """This worker's requests that were admitted, taken off the record's granted list."""
        return turns.take_granted(self.me)

    def _give_up(self, entry: Entry, admitted: bool) -> None:
        """A waiting request that will not run: out of the queue, or, if it was admitted, its
        place passed on."""
        with self.record.open() as turns:
            if turns.ungrant(entry.id) or admitted:
                turns.end(self.me, entry.key)
            turns.remove(entry.id)
            self._fill(turns)
            mine = self._take_mine(turns)
        self._wake(mine)

    def _wake(self, admitted: set[str]) -> None:
        for entry_id in admitted:
            waiter = self.waiters.pop(entry_id, None)
            self.entries.pop(entry_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def _poll(self) -> None:
        """While requests of this worker wait: whether another worker admitted one, and places
        freed by workers that died or by a change of the runtime's slots."""
        looked = time.monotonic()
        while self.waiters:
            await asyncio.sleep(POLL_S)
            if not self.record.changed() and time.monotonic() - looked < FULL_LOOK_S:
                continue
            looked = time.monotonic()
            try:
                with self.record.open() as turns:
                    if self.record.begun_again:  # its requests lost with the record: back in line
                        self.record.begun_again = False
                        for entry in self.entries.values():
                            turns.add(entry)
                    self._fill(turns)
                    mine = self._take_mine(turns)
            except RECORD_ERRORS as e:  # the record cannot be kept now: those waiting go on
                log(f"b70: cannot keep fair turns in {self.record.path}: {e}; requests that "
                    "waited their turn go to the runtime as they come")  # fmt: skip
                mine = set(self.waiters)
            self._wake(mine)


class Waiting:
    """A request in line for its turn, and the future its turn sets."""

    def __init__(self, share: Share, entry: Entry, waiter: asyncio.Future[None]) -> None:
        self.share, self.entry, self.waiter = share, entry, waiter

    async def turn(self, limit_s: float | None) -> Turn:
        return await self.share.wait(self, limit_s)


class Fair:
    """The turns of every runtime port, in this worker."""

    def __init__(
        self,
        state_dir: Path,
        slots: Mapping[tuple[int, str], int],
        batch_wait_s: float = DEFAULT_BATCH_WAIT_S,
        keep_free: int = 0,
        batch_share: float = 1.0,
    ) -> None:
        self.state_dir = state_dir
        self.keep_free, self.batch_share = keep_free, batch_share
        self.configured = dict(slots)
        self.batch_wait_s = batch_wait_s
        self.shares: dict[int | None, Share] = {}
        self.said: str | None = None

    def enter_now(
        self, person: Person, backend: Backend | None, cost: int
    ) -> Turn | Waiting | None:
        """The request's turn on its runtime (a Turn), or its place in line (Waiting, to await);
        None when it takes no turn: the runtime has not said what it is, or the shared record
        cannot be written (the journal says so, once). Does not leave the request's task."""
        facts = backend.known if backend is not None else None  # as the door's checks left it
        if backend is None or facts is None:
            return None
        port = urllib.parse.urlsplit(backend.url).port
        slots = facts.slots or self.configured.get((port or 0, facts.engine))
        if slots is None:
            return None
        share = self.shares.get(port)
        if share is None:
            share = Share(self.state_dir, port, self.batch_wait_s, self.keep_free, self.batch_share)
            self.shares[port] = share
        try:
            got = share.enter_now(person.name, person.priority, cost, slots)
        except RECORD_ERRORS as e:
            problem = f"b70: cannot keep fair turns in {self.state_dir}: {_why(e)}"
            if problem != self.said:
                self.said = problem
                log(problem + "; requests go to the runtime as they come")
            return None
        return got

    @staticmethod
    def leave(turn: Turn | None) -> None:
        if turn is not None:
            with contextlib.suppress(
                *RECORD_ERRORS
            ):  # the record cannot be written: nothing to free
                turn.share.leave(turn)


def _why(e: Exception) -> str:
    return (e.strerror if isinstance(e, OSError) else None) or str(e)
