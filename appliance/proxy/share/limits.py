"""A key's limits, kept across the proxy's workers: requests at once (`max_parallel`), requests a
minute (`rpm`) and tokens a minute (`tpm`, in and out, as the runtime's answers count them).

Each limited key has a small file in the proxy's part of the state directory (held/keys/NAME.json),
read and written under an flock for each request that starts or ends: every worker sees the
others' requests, so two workers do not let a key through twice as often. A key without limits
costs no file. The requests at once count only workers that are alive (their pid and start time),
so a worker that died does not hold its key's places.

A request over a limit is refused with 429 and `Retry-After`: the seconds until the oldest
request or tokens of the last minute leave it, or 1 s for requests at once.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from appliance.hold import HELD_DIR, start_time, write_shared
from appliance.people import Person
from appliance.proxy import log
from appliance.proxy.checks import Refusal

KEYS_DIR = "keys"  # in HELD_DIR
WINDOW_S = 60.0


class Limits:
    """The door's view of every limited key's requests, shared through files."""

    def __init__(self, state_dir: Path, clock: Callable[[], float] = time.time) -> None:
        self.folder = state_dir / HELD_DIR / KEYS_DIR
        self.clock = clock
        self.me = f"{os.getpid()}:{start_time(os.getpid())}"
        self.said: str | None = None  # the last problem said in the journal

    async def admit_async(self, person: Person) -> None:
        """`admit`, as the door calls it (the fleet's limits ask Redis)."""
        self.admit(person)

    def admit(self, person: Person) -> None:
        """Count one request of `person` in, or raise the 429 Refusal that says which limit. When
        the counts cannot be kept (a full or read-only disk), the request goes on and the journal
        says so, once: a limit is not worth a request failing."""
        if not person.limited:
            return
        try:
            self._admit(person)
        except OSError as e:
            self._unkept(e)

    def _admit(self, person: Person) -> None:
        with self._record(person.name) as record:
            now = self.clock()
            running = sum(n for owner, n in record["open"].items() if _alive(owner))
            asked = [t for t in record["asked"] if t > now - WINDOW_S]
            spent = [(t, n) for t, n in record["spent"] if t > now - WINDOW_S]
            record["asked"], record["spent"] = asked, spent
            if person.max_parallel is not None and running >= person.max_parallel:
                raise refused(person, "max_parallel", running, 1)
            if person.rpm is not None and len(asked) >= person.rpm:
                wait = asked[len(asked) - person.rpm] + WINDOW_S - now
                raise refused(person, "rpm", len(asked), wait)
            used = sum(n for _, n in spent)
            if person.tpm is not None and used >= person.tpm:
                raise refused(person, "tpm", used, _until_below(spent, used - person.tpm, now))
            asked.append(now)
            record["open"][self.me] = record["open"].get(self.me, 0) + 1

    def done(self, person: Person, tokens: int) -> None:
        """A request of `person` that `admit` let in ended, having used `tokens`."""
        if not person.limited:
            return
        try:
            self._done(person, tokens)
        except OSError as e:
            self._unkept(e)

    def _unkept(self, e: OSError) -> None:
        problem = f"b70: cannot keep the keys' limits in {self.folder}: {e.strerror or e}"
        if problem != self.said:
            self.said = problem
            log(problem + "; their requests go on unlimited until it can")

    def _done(self, person: Person, tokens: int) -> None:
        with self._record(person.name) as record:
            left = record["open"].get(self.me, 0) - 1
            if left > 0:
                record["open"][self.me] = left
            else:
                record["open"].pop(self.me, None)
            record["open"] = {o: n for o, n in record["open"].items() if _alive(o)}
            if tokens > 0:
                record["spent"].append((self.clock(), tokens))

    @contextmanager
    def _record(self, name: str) -> Iterator[dict[str, Any]]:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{name}.json"
        fd = os.open(self.folder / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            record = _read(path)
            yield record
            write_shared(path, json.dumps(record, separators=(",", ":")))
        finally:
            os.close(fd)


def refused(person: Person, limit: str, count: int, wait_s: float) -> Refusal:
    """The 429 of a key over `limit` ("max_parallel", "rpm" or "tpm"), at `count`."""
    if limit == "max_parallel":
        what = f"has {count} of its {person.max_parallel} requests at once open already"
        return too_many(person.name, what, "max_parallel", wait_s)
    if limit == "rpm":
        what = f"sent {count} requests in the last minute, its most"
        return too_many(person.name, what, f"rpm {person.rpm}", wait_s)
    what = f"used {count} tokens in the last minute, over its {person.tpm}"
    return too_many(person.name, what, "tpm", wait_s)


def too_many(name: str, what: str, limit: str, wait_s: float) -> Refusal:
    after = max(1, math.ceil(wait_s))
    return Refusal(
        429, f"the key {name!r} {what} ({limit}; `b70ctl keys list` shows its limits). Retry "
        f"after {after} s.", "b70_key_limit", kind="rate_limit_exceeded",
        headers={"Retry-After": str(after)},
    )  # fmt: skip


def _until_below(spent: list[tuple[float, int]], over: int, now: float) -> float:
    """Seconds until the tokens of the last minute fall below the limit: when enough of the oldest
    have left the window."""
    gone = 0
    for t, n in sorted(spent):
        gone += n
        if gone > over:
            return t + WINDOW_S - now
    return WINDOW_S


def _alive(owner: str) -> bool:
    pid, _, started = owner.partition(":")
    return pid.isdigit() and start_time(int(pid)) == (started if started != "None" else None)


def _read(path: Path) -> dict[str, Any]:
    empty: dict[str, Any] = {"open": {}, "asked": [], "spent": []}
    try:
        data = json.loads(path.read_text())
        open_ = {str(o): int(n) for o, n in data["open"].items()}
        asked = [float(t) for t in data["asked"]]
        spent = [(float(t), int(n)) for t, n in data["spent"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return empty  # none yet, or cut short: the counts start again
    return {"open": open_, "asked": asked, "spent": spent}
