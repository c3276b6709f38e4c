"""Fair turns at a full runtime: who goes next when the runtime runs as many requests as it can.

The runtime runs `slots` requests at once (llama.cpp's slots, vLLM's `--max-num-seqs`;
appliance.proxy.share.fair says how the door learns it). While fewer run, a request goes at
once (one more while one key alone wants the runtime: `alone`). Beyond that it waits at the
door, in one queue per key, and each freed place goes to the request that `pick` chooses:

- interactive keys before batch keys, unless a batch request has waited `batch_wait_s`: then
  the oldest such goes first, so batch never starves; but such requests take every other place
  at most while interactive requests wait, so a crowd of batch requests that all waited long
  never starves an interactive one either;
- batch keys hold every place but one (or `batch_share` of them) while an interactive key came
  within ACTIVE_S, on a runtime of two places or more: whoever keeps coming back beside a batch
  job starts at once, whatever it keeps waiting (a first request waits for one of its to end);
- `keep_free` of the places ([proxy] keep_free, default 0) go only to a key with nothing
  running while another key came within ACTIVE_S: the price of a quick start for whoever comes
  while one key fills the runtime is that key's share of those places;
- among the keys of a class, deficit round-robin on tokens (Shreedhar and Varghese, 1995), with
  credit that may go below zero: the key at the front of the ring gets QUANTUM tokens of credit
  on each visit and sends its oldest request while its credit is above zero, each request's
  tokens (the prompt's, about 4 bytes a token, and the most it asks of an answer) taken off it;
  a key in debt sits out the visits that pay it back. So keys that keep requests waiting share
  tokens, not requests, and a person with one request waits for at most one visit of each other
  key: that key's requests worth QUANTUM tokens, and the one that crosses it. A key with nothing
  waiting keeps no credit and no debt.

The proxy's workers share one record per runtime port (held/turns-PORT.db): an SQLite database
in write-ahead mode, changed by one worker at a time under an flock (turns-PORT.lock). The
requests waiting are rows, found by key and worker through indexes and never read whole, so a
request's way in and out costs the same with 5,000 waiting as with 5; what is kept whole is per
key (the ring, each key's credit, when it last came). A request is admitted by the worker whose
request ends (its freed place goes to the next, in any worker), and a worker with requests
waiting looks every POLL_S whether another worker changed the record (SQLite's data_version,
no read). Every LIVE_S the workers that died are found, and their requests and places dropped.
A record that cannot be read (cut short, not a database) is begun again, and each worker puts
its waiting requests back in line.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import secrets
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.hold import HELD_DIR, start_time
from appliance.people import BATCH, INTERACTIVE, MASTER

QUANTUM = 128  # tokens of credit a key gets on each visit of the ring
MOST_COST = 1 << 20  # a request's tokens, as the ring counts them, at most
POLL_S = 0.01  # a waiting worker's look whether the record changed
FULL_LOOK_S = 1.0  # ... and a look anyway this often (places of workers that died)
ACTIVE_S = 30.0  # a key that sent a request this recently counts as there ([proxy] keep_free)
LIVE_S = 1.0  # how often the workers in the record are looked up in /proc
WAL_PAGES = 16  # pages of write-ahead log before they are folded into the record
WAL_BYTES = 64 * 1024  # the log's size on disk after that, at most
# What a record that cannot be kept raises (a full or read-only disk, a lock that cannot be had)
RECORD_ERRORS = (OSError, sqlite3.Error)

SCHEMA = """
CREATE TABLE IF NOT EXISTS waiting(
    n INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, worker TEXT NOT NULL, key TEXT NOT NULL,
    priority TEXT NOT NULL, kind TEXT NOT NULL, cost INTEGER NOT NULL, since REAL NOT NULL);
CREATE INDEX IF NOT EXISTS waiting_by_key ON waiting(kind, key, n);
CREATE INDEX IF NOT EXISTS waiting_by_worker ON waiting(worker);
CREATE TABLE IF NOT EXISTS queued(
    kind TEXT NOT NULL, key TEXT NOT NULL, count INTEGER NOT NULL, PRIMARY KEY(kind, key)
) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS queued_in AFTER INSERT ON waiting BEGIN
    INSERT INTO queued VALUES (new.kind, new.key, 1)
        ON CONFLICT(kind, key) DO UPDATE SET count = count + 1;
END;
CREATE TRIGGER IF NOT EXISTS queued_out AFTER DELETE ON waiting BEGIN
    UPDATE queued SET count = count - 1 WHERE kind = old.kind AND key = old.key;
    DELETE FROM queued WHERE kind = old.kind AND key = old.key AND count <= 0;
END;
CREATE TABLE IF NOT EXISTS running(
    worker TEXT NOT NULL, key TEXT NOT NULL, n INTEGER NOT NULL, PRIMARY KEY(worker, key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS granted(id TEXT PRIMARY KEY, worker TEXT NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS granted_by_worker ON granted(worker);
CREATE TABLE IF NOT EXISTS workers(worker TEXT PRIMARY KEY) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS state(name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
"""
# The record's state kept whole: its size is per key
SMALL = ("ring", "credit", "paid", "seen", "batch")
AGED = "aged"  # in `paid`: the last place went to a batch request that waited batch_wait_s


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

    @property
    def kind(self) -> str:
        return BATCH if self.priority == BATCH else INTERACTIVE


def connect(where: str) -> sqlite3.Connection:
    """A connection to a record (":memory:": one of its own, for a choice worked out alone)."""
    db = sqlite3.connect(where, isolation_level=None, check_same_thread=False, timeout=30)
    db.execute("PRAGMA synchronous = OFF")  # a worker killed mid-write loses nothing (the WAL)
    if where != ":memory:":
        db.execute("PRAGMA journal_mode = WAL")
        # The log folded into the database every WAL_PAGES pages and cut back to WAL_BYTES: the
        # record stays tens of kilobytes on disk, not SQLite's default of 4 MB of log kept.
        db.execute(f"PRAGMA wal_autocheckpoint = {WAL_PAGES}")
        db.execute(f"PRAGMA journal_size_limit = {WAL_BYTES}")
    db.executescript(SCHEMA)
    return db


class Turns:
    """The record of one runtime port, inside one transaction."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        rows = dict(db.execute("SELECT name, value FROM state").fetchall())
        self.was = {name: rows.get(name) for name in SMALL}
        self.epoch: str | None = rows.get("epoch")
        self.ring: dict[str, list[str]] = _small(rows.get("ring"), lambda v: [str(k) for k in v])
        self.credit: dict[str, float] = _small(rows.get("credit"), float)
        self.paid: dict[str, bool] = _small(rows.get("paid"), bool)
        self.seen: dict[str, float] = _small(rows.get("seen"), float)
        self.batch: dict[str, bool] = _small(rows.get("batch"), bool)  # the batch keys seen

    @staticmethod
    def of(entries: Iterable[Entry] = ()) -> Turns:
        """A record in memory holding `entries` (a choice worked out alone: tests, simulations)."""
        turns = Turns(connect(":memory:"))
        for entry in entries:
            turns.add(entry)
        return turns

    def save(self) -> None:
        """The small state written back where it changed."""
        for name in SMALL:
            value = json.dumps(getattr(self, name), separators=(",", ":"), sort_keys=True)
            if value != self.was[name]:
                self.db.execute("INSERT OR REPLACE INTO state VALUES (?, ?)", (name, value))
                self.was[name] = value

    # --- requests waiting

    def add(self, entry: Entry) -> None:
        self.db.execute(
            "INSERT OR IGNORE INTO waiting(id, worker, key, priority, kind, cost, since) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                entry.id,
                entry.worker,
                entry.key,
                entry.priority,
                entry.kind,
                entry.cost,
                entry.since,
            ),
        )
        self.db.execute("INSERT OR IGNORE INTO workers VALUES (?)", (entry.worker,))
        if entry.kind == BATCH:
            self.batch[entry.key] = True
        else:
            self.batch.pop(entry.key, None)

    def remove(self, entry_id: str) -> bool:
        """The request out of the line (False: it was not in it)."""
        return self.db.execute("DELETE FROM waiting WHERE id = ?", (entry_id,)).rowcount > 0

    def keys_waiting(self, kind: str | None = None) -> list[str]:
        if kind is None:
            return [k for (k,) in self.db.execute("SELECT DISTINCT key FROM queued")]
        return [k for (k,) in self.db.execute("SELECT key FROM queued WHERE kind = ?", (kind,))]

    def waiting_count(self) -> int:
        return int(self.db.execute("SELECT COALESCE(SUM(count), 0) FROM queued").fetchone()[0])

    def head(self, kind: str, key: str) -> Entry:
        """The oldest request of `key` among those of `kind` (a key in keys_waiting(kind))."""
        row = self.db.execute(
            "SELECT id, key, priority, cost, since FROM waiting WHERE kind = ? AND key = ? "
            "ORDER BY n LIMIT 1",
            (kind, key),
        ).fetchone()
        return Entry(str(row[0]), str(row[1]), str(row[2]), int(row[3]), float(row[4]))

    # --- requests running, and those admitted that their worker has not seen yet

    def count(self) -> int:
        return int(self.db.execute("SELECT COALESCE(SUM(n), 0) FROM running").fetchone()[0])

    def count_batch(self) -> int:
        """The requests of batch keys running."""
        rows = self.db.execute("SELECT key, SUM(n) FROM running GROUP BY key")
        return sum(int(n) for key, n in rows if key in self.batch)

    def keys_running(self) -> set[str]:
        return {k for (k,) in self.db.execute("SELECT DISTINCT key FROM running WHERE n > 0")}

    def running(self) -> dict[str, dict[str, int]]:
        """worker -> key -> requests running."""
        out: dict[str, dict[str, int]] = {}
        for worker, key, n in self.db.execute("SELECT worker, key, n FROM running"):
            out.setdefault(worker, {})[key] = n
        return out

    def start(self, worker: str, key: str) -> None:
        self.db.execute(
            "INSERT INTO running VALUES (?, ?, 1) ON CONFLICT(worker, key) DO UPDATE SET n = n + 1",
            (worker, key),
        )
        self.db.execute("INSERT OR IGNORE INTO workers VALUES (?)", (worker,))

    def end(self, worker: str, key: str) -> None:
        self.db.execute("UPDATE running SET n = n - 1 WHERE worker = ? AND key = ?", (worker, key))
        self.db.execute(
            "DELETE FROM running WHERE worker = ? AND key = ? AND n <= 0", (worker, key)
        )

    def grant(self, entry: Entry) -> None:
        self.db.execute("INSERT OR IGNORE INTO granted VALUES (?, ?)", (entry.id, entry.worker))

    def take_granted(self, worker: str) -> set[str]:
        """The requests of `worker` that were admitted, taken off the list."""
        mine = {i for (i,) in self.db.execute("SELECT id FROM granted WHERE worker = ?", (worker,))}
        if mine:
            self.db.execute("DELETE FROM granted WHERE worker = ?", (worker,))
        return mine

    def ungrant(self, entry_id: str) -> bool:
        """The request off the list of those admitted (False: it was not on it)."""
        return self.db.execute("DELETE FROM granted WHERE id = ?", (entry_id,)).rowcount > 0

    # --- workers

    def workers(self) -> list[str]:
        return [w for (w,) in self.db.execute("SELECT worker FROM workers")]

    def drop_worker(self, worker: str) -> None:
        """Everything of a worker that died: its requests waiting, running and admitted."""
        for table in ("waiting", "running", "granted", "workers"):
            self.db.execute(f"DELETE FROM {table} WHERE worker = ?", (worker,))


def _small(text: str | None, value: Any) -> dict[str, Any]:
    """One of the small state's maps, as written; empty if it makes no sense (begun again)."""
    try:
        data = json.loads(text) if text else {}
        return {str(k): value(v) for k, v in data.items()}
    except (ValueError, TypeError, AttributeError):
        return {}


def pick(
    turns: Turns, now: float, batch_wait_s: float, only: set[str] | None = None
) -> Entry | None:
    """The waiting request that goes next, taken out of the line (None: none waits); among
    the keys in `only` when it is given."""
    batch_keys = [k for k in turns.keys_waiting(BATCH) if only is None or k in only]
    heads = [turns.head(BATCH, k) for k in batch_keys]
    aged = [e for e in heads if now - e.since >= batch_wait_s]
    interactive = [k for k in turns.keys_waiting(INTERACTIVE) if only is None or k in only]
    if aged and not (interactive and turns.paid.get(AGED)):
        chosen = min(aged, key=lambda e: e.since)
        turns.paid[AGED] = True
    elif interactive:
        chosen = _round_robin(turns, INTERACTIVE, interactive)
        turns.paid[AGED] = False
    elif batch_keys:
        chosen = _round_robin(turns, BATCH, batch_keys)
    else:
        return None
    turns.remove(chosen.id)
    return chosen


def _round_robin(turns: Turns, kind: str, keys: list[str]) -> Entry:
    """Deficit round-robin among `keys`, the keys of `kind` that have requests waiting."""
    waiting = set(keys)
    before = turns.ring.get(kind, [])
    ring = [k for k in before if k in waiting]
    ring += [k for k in keys if k not in ring]  # a key that begins to wait joins at the back
    if not before or before[0] != ring[0]:
        turns.paid[kind] = False  # a new front: its visit has not been paid
    everyone = set(turns.keys_waiting())
    for key in [k for k in turns.credit if k not in everyone]:
        del turns.credit[key]  # a key with nothing waiting keeps no credit, and no debt
    while True:
        front = ring[0]
        if not turns.paid.get(kind):
            turns.credit[front] = turns.credit.get(front, 0.0) + QUANTUM
            turns.paid[kind] = True
        if turns.credit.get(front, 0.0) > 0:
            head = turns.head(kind, front)
            turns.credit[front] -= head.cost
            # Keys left out of this choice (a kept place) keep their places in the ring.
            turns.ring[kind] = ring + [k for k in before if k not in ring]
            return head
        ring.append(ring.pop(0))  # its visit is over: the next key's
        turns.paid[kind] = False
        # Visits that would send nothing are skipped whole: every key gets their quanta.
        rounds = min(math.floor(-turns.credit.get(k, 0.0) / QUANTUM) for k in ring)
        if rounds > 0:
            for k in ring:
                turns.credit[k] = turns.credit.get(k, 0.0) + rounds * QUANTUM


def cost_of(body_bytes: int, asked_tokens: int) -> int:
    """A request's tokens as the ring counts them: its prompt at about 4 bytes a token, and the
    most it asks of an answer (512 when it does not say)."""
    return min(MOST_COST, body_bytes // 4 + (asked_tokens if asked_tokens > 0 else 512))


def fill(
    turns: Turns, slots: int, now: float, batch_wait_s: float, keep_free: int = 0,
    batch_share: float = 1.0,
) -> list[Entry]:  # fmt: skip
    """Admit waiting requests while fewer than `slots` run (one more while one key is `alone`
    and nothing is kept): those admitted, counted as running and listed as granted for their
    workers. The last `keep_free` places go only to a key with nothing running, or to any key
    while no other key came within ACTIVE_S: someone who comes while another key fills the
    runtime starts at once."""
    out: list[Entry] = []
    running = turns.count()
    batch_most = _batch_most(turns, slots, now, batch_share)
    batch = turns.count_batch() if batch_most is not None else 0
    while running < slots + (1 if keep_free == 0 and alone(turns, now) else 0):
        only = None
        if batch_most is not None and batch >= batch_most:
            only = set(turns.keys_waiting(INTERACTIVE))  # the place batch keys leave free
        if running < slots - keep_free:
            chosen = pick(turns, now, batch_wait_s, only)
        else:
            chosen = _pick_for_a_kept_place(turns, now, batch_wait_s, only)
        if chosen is None:
            break
        turns.start(chosen.worker, chosen.key)
        turns.grant(chosen)
        running += 1
        batch += chosen.kind == BATCH
        out.append(chosen)
    return out


def _batch_most(turns: Turns, slots: int, now: float, share: float = 1.0) -> int | None:
    """The places batch keys may hold together while an interactive key came within ACTIVE_S:
    `share` of them ([proxy] batch_share), one at least, all but one at most (None: no bound)."""
    people = {k for k, t in turns.seen.items() if now - t < ACTIVE_S and k not in turns.batch}
    most = min(slots - 1, max(1, math.floor(share * slots)))
    return most if slots >= 2 and people - {MASTER} else None


def alone(turns: Turns, now: float) -> bool:
    """Whether one key at most wants the runtime: running, waiting, or come within ACTIVE_S.
    Then one request more than the runtime's places is let through (without `keep_free`): it
    waits in the runtime, which starts it the moment a place frees, with no hand-over through
    the door between the two. Whoever comes next waits for that one too."""
    keys = turns.keys_running() | set(turns.keys_waiting())
    keys |= {k for k, t in turns.seen.items() if now - t < ACTIVE_S}
    return len(keys - {MASTER}) <= 1  # the appliance's own probes are nobody


def _pick_for_a_kept_place(
    turns: Turns, now: float, batch_wait_s: float, only: set[str] | None = None
) -> Entry | None:
    running = turns.keys_running()
    recent = {k for k, t in turns.seen.items() if now - t < ACTIVE_S} - {MASTER}
    eligible = {k for k in turns.keys_waiting() if k not in running or not (recent - {k})}
    eligible = eligible if only is None else eligible & only
    return pick(turns, now, batch_wait_s, only=eligible) if eligible else None


# --- the shared record ------------------------------------------------------------------------


class Record:
    """The record of one runtime port, shared by the proxy's workers."""

    def __init__(self, state_dir: Path, port: int | None) -> None:
        stem = state_dir / HELD_DIR / f"turns-{port if port is not None else 0}"
        self.path = stem.with_suffix(".db")
        self.lock_path = stem.with_suffix(".lock")
        self.db: sqlite3.Connection | None = None
        self.inode: int | None = None  # the database file this worker's connection reads
        self.lock: int | None = None
        self.version: int | None = None  # data_version when this worker last left the record
        self.epoch: str | None = None  # the record's, as this worker last saw it
        self.begun_again = False  # the record was begun again since this worker last saw it
        self.swept = -math.inf

    def changed(self) -> bool:
        """Whether another worker changed the record since this one last left it (no read)."""
        if self.db is None:
            return True
        try:
            return bool(self.db.execute("PRAGMA data_version").fetchone()[0] != self.version)
        except sqlite3.Error:
            return True

    @contextmanager
    def open(self) -> Iterator[Turns]:
        """The record, to change in the block; written when it ends, or not at all if it
        raises. The requests of workers that are gone are dropped from it first."""
        if self.lock is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.lock = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        try:
            turns = self._begin()
            try:
                self._sweep(turns)
                yield turns
                now = time.time()
                turns.seen = {k: t for k, t in turns.seen.items() if now - t < ACTIVE_S}
                turns.save()
                turns.db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    turns.db.execute("ROLLBACK")
                raise
            self.version = turns.db.execute("PRAGMA data_version").fetchone()[0]
        finally:
            fcntl.flock(self.lock, fcntl.LOCK_UN)

    def _begin(self) -> Turns:
        """A transaction on the record, begun again (new, empty) if it cannot be read."""
        try:
            turns = self._transaction()
        except sqlite3.DatabaseError as e:
            if isinstance(e, sqlite3.OperationalError):
                raise  # a full disk, a file that cannot be opened: not the record's fault
            self._close()
            for suffix in (".db", ".db-wal", ".db-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path.with_suffix(suffix))
            turns = self._transaction()
        if turns.epoch is None:
            turns.epoch = secrets.token_hex(8)
            turns.db.execute("INSERT INTO state VALUES ('epoch', ?)", (turns.epoch,))
        if self.epoch is not None and turns.epoch != self.epoch:
            self.begun_again = True  # until the worker's poll puts its requests back
        self.epoch = turns.epoch
        return turns

    def _transaction(self) -> Turns:
        try:
            inode = os.stat(self.path).st_ino
        except FileNotFoundError:
            inode = None
        if self.db is None or inode != self.inode:  # new, or made anew by another worker
            self._close()
            self.db = connect(str(self.path))
            self.inode = os.stat(self.path).st_ino
        self.db.execute("BEGIN IMMEDIATE")
        try:
            return Turns(self.db)
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                self.db.execute("ROLLBACK")
            raise

    def _close(self) -> None:
        if self.db is not None:
            with contextlib.suppress(sqlite3.Error):
                self.db.close()
        self.db, self.inode, self.version = None, None, None

    def _sweep(self, turns: Turns) -> None:
        """Every LIVE_S: the requests and places of the workers that died, dropped."""
        now = time.monotonic()
        if now - self.swept < LIVE_S:
            return
        self.swept = now
        for worker in turns.workers():
            if not self._alive(worker):
                turns.drop_worker(worker)

    def _alive(self, worker: str) -> bool:
        pid, _, started = worker.partition(":")
        if not pid.isdigit():
            return False
        return start_time(int(pid)) == (started if started != "None" else None)
