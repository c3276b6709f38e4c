"""Front doors that share a Redis ([peers] redis_host, B70_REDIS "HOST:PORT") share their people's
keys, each key's limits and each key's use there.

Keys (`FleetKeys`): each proxy worker looks every half second at its own keys file and at the
fleet's hash (FLEET_KEYS), writes there what of its own the hash lacks or has older, and takes
the latest change of each name (appliance.people.fleet_view): a key made, rotated or revoked on
one door counts on every door within a second or two, without a restart. Redis that cannot be
reached leaves each door its own file and the fleet's keys as last read (the journal says so
once, and again when it is back). The fleet's hash as last read is written to
held/keys-fleet.json (mode 0600): `b70ctl keys` takes the same latest change of each name from it
and the door's own file, to list the keys in force and to rotate or revoke on one door a key
made on another.

Limits (`FleetLimits`): one atomic check and count in Redis per request of a limited key, each
worker's open requests beside its heartbeat. A worker's own counts are what it writes there:
the end of a request, and every heartbeat, write them again, so a count written out of order is
right again within half a second.

Use (`FleetUsage`): each key's use added to the fleet's hourly hashes every 2 s, for `b70ctl
usage --fleet`.
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
from appliance.people import (
    FLEET_FILE,
    FLEET_KEYS,
    LOOK_EVERY_S,
    KeyRing,
    Person,
    fleet_view,
)
from appliance.proxy.asgi import log
from appliance.proxy.share.limits import WINDOW_S, Limits, refused
from appliance.usage import FLEET_USAGE, FLUSH_S, HOUR_S, RETAIN_S, Use


def redis_address(text: str) -> tuple[str, int] | None:
    """B70_REDIS: "HOST:PORT" (an IPv6 address in brackets)."""
    host, _, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    return (host, int(port)) if host and port.isdigit() else None


class FleetKeys:
    """One worker's share of the fleet's keys: the hash read into its KeyRing, its own written."""

    def __init__(self, ring: KeyRing, redis: Any, state_dir: Path) -> None:
        self.ring, self.redis = ring, redis
        self.file = state_dir / HELD_DIR / FLEET_FILE
        self.remote: dict[str, object] = {}
        self.problem: str | None = None
        self.written: str | None = None
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # never the end of the worker's keys
                await self.once()
            await asyncio.sleep(LOOK_EVERY_S)

    async def once(self) -> None:
        reached = await self._read()
        _, publish = fleet_view(self.ring.local(), self.ring.revoked, self.remote)
        if reached and publish:
            await self._write(publish)
        self.ring.take_remote(self.remote)  # the ring merges it with its file at its next look
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

    async def _write(self, publish: dict[str, dict[str, object]]) -> None:
        try:
            await self.redis.hset(
                FLEET_KEYS, mapping={n: json.dumps(e) for n, e in publish.items()}
            )
        except Exception as e:
            self._said(f"b70: cannot write this door's keys to Redis: {e}")
            return
        self.remote.update(publish)

    def _said(self, problem: str) -> None:
        if self.problem is None:
            self.problem = problem
            log(problem + "; each door goes on with the keys it knows")

    def _note(self) -> None:
        """The fleet's hash as last read, for `b70ctl keys` (written when it changes)."""
        text = json.dumps(dict(sorted(self.remote.items())), indent=2) + "\n"
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
# its tokens of the last minute; as Limits keeps them in a file on one door. Numbers go back as
# text: Redis turns a Lua number into an integer.
ADMIT = """
local now, window, me = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local most, rpm, tpm = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local running, fields = 0, redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  if fields[i] == me or redis.call('EXISTS', ARGV[8] .. fields[i]) == 1 then
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
redis.call('ZADD', KEYS[2], now, ARGV[7])
redis.call('HINCRBY', KEYS[1], me, 1)
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], 2 * window) end
return {'ok', '0', '0'}
"""
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
                ADMIT, 3, *keys, self.clock(), WINDOW_S, self.worker, *limits, member, "b70:alive:"
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
        with contextlib.suppress(Exception):  # the heartbeat writes the count again
            pipe = self.redis.pipeline(transaction=False)
            self._count(pipe, name)
            if tokens > 0:
                member = f"{self.worker}:{next(self.numbers)}:{tokens}"
                pipe.zadd(f"b70:spent:{name}", {member: self.clock()})
                pipe.expire(f"b70:spent:{name}", int(2 * WINDOW_S))
            await pipe.execute()

    def _count(self, pipe: Any, name: str) -> None:
        if self.open.get(name, 0) > 0:
            pipe.hset(f"b70:open:{name}", self.worker, self.open[name])
        else:
            pipe.hdel(f"b70:open:{name}", self.worker)

    async def beat(self) -> None:
        """This worker is alive, and its counts are what it says: every half second."""
        while True:
            with contextlib.suppress(Exception):
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(f"b70:alive:{self.worker}", 1, ex=ALIVE_S)
                names = list(self.open)
                for name in names:  # none open: its field goes (the end's own write may not have)
                    self._count(pipe, name)
                await pipe.execute()
                self.open = {n: c for n, c in self.open.items() if c > 0 or n not in names}
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
    add again later while Redis does not answer)."""

    def __init__(self, redis: Any, clock: Callable[[], float] = time.time) -> None:
        self.redis, self.clock = redis, clock
        self.pending: dict[tuple[int, str], Use] = {}
        self.task: asyncio.Task[None] | None = None

    def add(self, name: str, use: Use) -> None:
        hour = int(self.clock()) // HOUR_S * HOUR_S
        self.pending.setdefault((hour, name), Use()).add(use)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            with contextlib.suppress(Exception):  # kept for the next time
                await self.flush()

    async def flush(self) -> None:
        if not self.pending:
            return
        taken, self.pending = self.pending, {}
        try:
            pipe = self.redis.pipeline(transaction=False)
            for (hour, name), use in taken.items():
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
    """With B70_REDIS: a client of the fleet's Redis (REDIS_PASSWORD, as LiteLLM reads it)."""
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
