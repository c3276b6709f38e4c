"""The limits of people's keys across front doors that share a Redis (appliance.proxy.share.fleet.
FleetLimits), against a real redis-server: the same contract as one door's file (tests/
test_people.py, "limits"), kept across two doors; a door's worker that died holds no places; and
Redis that cannot be reached leaves each door its own counts."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio

from appliance import people
from appliance.proxy.checks import Refusal
from appliance.proxy.share import fleet
from b70tools.net import free_port

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def redis_port() -> Iterator[int]:
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed: scripts/bootstrap --test installs it (as root)")
    port = free_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while (
            subprocess.run(
                ["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True
            ).stdout.strip()
            != "PONG"
        ):
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


Doors = tuple[fleet.FleetLimits, fleet.FleetLimits]


def _run(
    tmp_path: Path, port: int, now: list[float], test: Callable[[Doors], Awaitable[None]]
) -> None:
    """`test` with two doors' limits on one Redis (fresh for the test), each beating."""

    async def main() -> None:
        doors = []
        for name in ("a", "b"):
            client = redis.asyncio.Redis(port=port, socket_timeout=2)
            door = fleet.FleetLimits(tmp_path / name, client, clock=lambda: now[0])
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

    _run(tmp_path, redis_port, [1000.0], test)


def test_requests_a_minute_count_across_doors_and_say_when_the_oldest_leaves(
    tmp_path: Path, redis_port: int
) -> None:
    now = [1000.0]
    bob = people.Person("bob", b"x" * 32, rpm=3)

    async def test(doors: Doors) -> None:
        a, b = doors
        for step in range(3):
            now[0] = 1000.0 + 10 * step
            door = (a, b)[step % 2]
            await door.admit_async(bob)
            await _ended(door, bob, 0)
        now[0] = 1025.0
        with pytest.raises(Refusal) as refused:
            await b.admit_async(bob)
        assert refused.value.headers["Retry-After"] == "35"  # the first leaves at 1060
        now[0] = 1060.5
        await b.admit_async(bob)

    _run(tmp_path, redis_port, now, test)


def test_tokens_a_minute_count_what_the_answers_used_on_every_door(
    tmp_path: Path, redis_port: int
) -> None:
    now = [1000.0]
    bob = people.Person("bob", b"x" * 32, tpm=100)

    async def test(doors: Doors) -> None:
        a, b = doors
        await a.admit_async(bob)
        await _ended(a, bob, 60)
        now[0] = 1030.0
        await b.admit_async(bob)
        await _ended(b, bob, 50)
        with pytest.raises(Refusal) as refused:
            await a.admit_async(bob)
        assert refused.value.headers["Retry-After"] == "30"
        assert "used 110 tokens" in refused.value.message
        now[0] = 1060.5  # the first 60 left: 50 in the minute
        await a.admit_async(bob)

    _run(tmp_path, redis_port, now, test)


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

    _run(tmp_path, redis_port, [1000.0], test)


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
