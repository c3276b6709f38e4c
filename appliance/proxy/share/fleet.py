"""The keys of front doors that share a Redis ([peers] redis_host, B70_REDIS "HOST:PORT"): each
proxy worker looks every half second at its own keys file and at the fleet's hash (FLEET_KEYS),
writes there what of its own the hash lacks or has older, and takes the latest of each name
(appliance.people.fleet_view). A key made, rotated or revoked on one door counts on every door
within a second or two, without a restart.

Redis that cannot be reached leaves each door with its own file and the fleet's keys as last read
(the journal says so once, and again when it is back). What a door learned from the others is
The fleet's hash as last read is written to held/keys-fleet.json (mode 0600): `b70ctl keys` takes
the same latest change of each name from it and the door's own file, to list the keys in force and
to rotate or revoke on one door a key made on another.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from appliance.files import write_atomic
from appliance.hold import HELD_DIR
from appliance.people import (
    FLEET_FILE,
    FLEET_KEYS,
    LOOK_EVERY_S,
    KeyRing,
    fleet_view,
)
from appliance.proxy.asgi import log


def redis_address(text: str) -> tuple[str, int] | None:
    """B70_REDIS: "HOST:PORT" (an IPv6 address in brackets)."""
    host, _, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    return (host, int(port)) if host and port.isdigit() else None


class FleetKeys:
    """One worker's share of the fleet's keys, kept in its KeyRing (`ring.fleet`)."""

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
        local = dict(self.ring.local())
        reached = await self._read()
        people, publish = fleet_view(local, self.ring.revoked, self.remote)
        if reached and publish:
            await self._write(publish)
        self.ring.fleet = people
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


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def start(ring: KeyRing, env: Mapping[str, str], state_dir: Path) -> FleetKeys | None:
    """With B70_REDIS: this worker's FleetKeys, running on its event loop (None without one)."""
    address = redis_address(env.get("B70_REDIS", ""))
    if address is None:
        return None
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    import redis.asyncio

    client = redis.asyncio.Redis(
        host=address[0], port=address[1], password=env.get("REDIS_PASSWORD") or None,
        socket_timeout=2, socket_connect_timeout=2,
    )  # fmt: skip
    fleet = FleetKeys(ring, client, state_dir)
    fleet.task = loop.create_task(fleet.run())
    return fleet
