"""The door's fair turns, in one proxy worker: a request takes its place in line
(`Fair.enter_now`, then `Waiting.turn`) before it is sent to the runtime and gives its turn back
when its answer ends (`Fair.leave`), through the usher that keeps every worker's turns
(appliance.proxy.share.usher; the choice itself is appliance.proxy.share.turns).

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
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path

from appliance.people import Person
from appliance.proxy.asgi import log
from appliance.proxy.backend import Backend
from appliance.proxy.share.turns import Entry
from appliance.proxy.share.usher import Usher
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

    def __init__(self, usher: Usher, port: int, entry_id: str, key: str) -> None:
        self.usher, self.port, self.id, self.key = usher, port, entry_id, key


class Waiting:
    """A request in line for its turn, and the future its turn sets (maybe already)."""

    def __init__(self, usher: Usher, port: int, entry: Entry, slots: int) -> None:
        self.usher, self.port, self.entry, self.slots = usher, port, entry, slots
        self.waiter: asyncio.Future[None] | None = None

    async def turn(self, limit_s: float | None) -> Turn:
        """Wait for the turn (HoldTimeout after `limit_s`; None: no limit). A request cancelled
        while it waits (its client left) leaves its place, or the place it was just given."""
        assert self.waiter is not None
        started = time.monotonic()
        try:
            await asyncio.wait_for(
                asyncio.shield(self.waiter), None if limit_s is None else max(0.0, limit_s)
            )
        except BaseException as e:
            self.usher.cancel(self.port, self.entry.id)
            if isinstance(e, TimeoutError):
                raise HoldTimeout(
                    f"the runtime runs {self.slots} requests at once and this one waited its "
                    "turn", time.monotonic() - started, retry_after_s=5,
                ) from None  # fmt: skip
            raise
        return Turn(self.usher, self.port, self.entry.id, self.entry.key)


class Fair:
    """The turns of every runtime port, in this worker, through the usher."""

    def __init__(
        self,
        state_dir: Path,
        slots: Mapping[tuple[int, str], int],
        batch_wait_s: float = DEFAULT_BATCH_WAIT_S,
        keep_free: int = 0,
    ) -> None:
        self.state_dir = state_dir
        self.keep_free = keep_free
        self.configured = dict(slots)
        self.batch_wait_s = batch_wait_s
        self.usher = Usher(state_dir)
        self.said: str | None = None

    def enter_now(self, person: Person, backend: Backend | None, cost: int) -> Waiting | None:
        """The request's place in line (Waiting, to await; its turn may be there already); None
        when it takes no turn: the runtime has not said what it is, or the usher's lock cannot
        be kept (the journal says so, once). Does not leave the request's task."""
        facts = backend.known if backend is not None else None  # as the door's checks left it
        if backend is None or facts is None:
            return None
        port = urllib.parse.urlsplit(backend.url).port or 0
        slots = facts.slots or self.configured.get((port, facts.engine))
        if slots is None:
            return None
        entry = Entry(self.usher.new_id(), person.name, person.priority, cost, time.time())
        waiting = Waiting(self.usher, port, entry, slots)
        try:
            keep = min(self.keep_free, slots - 1)
            waiting.waiter = self.usher.enter(port, entry, slots, self.batch_wait_s, keep)
        except OSError as e:
            problem = f"b70: cannot keep fair turns in {self.state_dir}: {e.strerror or e}"
            if problem != self.said:
                self.said = problem
                log(problem + "; requests go to the runtime as they come")
            return None
        return waiting

    @staticmethod
    def leave(turn: Turn | None) -> None:
        if turn is not None:
            turn.usher.leave(turn.port, turn.id)
