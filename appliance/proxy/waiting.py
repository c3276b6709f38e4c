"""The hold's turnstiles, in the proxy's workers, one per runtime: whether a request may go on to
the runtime now, and the wait until it may (a switch is marked, or the runtime is not healthy), up
to the hold time.

The mark, the counts and the tickets it reads and writes are appliance.hold's, which the
switch imports too; this module is the proxy's alone (it needs an event loop).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from appliance.hold import (
    TICKET,
    HeldCounts,
    Mark,
    OpenRequests,
    read_demand,
    read_mark,
    read_queues,
    read_refused,
    write_counts,
)
from appliance.keys import same_secret
from appliance.proxy import log

POLL_S = 0.2
HEALTH_TIMEOUT_S = 2.0  # a /health (or a peer's readiness) that takes longer is busy, not down
HEALTH_TTL_S = 0.5  # a healthy answer is trusted this long before /health is asked again
# ... and for this long after, a request goes on while /health is asked again beside it, so no
# request waits for a probe while the runtime serves. A runtime that died in that time fails the
# request's connection, and the door holds it then (appliance.proxy.hook.wait_ready).
HEALTH_STALE_S = 2.0
NOT_HEALTHY = "the backend is not healthy"
BEHIND = "an older request waits for another model ([switching] fcfs: first come, first served)"
ORDER_TTL_S = 0.5  # how long the switch on demand's word on the order is trusted


class HoldTimeout(Exception):
    def __init__(self, why: str, waited_s: float, retry_after_s: int) -> None:
        super().__init__(why)
        self.why = why
        self.waited_s = waited_s
        self.retry_after_s = retry_after_s


Probe = Callable[[], Awaitable[bool]]


def is_switch_token(token: str | None, mark: Mark) -> bool:
    """Whether a request's hold token is the switch's own, in constant time and for any text
    (compared as UTF-8 bytes, a lone surrogate too): another text is only a mismatch."""
    return token is not None and token != "" and same_secret(token, mark.token)


class Turnstile:
    """One runtime's way in: decides whether a request may go on, waits until it may or until
    the hold time is up, and counts the requests it holds."""

    def __init__(
        self,
        state_dir: Path,
        probe: Probe,
        hold_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        port: int | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.port = port  # the runtime port whose requests this turnstile holds and counts
        self.probe = probe
        self.hold_s = hold_s
        self.clock = clock
        self.sleep = sleep or asyncio.sleep
        self.healthy_until = -math.inf
        self.probing: asyncio.Future[bool] | None = None  # the probe being asked, if one is
        self.counts = HeldCounts()
        self.counts_written = False
        self.waiting: dict[object, tuple[float, int]] = {}  # waiting now: since, tokens asked
        self.fcfs = False  # [switching] fcfs, as the switch on demand last wrote it
        self.order_read = -math.inf
        self.open_requests = OpenRequests(state_dir, port)
        self.said: str | None = None  # the last problem written to the journal

    def admits(self, token: str | None, mark: Mark | None) -> bool:
        """Whether a request may be sent to this runtime now, as one of a name's several
        replicas: not while a switch holds it (a switch's own request: only where it holds)."""
        held = mark is not None and mark.holds(self.port)
        own = mark is not None and is_switch_token(token, mark)
        return held if own else not held

    async def blocked(
        self, token: str | None, health: bool = True, arrived: float | None = None
    ) -> str | None:
        """Why a request must wait now, or None. `health`: False when the request's own
        connection will tell (the door's fast way holds it when the runtime does not serve).
        `arrived`: when it came (epoch seconds), for the order of [switching] fcfs."""
        why, mark = self.marked(token, arrived)
        if why is not None:
            return why
        now = self.clock()
        if mark is not None or not health or now < self.healthy_until:
            return None
        probing = self.probe_once()
        if now < self.healthy_until + HEALTH_STALE_S:
            return None  # healthy a moment ago: it goes on, and the answer comes for the next
        # shielded: a request that is cancelled (its client left) leaves the probe to the others
        return None if await asyncio.shield(probing) else NOT_HEALTHY

    def marked(self, token: str | None, arrived: float | None) -> tuple[str | None, Mark | None]:
        """Why a switch's mark (or [switching] fcfs) holds the request now, or None; and the mark
        that concerns this runtime."""
        mark = read_mark(self.state_dir)
        if mark is not None and mark.problem is not None:
            self._say(f"the hold mark cannot be read: {mark.problem}; requests wait as in a switch")
            return f"the hold mark cannot be read ({mark.problem})", mark
        if mark is not None and not mark.holds(self.port):
            mark = None  # a switch of runtimes on other cards: this one goes on serving
        if mark is not None and not is_switch_token(token, mark):
            return f"switching to {mark.target}", mark
        if mark is None and arrived is not None and self.behind(arrived):
            return BEHIND, mark
        return None, mark

    def pass_now(self, token: str | None) -> bool:
        """The first look of `wait(token, health=False)`, without waiting or leaving the task:
        True when the request may go on now (its ticket counted open first, as in `wait`), False
        when it must `wait`. So a request that is not held is written to the runtime in the same
        step of its task as the door's checks."""
        ticket = TICKET.get()
        if ticket is not None:
            ticket.open(self.open_requests)
        arrived = None if ticket is not None and ticket.from_peer else time.time()
        if self.marked(token, arrived)[0] is None:
            return True
        if ticket is not None:
            ticket.close()
        return False

    def behind(self, arrived: float) -> bool:
        """With [switching] fcfs (strict first come, first served, as llama-swap serves): whether
        a request for another runtime port has waited since before this one came. Then this one
        waits too, and the runtimes swap in the order the requests came."""
        now = self.clock()
        if now >= self.order_read + ORDER_TTL_S:
            self.fcfs, self.order_read = read_demand(self.state_dir).get("fcfs") is True, now
        if not self.fcfs:
            return False
        queues = read_queues(self.state_dir)
        return any(port != self.port and q.oldest < arrived for port, q in queues.items())

    async def healthy(self) -> bool:
        """Whether the runtime answers /health: the kept answer while it is fresh, else asked."""
        if self.clock() < self.healthy_until:
            return True
        return bool(await asyncio.shield(self.probe_once()))

    def probe_once(self) -> asyncio.Future[bool]:
        """The probe being asked, once for every request that needs it at the same moment: a
        burst that arrives when the last answer has aged asks /health once, not once each. Its
        answer is kept in `healthy_until`."""
        if self.probing is None:
            self.probing = asyncio.ensure_future(self.probe())
            self.probing.add_done_callback(self._probed)
        return self.probing

    def _probed(self, probing: asyncio.Future[bool]) -> None:
        self.probing = None
        healthy = not probing.cancelled() and probing.exception() is None and probing.result()
        self.healthy_until = self.clock() + HEALTH_TTL_S if healthy else -math.inf

    async def wait(
        self, token: str | None = None, limit_s: float | None = None, health: bool = True
    ) -> float:
        """Seconds waited; raises HoldTimeout when the hold time (or `limit_s`) runs out.
        `health`: whether the runtime's /health counts too, or only a switch's mark.

        The request being answered (the door's ticket) is counted open before the mark is read
        and closed while it waits: a drain that reads the open count after writing the mark
        sees every request that got past it."""
        ticket = TICKET.get()
        start: float | None = None
        limit = self.hold_s if limit_s is None else min(limit_s, self.hold_s)
        me = object()  # this request's place among those waiting
        arrived = None if ticket is not None and ticket.from_peer else time.time()
        try:
            while True:
                if ticket is not None:
                    ticket.open(self.open_requests)
                why = await self.blocked(token, health, arrived)
                if why is None:
                    return 0.0 if start is None else self.clock() - start
                if ticket is not None:
                    ticket.close()
                if start is None:
                    start = self.clock()
                    tokens = ticket.tokens if ticket is not None else 0
                    self.waiting[me] = (arrived or time.time(), tokens)
                    self._count(now=+1, total=+1)
                waited = self.clock() - start
                if why == NOT_HEALTHY and (refused := read_refused(self.state_dir, self.port)):
                    # Its runtime failed to start on demand: a 503 now, not at the hold's end
                    left = math.ceil(refused.until - time.time())
                    self._count(timed_out=+1)
                    raise HoldTimeout(
                        f"{refused.runtime} failed to start on demand ({refused.why}); it is "
                        f"not tried again for {left} s", waited, retry_after_s=max(1, left),
                    )  # fmt: skip
                if waited >= limit:
                    self._count(timed_out=+1)
                    raise HoldTimeout(
                        why, waited, retry_after_s=max(1, round(min(self.hold_s / 4, 30)))
                    )
                await self.sleep(min(POLL_S, limit - waited))
        finally:
            if start is not None:
                self.waiting.pop(me, None)
                self._count(now=-1)
                if ticket is not None:
                    ticket.queued_s += self.clock() - start

    def _count(self, now: int = 0, total: int = 0, timed_out: int = 0) -> None:
        self.counts.now += now
        self.counts.total += total
        self.counts.timed_out += timed_out
        try:
            oldest = min((since for since, _ in self.waiting.values()), default=None)
            tokens = sum(asked for _, asked in self.waiting.values())
            first = not self.counts_written
            write_counts(self.state_dir, self.counts, first, self.port, oldest, tokens)
            self.counts_written = True
        except OSError as e:
            # The counts are for the monitor: a request never fails because of them, but the
            # journal says that the status page and the metrics miss them.
            self._say(
                f"cannot write the held-request counts in {self.state_dir}: {e.strerror or e}; "
                "the status page and the metrics do not see them"
            )

    def _say(self, line: str) -> None:
        """A journal line, once while it stays the same."""
        if line != self.said:
            self.said = line
            log(line)
