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

One proxy worker keeps the turns of every runtime port for all of them, in memory
(appliance.proxy.share.usher): each operation costs the same however many wait, since every
choice looks at each key's oldest request only.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from appliance.people import BATCH, INTERACTIVE, MASTER

QUANTUM = 128  # tokens of credit a key gets on each visit of the ring
MOST_COST = 1 << 20  # a request's tokens, as the ring counts them, at most
ACTIVE_S = 30.0  # a key that sent a request this recently counts as there ([proxy] keep_free)


@dataclass
class Entry:
    """One request that waits."""

    id: str  # its worker and a number of the worker's
    key: str
    priority: str  # INTERACTIVE or BATCH
    cost: int  # tokens, as the ring counts them
    since: float  # epoch seconds it began to wait

    def as_json(self) -> list[Any]:
        return [self.id, self.key, self.priority, self.cost, round(self.since, 3)]

    @staticmethod
    def of_json(data: Any) -> Entry:
        i, k, p, c, t = data
        return Entry(str(i), str(k), BATCH if p == BATCH else INTERACTIVE, int(c), float(t))


@dataclass
class Turns:
    """The turns of one runtime port: the requests running (id -> key), those waiting in one
    queue per key (oldest first), and the ring and credit of each key."""

    queues: dict[str, deque[Entry]] = field(default_factory=dict)
    running: dict[str, str] = field(default_factory=dict)
    per_key: Counter[str] = field(default_factory=Counter)  # requests running, per key
    ring: dict[str, list[str]] = field(default_factory=dict)  # class -> keys, the front first
    credit: dict[str, float] = field(default_factory=dict)  # key -> tokens
    paid: dict[str, bool] = field(default_factory=dict)  # class -> its front has its quantum
    seen: dict[str, float] = field(default_factory=dict)  # key -> when it last sent a request
    gone: set[str] = field(default_factory=set)  # waiting requests that left (out at the head)
    index: dict[str, str] = field(default_factory=dict)  # each waiting request's key, by id

    @staticmethod
    def of(entries: list[Entry]) -> Turns:
        t = Turns()
        for e in entries:
            t.add(e)
        return t

    def add(self, entry: Entry) -> None:
        if entry.id not in self.index and entry.id not in self.running:
            self.queues.setdefault(entry.key, deque()).append(entry)
            self.index[entry.id] = entry.key

    def leave_queue(self, entry_id: str) -> bool:
        """A waiting request out of its queue (at once in the count; out of the queue itself
        when it comes to its head). Whether it was waiting."""
        if self.index.pop(entry_id, None) is None:
            return False
        self.gone.add(entry_id)
        return True

    def waiting_count(self) -> int:
        return len(self.index)

    def heads(self) -> dict[str, Entry]:
        """Each key's oldest request that still waits (the keys in the order they came)."""
        out = {}
        for key in list(self.queues):
            queue = self.queues[key]
            while queue and queue[0].id in self.gone:
                self.gone.discard(queue.popleft().id)
            if queue:
                out[key] = queue[0]
            else:
                del self.queues[key]
        return out

    def waiting(self) -> list[Entry]:
        """Every waiting request (for tests and the record's view: not on a request's way)."""
        return [e for q in self.queues.values() for e in q if e.id not in self.gone]

    def take(self, entry: Entry) -> None:
        """`entry`, its queue's head, out of it."""
        self.queues[entry.key].popleft()
        del self.index[entry.id]

    def count(self) -> int:
        return len(self.running)

    def keys_running(self) -> set[str]:
        return {k for k, n in self.per_key.items() if n > 0}

    def start(self, entry_id: str, key: str) -> None:
        if entry_id not in self.running:
            self.running[entry_id] = key
            self.per_key[key] += 1

    def end(self, entry_id: str) -> bool:
        """A running request ended; whether it ran."""
        key = self.running.pop(entry_id, None)
        if key is None:
            return False
        self.per_key[key] -= 1
        if self.per_key[key] <= 0:
            del self.per_key[key]
        return True


def pick(
    turns: Turns, now: float, batch_wait_s: float, only: set[str] | None = None
) -> Entry | None:
    """The waiting request that goes next, taken out of its queue (None: none waits). `only`:
    the keys that may go (all when None)."""
    heads = turns.heads()
    if only is not None:
        heads = {k: e for k, e in heads.items() if k in only}
    if not heads:
        return None
    aged = [e for e in heads.values() if e.priority == BATCH and now - e.since >= batch_wait_s]
    if aged:
        chosen = min(aged, key=lambda e: e.since)
    else:
        interactive = any(e.priority != BATCH for e in heads.values())
        chosen = _round_robin(turns, heads, INTERACTIVE if interactive else BATCH)
    turns.take(chosen)
    return chosen


def _round_robin(turns: Turns, all_heads: dict[str, Entry], kind: str) -> Entry:
    """Deficit round-robin among the keys of `kind` that have requests waiting."""
    heads = {k: e for k, e in all_heads.items() if (e.priority == BATCH) == (kind == BATCH)}
    ring = [k for k in turns.ring.get(kind, []) if k in heads]
    ring += [k for k in heads if k not in ring]  # a key that begins to wait joins at the back
    if not turns.ring.get(kind) or turns.ring[kind][0] != ring[0]:
        turns.paid[kind] = False  # a new front: its visit has not been paid
    for key in [k for k in turns.credit if k not in turns.queues]:
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


def fill(
    turns: Turns, slots: int, now: float, batch_wait_s: float, keep_free: int = 0
) -> list[Entry]:
    """Admit waiting requests while fewer than `slots` run (one more while one key is `alone`
    and nothing is kept): those admitted, counted as running. The last `keep_free` places go
    only to a key with nothing running, or to any key while no other key came within ACTIVE_S:
    someone who comes while another key fills the runtime starts at once."""
    turns.seen = {k: t for k, t in turns.seen.items() if now - t < ACTIVE_S}
    out = []
    running = turns.count()
    while running < slots + (1 if keep_free == 0 and alone(turns, now) else 0):
        if running < slots - keep_free:
            chosen = pick(turns, now, batch_wait_s)
        else:
            chosen = _pick_for_a_kept_place(turns, now, batch_wait_s)
        if chosen is None:
            break
        turns.start(chosen.id, chosen.key)
        running += 1
        out.append(chosen)
    return out


def alone(turns: Turns, now: float) -> bool:
    """Whether one key at most wants the runtime: running, waiting, or come within ACTIVE_S.
    Then one request more than the runtime's places is let through (without `keep_free`): it
    waits in the runtime, which starts it the moment a place frees, with no hand-over through
    the door between the two. Whoever comes next waits for that one too."""
    keys = turns.keys_running() | set(turns.heads())
    keys |= {k for k, t in turns.seen.items() if now - t < ACTIVE_S}
    return len(keys - {MASTER}) <= 1  # the appliance's own probes are nobody


def _pick_for_a_kept_place(turns: Turns, now: float, batch_wait_s: float) -> Entry | None:
    running = turns.keys_running()
    recent = {k for k, t in turns.seen.items() if now - t < ACTIVE_S} - {MASTER}
    eligible = {k for k in turns.heads() if k not in running or not (recent - {k})}
    return pick(turns, now, batch_wait_s, only=eligible) if eligible else None
