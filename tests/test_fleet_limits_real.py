"""The limits of people's keys across front doors that share a Redis (appliance.proxy.share.fleet.
FleetLimits), against a real redis-server: the same contract as one door's file (tests/
test_people.py, "limits"), kept across two doors; a door's worker that died holds no places; and
Redis that cannot be reached leaves each door its own counts. The minute is Redis's own (TIME):
the doors' clocks are set ten minutes apart, one each way, and count for nothing; the tests that
let it pass shorten it to a few seconds of Redis's time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio

from appliance import people
from appliance.proxy.checks import Refusal
from appliance.proxy.share import fleet
from b70tools.net import free_port
from tests.conftest import redis_server

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def redis_port() -> Iterator[int]:
    with redis_server() as port:
        yield port


Doors = tuple[fleet.FleetLimits, fleet.FleetLimits]
WINDOW_S = 6.0  # the limits' minute, shortened to let it pass
SKEW_S = 600.0  # each door's clock, off Redis's one way or the other


def _run(tmp_path: Path, port: int, test: Callable[[Doors], Awaitable[None]]) -> None:
    """`test` with two doors' limits on one Redis (fresh for the test), each beating."""

    async def main() -> None:
        doors = []
        for name in ("a", "b"):
            client = redis.asyncio.Redis(port=port, socket_timeout=2)
            skew = SKEW_S if name == "a" else -SKEW_S
            door = fleet.FleetLimits(tmp_path / name, client, clock=lambda s=skew: time.time() + s)
            door.window_s = WINDOW_S
            door.worker = f"{name}:{door.worker}"
            doors.append(door)
        await doors[0].redis.flushall()
        beats = [asyncio.ensure_future(d.beat()) for d in doors]
        await asyncio.sleep(0.1)  # the first heartbeats
        try:
            await test((doors[0], doors[1]))
        finally:
            for b in beats:
                b.cancel()
            for d in doors:
                await d.redis.aclose()

    asyncio.run(main())


async def _ended(door: fleet.FleetLimits, person: people.Person, tokens: int) -> None:
    """A request ended: its count and tokens written (the door does not wait for that)."""
    door.done(person, tokens)
    await asyncio.gather(*door.tasks)  # the beats run apart, in _run


def test_requests_at_once_count_across_doors(tmp_path: Path, redis_port: int) -> None:
    bob = people.Person("bob", b"x" * 32, max_parallel=2)

    async def test(doors: Doors) -> None:
        a, b = doors
        await a.admit_async(bob)
        await a.admit_async(bob)
        with pytest.raises(Refusal) as refused:
            await b.admit_async(bob)
        assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
        assert "has 2 of its 2 requests at once open" in refused.value.message
        await _ended(a, bob, 10)
        await b.admit_async(bob)

    _run(tmp_path, redis_port, test)


def test_requests_a_minute_count_across_doors_and_say_when_the_oldest_leaves(
    tmp_path: Path, redis_port: int
) -> None:
    bob = people.Person("bob", b"x" * 32, rpm=3)

    async def test(doors: Doors) -> None:
        a, b = doors
        start = time.monotonic()
        for step in range(3):
            await _until(start + 1.0 * step)
            door = (a, b)[step % 2]
            await door.admit_async(bob)
            await _ended(door, bob, 0)
        await _until(start + 3.5)
        with pytest.raises(Refusal) as refused:
            await b.admit_async(bob)
        assert refused.value.headers["Retry-After"] == "3"  # the first leaves at 6 s
        await _until(start + WINDOW_S + 0.5)
        await b.admit_async(bob)

    _run(tmp_path, redis_port, test)


def test_tokens_a_minute_count_what_the_answers_used_on_every_door(
    tmp_path: Path, redis_port: int
) -> None:
    bob = people.Person("bob", b"x" * 32, tpm=100)

    async def test(doors: Doors) -> None:
        a, b = doors
        start = time.monotonic()
        await a.admit_async(bob)
        await _ended(a, bob, 60)
        await _until(start + 3.0)
        await b.admit_async(bob)
        await _ended(b, bob, 50)
        await _until(start + 3.5)
        with pytest.raises(Refusal) as refused:
            await a.admit_async(bob)
        assert refused.value.headers["Retry-After"] == "3"
        assert "used 110 tokens" in refused.value.message
        await _until(start + WINDOW_S + 0.5)  # the first 60 left: 50 in the minute
        await a.admit_async(bob)

    _run(tmp_path, redis_port, test)


async def _until(when: float) -> None:
    """Wait until time.monotonic() reads `when`."""
    await asyncio.sleep(max(0.0, when - time.monotonic()))


def test_a_worker_without_a_heartbeat_holds_no_places(tmp_path: Path, redis_port: int) -> None:
    bob = people.Person("bob", b"x" * 32, max_parallel=1)

    async def test(doors: Doors) -> None:
        a, b = doors
        await b.admit_async(bob)
        with pytest.raises(Refusal):
            await a.admit_async(bob)
        await b.redis.delete(f"b70:alive:{b.worker}")  # b's worker died: its heartbeat ran out
        b.open.clear()  # (and it beats no more)
        await a.admit_async(bob)

    _run(tmp_path, redis_port, test)


def test_redis_out_of_reach_leaves_each_door_its_own_counts_and_says_so_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bob = people.Person("bob", b"x" * 32, max_parallel=1)

    async def main() -> None:
        client = fleet.client({"B70_REDIS": f"127.0.0.1:{free_port()}"})  # nothing listens
        door = fleet.FleetLimits(tmp_path, client)
        asked = []
        real_eval = client.eval

        async def counted(*args: object) -> object:
            asked.append(args)
            return await real_eval(*args)

        client.eval = counted
        await door.admit_async(bob)
        with pytest.raises(Refusal):  # this door's own file counted the first
            await door.admit_async(bob)
        door.done(bob, 5)
        await door.admit_async(bob)
        assert len(asked) == 1  # Redis was asked once: the next requests did not wait for it
        await client.aclose()

    asyncio.run(main())
    said = capsys.readouterr().err
    assert said.count("cannot keep the keys' limits in Redis") == 1, said


async def _contract(limits: Any, settle: Callable[[], Awaitable[None]]) -> list[str]:
    """One sequence of requests through a door's limits: each admit's outcome ("ok", or the
    limit its 429 names), the limits' rule as the file (Python) and Redis (Lua) both keep it."""
    seen: list[str] = []

    async def ask(person: people.Person) -> None:
        try:
            await limits.admit_async(person)
        except Refusal as e:
            assert e.status == 429 and int(e.headers["Retry-After"]) >= 1, e
            seen.append(next(w for w in ("max_parallel", "rpm", "tpm") if w in e.message))
            return
        seen.append("ok")

    async def end(person: people.Person, tokens: int) -> None:
        limits.done(person, tokens)
        await settle()

    alice = people.Person("alice", b"a" * 32, max_parallel=2, rpm=4)
    for _ in range(3):
        await ask(alice)  # ok, ok, then over its two at once
    await end(alice, 10)
    await ask(alice)  # a place freed: its third request this minute
    await end(alice, 10)
    await end(alice, 10)
    await ask(alice)  # its fourth this minute
    await ask(alice)  # a fifth: over its rpm, with nothing open beyond one
    carol = people.Person("carol", b"c" * 32, tpm=50, max_parallel=1)
    await ask(carol)
    await ask(carol)  # over its one at once before any tokens
    await end(carol, 60)
    await ask(carol)  # 60 tokens this minute: over its tpm
    return seen


CONTRACT = ["ok", "ok", "max_parallel", "ok", "ok", "rpm", "ok", "max_parallel", "tpm"]


def test_one_doors_file_and_the_fleets_redis_keep_the_same_limits(
    tmp_path: Path, redis_port: int
) -> None:
    """The rule is written twice, in Python (one door's file, appliance.proxy.share.limits) and
    in Lua (the fleet's Redis script, appliance.proxy.share.fleet): one contract holds both."""
    from appliance.proxy.share.limits import Limits

    async def nothing() -> None:
        return None

    on_file = asyncio.run(_contract(Limits(tmp_path / "file"), nothing))

    async def on_redis(doors: Doors) -> None:
        door = doors[0]
        got = await _contract(door, lambda: asyncio.gather(*door.tasks))
        assert got == CONTRACT, got

    _run(tmp_path, redis_port, on_redis)
    assert on_file == CONTRACT, on_file


def test_the_fleets_usage_counts_in_redis_hours_whatever_a_doors_clock(redis_port: int) -> None:
    """A door whose clock runs two hours fast, and one two hours slow: each one's use lands in
    the hour of Redis's own clock, where `b70ctl usage --fleet` reads it (from Redis's TIME)."""
    from appliance.usage import FLEET_USAGE, HOUR_S, Use

    async def main() -> tuple[int, list[str]]:
        client = redis.asyncio.Redis(port=redis_port, socket_timeout=2)
        try:
            await client.flushall()
            for skew in (2 * HOUR_S, -2 * HOUR_S):
                doors = fleet.FleetUsage(client, clock=lambda s=skew: time.time() + s)
                doors.add("alice", Use(requests=1, tokens_in=10))
                await doors.flush()
            seconds, _ = await client.time()
            names = sorted([_name(k) async for k in client.scan_iter(match=FLEET_USAGE + "*")])
            return int(seconds) // HOUR_S * HOUR_S, names
        finally:
            await client.aclose()

    hour, names = asyncio.run(main())
    # Both in Redis's hour (or the one before, when the hour turned between the writes)
    starts = {int(n.removeprefix(FLEET_USAGE_PREFIX)) for n in names}
    assert starts and starts <= {hour, hour - 3600}, (hour, names)


FLEET_USAGE_PREFIX = "b70:usage:"  # appliance.usage.FLEET_USAGE


def _name(key: Any) -> str:
    return key.decode() if isinstance(key, bytes) else str(key)
