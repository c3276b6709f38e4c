"""Front doors that share a Redis ([peers] redis_host, B70_REDIS "HOST:PORT") share their people's
keys, each key's limits and each key's use there.

Keys (`FleetKeys`): each proxy worker looks every half second at its own keys file and at the
fleet's hash (FLEET_KEYS), publishes its door's changes that are not yet ordered through the
fleet's one order (appliance.keyorder, a counter in Redis), and takes the last change of each
name: a key made, rotated or revoked on one door counts on every door within 10 s,
without a restart, whatever each door's clock says. Redis that cannot be reached leaves each
door its own file and the fleet's keys as last read (the journal says so once, and again when it
is back). The fleet's hash as last read, and the numbers this door's changes got, are written to
held/keys-fleet.json (mode 0600): `b70ctl keys` takes the same view from it and the door's own
file, to list the keys in force, to rotate or revoke on one door a key made on another, and to
give each change its base.

Limits (`FleetLimits`): one atomic check and count in Redis per request of a limited key, each
worker's open requests beside its heartbeat, the minute by Redis's clock. A worker's own counts
are what it writes there: the end of a request, and every heartbeat, write them again, so a
count written out of order is right again within half a second.

Use (`FleetUsage`): each key's use added to the fleet's hourly hashes every 2 s, for `b70ctl
usage --fleet`. Each loop's failure is in the journal once, with its cause (`Said`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from appliance.files import write_atomic
from appliance.hold import HELD_DIR
from appliance.keyorder import (
    FLEET_FILE,
    FLEET_KEYS,
    FLEET_ORDER,
    FLEET_SEQ,
    ORDER,
    dump_fleet,
    fingerprint,
    fleet_view,
    is_revocation,
    read_fleet,
)
from appliance.people import LOOK_EVERY_S, KeyRing, Person
from appliance.proxy import log
from appliance.proxy.share.limits import WINDOW_S, Limits, refused
from appliance.usage import FLEET_USAGE, FLUSH_S, HOUR_S, RETAIN_S, Use


def redis_address(text: str) -> tuple[str, int] | None:
    """B70_REDIS: "HOST:PORT" (an IPv6 address in brackets)."""
    host, _, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    return (host, int(port)) if host and port.isdigit() else None


class Said:
    """A fleet loop's failures, each in the journal once with its cause (again when the cause
    changes), and that it works again: Redis away, or a bug, is never passed over unsaid."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.last: str | None = None

    def failed(self, e: BaseException) -> None:
        why = f"{type(e).__name__}: {e}"
        if why != self.last:
            self.last = why
            log(f"b70: {self.what} failed on this worker ({why}); it tries again")

    def ok(self) -> None:
        if self.last is not None:
            self.last = None
            log(f"b70: {self.what} works again on this worker")


class FleetKeys:
    """One worker's share of the fleet's keys: the hash read into its KeyRing, its door's own
    changes published in the fleet's order (appliance.keyorder)."""

    def __init__(self, ring: KeyRing, redis: Any, state_dir: Path) -> None:
        self.ring, self.redis = ring, redis
        ring.merge = lambda *mine_and_theirs: fleet_view(*mine_and_theirs).people
        self.file = state_dir / HELD_DIR / FLEET_FILE
        self.remote, self.settled = read_fleet(state_dir)  # as this door last knew them
        self.problem: str | None = None
        self.said = Said("keeping the fleet's keys")
        self.written: str | None = None
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        while True:
            try:
                await self.once()
            except Exception as e:  # a bug, not Redis (_read and _order say those)
                self.said.failed(e)
            else:
                self.said.ok()
            await asyncio.sleep(LOOK_EVERY_S)

    async def once(self) -> None:
        reached = await self._read()
        view = fleet_view(self.ring.local(), self.ring.revoked, self.remote, self.settled)
        self.settled.update(view.ordered)
        if reached:
            for name, entry in view.pending.items():
                if not await self._order(name, entry):
                    break
        self.ring.take_remote(self.remote, self.settled)  # merged with its file at its next look
        self._note()

    async def _read(self) -> bool:
        try:
            raw = await self.redis.hgetall(FLEET_KEYS)
        except Exception as e:  # redis's errors, OSError, a timeout
            self._said(f"b70: cannot read the fleet's keys from Redis: {e}")
            return False
        remote: dict[str, object] = {}
        for name, value in raw.items():
            with contextlib.suppress(ValueError, UnicodeDecodeError, AttributeError):
                remote[_text(name)] = json.loads(value)
        self.remote = remote
        if self.problem is not None:
            self.problem = None
            log("b70: the fleet's keys are read from Redis again")
        return True

    async def _order(self, name: str, entry: dict[str, object]) -> bool:
        """One change of this door's, given its number in the fleet (or found to have lost)."""
        mark = fingerprint(name, entry)
        base = entry.get("base", 0)
        args = [name, mark.split("\t", 1)[1], base, json.dumps(entry), int(is_revocation(entry))]
        try:
            got = int(await self.redis.eval(ORDER, 3, FLEET_KEYS, FLEET_ORDER, FLEET_SEQ, *args))
        except Exception as e:
            self._said(f"b70: cannot write this door's keys to Redis: {e}")
            return False
        self.settled[mark] = got
        if got > 0:
            self.remote[name] = {"seq": got, **entry}
        else:
            log(
                f"b70: the change of the key {name!r} made on this door lost to a later one "
                "made on another door; `b70ctl keys list` shows the key in force"
            )
        return True

    def _said(self, problem: str) -> None:
        if self.problem is None:
            self.problem = problem
            log(problem + "; each door goes on with the keys it knows")

    def _note(self) -> None:
        """The fleet's hash and this door's numbers, for `b70ctl keys` and a worker that starts
        (written when they change)."""
        text = dump_fleet(self.remote, self.settled)
        if text == self.written:
            return
        try:
            write_atomic(self.file, text, mode=0o600)
        except OSError:
            return
        self.written = text


# --- the limits --------------------------------------------------------------------------------

# One check and count, atomic in Redis, for a request of a limited key: its requests at once
# (each worker's count, of the workers whose heartbeat lives), its requests of the last minute and
# its tokens of the last minute; as Limits keeps them in a file on one door. The minute is Redis's
# own (TIME), not any door's clock. Numbers go back as text: Redis turns a Lua number into an
# integer.
NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
"""
ADMIT = (
    NOW
    + """
local window, me = tonumber(ARGV[1]), ARGV[2]
local most, rpm, tpm = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local running, fields = 0, redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  if fields[i] == me or redis.call('EXISTS', ARGV[7] .. fields[i]) == 1 then
    running = running + tonumber(fields[i + 1])
  else
    redis.call('HDEL', KEYS[1], fields[i])
  end
end
if most >= 0 and running >= most then return {'max_parallel', tostring(running), '1'} end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)
local asked = redis.call('ZCARD', KEYS[2])
if rpm >= 0 and asked >= rpm then
  local oldest = redis.call('ZRANGE', KEYS[2], asked - rpm, asked - rpm, 'WITHSCORES')
  return {'rpm', tostring(asked), tostring(tonumber(oldest[2]) + window - now)}
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - window)
local spent, used = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES'), 0
for i = 1, #spent, 2 do used = used + tonumber(string.match(spent[i], '(%d+)$')) end
if tpm >= 0 and used >= tpm then
  local gone = 0
  for i = 1, #spent, 2 do
    gone = gone + tonumber(string.match(spent[i], '(%d+)$'))
    if gone > used - tpm then
      return {'tpm', tostring(used), tostring(tonumber(spent[i + 1]) + window - now)}
    end
  end
  return {'tpm', tostring(used), tostring(window)}
end
redis.call('ZADD', KEYS[2], now, ARGV[6])
redis.call('HINCRBY', KEYS[1], me, 1)
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], 2 * window) end
return {'ok', '0', '0'}
"""
)
# The tokens a request spent, at Redis's time: KEYS = its key's spent set; ARGV = the member
# (ending in the tokens), the set's lifetime in seconds.
SPEND = (
    NOW
    + """
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
"""
)
ALIVE_S = 5  # a worker whose heartbeat is older no longer holds its key's places
AWAY_S = 2.0  # after Redis did not answer, how long the limits are kept on this door alone


class FleetLimits(Limits):
    """The limits of people's keys across the front doors that share a Redis. Each worker counts
    its own requests at once and writes its count there, with a heartbeat; Redis that cannot be
    reached leaves each door its own file's counts (Limits), and the journal says so once."""

    def __init__(self, state_dir: Path, redis: Any, clock: Callable[[], float] = time.time):
        super().__init__(state_dir, clock)
        self.redis = redis
        self.worker = f"{socket.gethostname()}:{self.me}"  # in Redis (self.me: in the file)
        self.open: dict[str, int] = {}  # this worker's requests at once, per key, in Redis
        self.on_file: dict[str, int] = {}  # those the file counted while Redis was away
        self.numbers = itertools.count()
        self.problem: str | None = None
        self.away_until = 0.0  # Redis did not answer: this door's own counts until then
        self.tasks: set[asyncio.Task[None]] = set()
        self.window_s = WINDOW_S  # the limits' minute, in Redis's time
        self.loop_said = Said("counting the keys' requests in Redis")

    async def admit_async(self, person: Person) -> None:
        if not person.limited:
            return
        name = person.name
        keys = [f"b70:open:{name}", f"b70:asked:{name}", f"b70:spent:{name}"]
        limits = [-1 if v is None else v for v in (person.max_parallel, person.rpm, person.tpm)]
        member = f"{self.worker}:{next(self.numbers)}"
        try:
            if time.monotonic() < self.away_until:
                raise ConnectionError("it did not answer a moment ago")
            got = await self.redis.eval(
                ADMIT, 3, *keys, self.window_s, self.worker, *limits, member, "b70:alive:"
            )
        except Exception as e:  # redis's errors, OSError, a timeout
            self._away(e)
            self.admit(person)  # this door's own counts (a Refusal when over)
            self.on_file[name] = self.on_file.get(name, 0) + 1
            return
        self._back()
        which, count, wait = (_text(v) for v in got)
        if which != "ok":
            raise refused(person, which, int(float(count)), float(wait))
        self.open[name] = self.open.get(name, 0) + 1

    def done(self, person: Person, tokens: int) -> None:
        if not person.limited:
            return
        name = person.name
        if self.on_file.get(name):
            self.on_file[name] -= 1
            super().done(person, tokens)
            return
        self.open[name] = max(0, self.open.get(name, 0) - 1)
        task = asyncio.ensure_future(self._ended(name, tokens))  # not cut off with its request
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _ended(self, name: str, tokens: int) -> None:
        try:  # on a failure, the heartbeat writes the count again
            pipe = self.redis.pipeline(transaction=False)
            self._count(pipe, name)
            if tokens > 0:
                member = f"{self.worker}:{next(self.numbers)}:{tokens}"
                pipe.eval(SPEND, 1, f"b70:spent:{name}", member, int(2 * self.window_s))
            await pipe.execute()
        except Exception as e:
            self.loop_said.failed(e)

    def _count(self, pipe: Any, name: str) -> None:
        if self.open.get(name, 0) > 0:
            pipe.hset(f"b70:open:{name}", self.worker, self.open[name])
        else:
            pipe.hdel(f"b70:open:{name}", self.worker)

    async def beat(self) -> None:
        """This worker is alive, and its counts are what it says: every half second."""
        while True:
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(f"b70:alive:{self.worker}", 1, ex=ALIVE_S)
                names = list(self.open)
                for name in names:  # none open: its field goes (the end's own write may not have)
                    self._count(pipe, name)
                await pipe.execute()
                self.open = {n: c for n, c in self.open.items() if c > 0 or n not in names}
            except Exception as e:
                self.loop_said.failed(e)
            else:
                self.loop_said.ok()
            await asyncio.sleep(LOOK_EVERY_S)

    def _away(self, e: BaseException) -> None:
        self.away_until = time.monotonic() + AWAY_S
        if self.problem is None:
            self.problem = f"b70: cannot keep the keys' limits in Redis: {e}"
            log(self.problem + "; each door keeps its own counts until it can")

    def _back(self) -> None:
        if self.problem is not None:
            self.problem = None
            log("b70: the keys' limits are kept in Redis again")


# --- who used what --------------------------------------------------------------------------------


class FleetUsage:
    """Each key's use on this worker, added to the fleet's hourly hashes every FLUSH_S (kept to
    add again later while Redis does not answer). The hour is Redis's: each use is noted by this
    door's minute, and put in its hour by the difference between this door's clock and Redis's
    TIME, read at each flush, so a door whose clock is off counts in the fleet's hours."""

    def __init__(self, redis: Any, clock: Callable[[], float] = time.time) -> None:
        self.redis, self.clock = redis, clock
        self.pending: dict[tuple[int, str], Use] = {}  # (this door's minute, key) -> its use
        self.task: asyncio.Task[None] | None = None
        self.said = Said("adding the keys' use to Redis")

    def add(self, name: str, use: Use) -> None:
        minute = int(self.clock()) // 60
        self.pending.setdefault((minute, name), Use()).add(use)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            try:
                await self.flush()
            except Exception as e:  # kept for the next time
                self.said.failed(e)
            else:
                self.said.ok()

    async def flush(self) -> None:
        if not self.pending:
            return
        taken, self.pending = self.pending, {}
        try:
            seconds, micros = await self.redis.time()
            ahead = seconds + micros / 1e6 - self.clock()  # Redis's clock less this door's
            hours: dict[tuple[int, str], Use] = {}
            for (minute, name), use in taken.items():
                hour = int(minute * 60 + ahead) // HOUR_S * HOUR_S
                hours.setdefault((hour, name), Use()).add(use)
            pipe = self.redis.pipeline(transaction=False)
            for (hour, name), use in hours.items():
                for word, number in use.as_line().items():
                    if number:
                        pipe.hincrbyfloat(f"{FLEET_USAGE}{hour}", f"{name}\t{word}", number)
                pipe.expire(f"{FLEET_USAGE}{hour}", int(RETAIN_S + HOUR_S))
            await pipe.execute()
        except Exception:
            for where, use in taken.items():  # again next time, with what came meanwhile
                self.pending.setdefault(where, Use()).add(use)
            raise


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def client(env: Mapping[str, str]) -> Any:
    """With B70_REDIS: a client of the fleet's Redis (REDIS_PASSWORD, REDIS_SSL and
    REDIS_SSL_CA_CERTS, as LiteLLM reads them)."""
    address = redis_address(env.get("B70_REDIS", ""))
    if address is None:
        return None
    import redis.asyncio
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    # No retries of its own: a request whose key is limited must not wait out Redis's backoff
    # (about 4 s a request with redis-py's default); FleetLimits stays away for AWAY_S instead.
    return redis.asyncio.Redis(
        host=address[0], port=address[1], password=env.get("REDIS_PASSWORD") or None,
        socket_timeout=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0),
        ssl=env.get("REDIS_SSL", "").lower() == "true",
        ssl_ca_certs=env.get("REDIS_SSL_CA_CERTS") or None,
    )  # fmt: skip


def start(
    ring: KeyRing, env: Mapping[str, str], state_dir: Path
) -> tuple[FleetKeys, FleetLimits, FleetUsage] | None:
    """With B70_REDIS, on this worker's event loop: the fleet's keys, limits and usage, running
    (None without them)."""
    redis = client(env)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    if redis is None:
        return None
    keys, limits = FleetKeys(ring, redis, state_dir), FleetLimits(state_dir, redis)
    keys.task = loop.create_task(keys.run())
    limits.tasks.add(loop.create_task(limits.beat()))
    usage = FleetUsage(redis)
    usage.task = loop.create_task(usage.run())
    return keys, limits, usage
