"""Fair turns at a full runtime: who goes next when the runtime runs as many requests as it can.

The runtime runs `slots` requests at once (llama.cpp's slots, vLLM's `--max-num-seqs`;
appliance.proxy.share.fair says how the door learns it). While fewer run, a request goes at
once (one more while one key alone wants the runtime: `alone`). Beyond that it waits at the
door, in one queue per key, and each freed place goes to the request that `pick` chooses:

- interactive keys before batch keys, unless a batch request has waited `batch_wait_s`: then
  the oldest such goes first, so batch never starves;
- `keep_free` of the places ([proxy] keep_free, default 0) go only to a key with nothing
  running while another key came within ACTIVE_S: the price of a quick start for whoever comes
  while one key fills the runtime is that key's share of those places;
- among the keys of a class, deficit round-robin on tokens (Shreedhar and Varghese, 1995): the
  key at the front of the ring gets QUANTUM tokens of credit on each visit and sends its oldest
  request when its credit covers that request's tokens (the prompt's, about 4 bytes a token,
  and the most it asks of an answer), else the next key is visited. A person with one request
  waits for one other request at most, not for another person's 64.

The proxy's workers share one record per runtime port (held/turns-PORT.json), read and written
under an flock: the requests running, those waiting, and the ring and credit of each key. A
request is admitted by the worker whose request ends (its freed place goes to the next, in any
worker), and a worker with requests waiting looks every POLL_S whether one was admitted. The
requests of a worker that died are dropped from the record the next time it is read.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.hold import HELD_DIR, start_time
from appliance.people import BATCH, INTERACTIVE, MASTER

QUANTUM = 128  # tokens of credit a key gets on each visit of the ring
MOST_COST = 1 << 20  # a request's tokens, as the ring counts them, at most
POLL_S = 0.01  # a waiting worker's look at the record: a stat; read only when it changed
FULL_LOOK_S = 1.0  # ... and read anyway this often (places of workers that died)
ACTIVE_S = 30.0  # a key that sent a request this recently counts as there ([proxy] keep_free)
LIVE_S = 1.0  # how long a worker's liveness, once read from /proc, is trusted
PAD_MOST = 65536  # bytes of spaces a record may keep after its JSON before it is cut


@dataclass
class Entry:
    """One request that waits."""

    id: str  # its worker (pid and start time) and a number of the worker's
    key: str
    priority: str  # INTERACTIVE or BATCH
    cost: int  # tokens, as the ring counts them
    since: float  # epoch seconds it began to wait

    @property
    def worker(self) -> str:
        return self.id.rsplit(":", 1)[0]

    def as_json(self) -> list[Any]:
        return [self.id, self.key, self.priority, self.cost, round(self.since, 3)]


@dataclass
class Turns:
    """The record of one runtime port. Requests that run are counted, not listed (worker -> key
    -> how many), so that the record stays small however many run: it is read and written for
    every request."""

    running: dict[str, dict[str, int]] = field(default_factory=dict)
    waiting: list[Entry] = field(default_factory=list)  # in the order they came
    granted: list[str] = field(default_factory=list)  # admitted; their worker has not seen it
    ring: dict[str, list[str]] = field(default_factory=dict)  # class -> keys, the front first
    credit: dict[str, float] = field(default_factory=dict)  # key -> tokens
    paid: dict[str, bool] = field(default_factory=dict)  # class -> its front has its quantum
    seen: dict[str, float] = field(default_factory=dict)  # key -> when it last sent a request

    def as_json(self) -> dict[str, Any]:
        return {
            "running": self.running, "waiting": [e.as_json() for e in self.waiting],
            "granted": self.granted, "ring": self.ring, "credit": self.credit,
            "paid": self.paid, "seen": self.seen,
        }  # fmt: skip

    @staticmethod
    def of_json(data: Any) -> Turns:
        return Turns(
            {str(w): {str(k): int(n) for k, n in c.items()} for w, c in data["running"].items()},
            [Entry(str(i), str(k), str(p), int(c), float(t)) for i, k, p, c, t in data["waiting"]],
            [str(i) for i in data["granted"]],
            {str(k): [str(x) for x in v] for k, v in data["ring"].items()},
            {str(k): float(v) for k, v in data["credit"].items()},
            {str(k): bool(v) for k, v in data["paid"].items()},
            {str(k): float(v) for k, v in data.get("seen", {}).items()},
        )  # fmt: skip

    def count(self) -> int:
        return sum(n for by_key in self.running.values() for n in by_key.values())

    def keys_running(self) -> set[str]:
        return {k for by_key in self.running.values() for k, n in by_key.items() if n > 0}

    def start(self, worker: str, key: str) -> None:
        by_key = self.running.setdefault(worker, {})
        by_key[key] = by_key.get(key, 0) + 1

    def end(self, worker: str, key: str) -> None:
        by_key = self.running.get(worker, {})
        left = by_key.get(key, 0) - 1
        if left > 0:
            by_key[key] = left
        else:
            by_key.pop(key, None)
            if not by_key:
                self.running.pop(worker, None)


def pick(turns: Turns, now: float, batch_wait_s: float) -> Entry | None:
    """The waiting request that goes next, taken out of `waiting` (None: none waits)."""
    if not turns.waiting:
        return None
    aged = [e for e in turns.waiting if e.priority == BATCH and now - e.since >= batch_wait_s]
    if aged:
        chosen = min(aged, key=lambda e: e.since)
    else:
        interactive = [e for e in turns.waiting if e.priority != BATCH]
        chosen = _round_robin(turns, INTERACTIVE if interactive else BATCH)
    turns.waiting.remove(chosen)
    return chosen


def _round_robin(turns: Turns, kind: str) -> Entry:
    """Deficit round-robin among the keys of `kind` that have requests waiting."""
    heads: dict[str, Entry] = {}
    for e in turns.waiting:  # in the order they came: each key's oldest first
        if (e.priority == BATCH) == (kind == BATCH) and e.key not in heads:
            heads[e.key] = e
    ring = [k for k in turns.ring.get(kind, []) if k in heads]
    ring += [k for k in heads if k not in ring]  # a key that begins to wait joins at the back
    if not turns.ring.get(kind) or turns.ring[kind][0] != ring[0]:
        turns.paid[kind] = False  # a new front: its visit has not been paid
    waiting_keys = {e.key for e in turns.waiting}
    for key in [k for k in turns.credit if k not in waiting_keys]:
        del turns.credit[key]  # a key with nothing waiting keeps no credit
    while True:
        front = ring[0]
        if not turns.paid.get(kind):
            turns.credit[front] = turns.credit.get(front, 0.0) + QUANTUM
            turns.paid[kind] = True
        head = heads[front]
        if turns.credit.get(front, 0.0) >= head.cost:
            turns.credit[front] -= head.cost
            turns.ring[kind] = ring
            return head
        # Not enough credit for its oldest: the next key's visit. Visits that would pay no one
        # are skipped whole (every key gets the quanta of the rounds skipped).
        short = [
            (heads[k].cost - turns.credit.get(k, 0.0)) / QUANTUM for k in ring
        ]  # rounds each key lacks
        rounds = int(min(short)) - 1
        if rounds > 0:
            for k in ring:
                turns.credit[k] = turns.credit.get(k, 0.0) + rounds * QUANTUM
        ring.append(ring.pop(0))
        turns.paid[kind] = False


def cost_of(body_bytes: int, asked_tokens: int) -> int:
    """A request's tokens as the ring counts them: its prompt at about 4 bytes a token, and the
    most it asks of an answer (512 when it does not say)."""
    return min(MOST_COST, body_bytes // 4 + (asked_tokens if asked_tokens > 0 else 512))


# --- the shared record ------------------------------------------------------------------------


class Record:
    """The record of one runtime port, shared by the proxy's workers."""

    def __init__(self, state_dir: Path, port: int | None) -> None:
        self.path = state_dir / HELD_DIR / f"turns-{port if port is not None else 0}.json"
        self.live: dict[int, tuple[float, bool]] = {}
        self.left: tuple[int, int, int] | None = None  # the file as this worker left it
        self.made = False  # its folder exists

    def changed(self) -> bool:
        """Whether another worker wrote the record since this one last did (a stat, no lock)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return True
        return (st.st_ino, st.st_mtime_ns, st.st_size) != self.left

    @contextmanager
    def open(self) -> Iterator[Turns]:
        """The record, to change in the block; written back when it ends. Requests of workers
        that are gone are dropped from it first."""
        if not self.made:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.made = True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, os.fstat(fd).st_size, 0)
            try:
                turns = Turns.of_json(json.loads(raw)) if raw else Turns()
            except (ValueError, KeyError, TypeError, AttributeError):
                turns = Turns()  # cut short by a worker that died writing: begun again
            self._drop_the_dead(turns)
            now = time.time()
            turns.seen = {k: t for k, t in turns.seen.items() if now - t < ACTIVE_S}
            yield turns
            data = json.dumps(turns.as_json(), separators=(",", ":")).encode()
            if data != raw.rstrip(b" "):
                # Written over in place, padded with spaces (JSON's own) to the old length: a
                # truncation costs a file system's block bookkeeping, 0.16 ms a time here.
                if len(raw) - len(data) > PAD_MOST:
                    os.ftruncate(fd, len(data))
                os.pwrite(fd, data.ljust(len(raw), b" "), 0)
            st = os.fstat(fd)
            self.left = (st.st_ino, st.st_mtime_ns, st.st_size)
        finally:
            os.close(fd)

    def _drop_the_dead(self, turns: Turns) -> None:
        turns.running = {w: c for w, c in turns.running.items() if self._alive(w)}
        turns.waiting = [e for e in turns.waiting if self._alive(e.worker)]
        turns.granted = [i for i in turns.granted if self._alive(i.rsplit(":", 1)[0])]

    def _alive(self, worker: str) -> bool:
        pid, _, started = worker.partition(":")
        now = time.monotonic()
        known = self.live.get(int(pid))
        if known is None or now - known[0] > LIVE_S:
            known = (now, start_time(int(pid)) == (started if started != "None" else None))
            self.live[int(pid)] = known
        return known[1]


def fill(
    turns: Turns, slots: int, now: float, batch_wait_s: float, keep_free: int = 0
) -> list[Entry]:
    """Admit waiting requests while fewer than `slots` run (one more while one key is `alone`
    and nothing is kept): those admitted, counted as running and listed in `granted` for their
    workers. The last `keep_free` places go only to a key with nothing running, or to any key
    while no other key came within ACTIVE_S: someone who comes while another key fills the
    runtime starts at once."""
    out = []
    running = turns.count()
    while running < slots + (1 if keep_free == 0 and alone(turns, now) else 0):
        if running < slots - keep_free:
            chosen = pick(turns, now, batch_wait_s)
        else:
            chosen = _pick_for_a_kept_place(turns, now, batch_wait_s)
        if chosen is None:
            break
        turns.start(chosen.worker, chosen.key)
        turns.granted.append(chosen.id)
        running += 1
        out.append(chosen)
    return out


def alone(turns: Turns, now: float) -> bool:
    """Whether one key at most wants the runtime: running, waiting, or come within ACTIVE_S.
    Then one request more than the runtime's places is let through (without `keep_free`): it
    waits in the runtime, which starts it the moment a place frees, with no hand-over through
    the door between the two. Whoever comes next waits for that one too."""
    keys = turns.keys_running() | {e.key for e in turns.waiting}
    keys |= {k for k, t in turns.seen.items() if now - t < ACTIVE_S}
    return len(keys - {MASTER}) <= 1  # the appliance's own probes are nobody


def _pick_for_a_kept_place(turns: Turns, now: float, batch_wait_s: float) -> Entry | None:
    running = turns.keys_running()
    recent = {k for k, t in turns.seen.items() if now - t < ACTIVE_S} - {MASTER}
    eligible = [e for e in turns.waiting if e.key not in running or not (recent - {e.key})]
    if not eligible:
        return None
    everyone, turns.waiting = turns.waiting, eligible
    chosen = pick(turns, now, batch_wait_s)
    turns.waiting = [e for e in everyone if chosen is None or e.id != chosen.id]
    return chosen
