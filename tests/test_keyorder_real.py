"""The fleet's order of key changes (appliance.keyorder.ORDER) in a real redis-server, and two
doors' workers (appliance.proxy.share.fleet.FleetKeys) that change keys at random with clocks
ten minutes apart: every change gets one number, a revocation is never undone by a change that
did not see it, and the doors end with the same keys."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio

from appliance import keyorder, people
from appliance.keyorder import FLEET_KEYS, FLEET_ORDER, FLEET_SEQ, ORDER
from appliance.proxy.share.fleet import FleetKeys
from tests.conftest import redis_server

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def redis_port() -> Iterator[int]:
    with redis_server() as port:
        yield port


def _order(client: redis.Redis, name: str, entry: dict[str, object]) -> int:
    mark = keyorder.fingerprint(name, entry).split("\t", 1)[1]
    base, gone = entry.get("base", 0), int(keyorder.is_revocation(entry))
    return int(client.eval(ORDER, 3, FLEET_KEYS, FLEET_ORDER, FLEET_SEQ, name, mark, base,
                           json.dumps(entry), gone))  # type: ignore[arg-type]  # fmt: skip


def _entry(secret: str, base: int = 0, when: float = 1.5) -> dict[str, object]:
    return people.entry_of(
        people.Person("alice", people.digest_of(secret), created=when, base=base)
    )


def test_each_change_gets_one_number_and_one_that_did_not_see_a_later_one_loses(
    redis_port: int,
) -> None:
    client = redis.Redis(port=redis_port)
    client.flushall()
    try:
        made = _entry("a1", when=1e12)  # a clock far in the future orders nothing
        assert _order(client, "alice", made) == 1
        assert _order(client, "alice", made) == 1, "asked again: the same number, no other"
        stored = json.loads(client.hget(FLEET_KEYS, "alice"))  # type: ignore[arg-type]
        assert stored == {"seq": 1, **made}, "read back exactly as sent"
        assert _order(client, "alice", _entry("a2", base=1, when=0.0)) == 2  # rotated, over 1
        assert _order(client, "alice", _entry("a3", base=1)) == 0, "did not see 2: lost"
        assert _order(client, "alice", {"revoked": 0.0, "base": 1}) == 3, "a revocation wins"
        assert _order(client, "alice", _entry("a4", base=2)) == 0, "did not see the revocation"
        assert _order(client, "alice", _entry("a5", base=3)) == 4, "made again after it"
        assert client.get(FLEET_SEQ) == b"4"
    finally:
        client.close()


class Door:
    """One door: its keys file, its clock, one worker's FleetKeys and KeyRing."""

    def __init__(self, root: Path, skew_s: float, port: int) -> None:
        self.dir, self.skew_s = root, skew_s
        self.ring = people.KeyRing(root / people.KEYS_FILE, lambda: "", clock=lambda: 0.0)
        self.keys = FleetKeys(self.ring, redis.asyncio.Redis(port=port), root)

    def change(self, rng: random.Random, name: str) -> str:
        """A `keys` command at random on NAME, with this door's clock: what it did."""
        _, in_force = keyorder.keys_in_force(self.dir)
        with people.editing(self.dir, base_of=keyorder.fleet_bases(self.dir)) as everyone:
            if name in in_force:
                everyone[name] = in_force[name]
            elif name in everyone:
                del everyone[name]
            if name not in everyone:
                everyone[name] = people.Person(name, people.digest_of(str(rng.random())),
                                               created=self._now(rng))  # fmt: skip
                return "add"
            if rng.random() < 0.5:
                del everyone[name]
                return "revoke"
            everyone[name] = people.Person(name, people.digest_of(str(rng.random())),
                                           created=everyone[name].created, rotated=self._now(rng))  # fmt: skip
            return "rotate"

    def _now(self, rng: random.Random) -> float:
        return 1_000_000.0 + self.skew_s + rng.uniform(0, 5)

    async def sync(self) -> dict[str, bytes]:
        self.ring.looked, self.ring.seen = -1e9, None  # the file read again, now
        await self.keys.once()
        return {n: p.digest for n, p in self.ring.current().items()}


@pytest.mark.parametrize("seed", range(20))
def test_two_doors_ten_minutes_apart_agree_and_no_revocation_is_undone(
    tmp_path: Path, redis_port: int, seed: int
) -> None:
    rng = random.Random(seed)

    async def main() -> None:
        await redis.asyncio.Redis(port=redis_port).flushall()
        doors = [Door(tmp_path / "a", 600.0, redis_port), Door(tmp_path / "b", -600.0, redis_port)]
        for d in doors:
            d.dir.mkdir()
        for _ in range(40):
            door = rng.choice(doors)
            name = rng.choice(["alice", "bob"])
            did = door.change(rng, name)
            if rng.random() < 0.6:  # the door's worker publishes now, or after the other's change
                await door.sync()
            if did == "revoke":
                await door.sync()
                for other in doors:  # once ordered, the revocation holds on every door
                    assert name not in await other.sync(), (seed, name)
        views = [await d.sync() for d in doors]
        views = [await d.sync() for d in doors]  # each has read what the other wrote last
        assert views[0] == views[1], seed
        for d in doors:
            await d.keys.redis.aclose()

    asyncio.run(main())
