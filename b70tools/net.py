"""Small network helpers shared by the tools and the tests."""

from __future__ import annotations

import random
import socket

from appliance.processes import ephemeral_range

# Below the kernel's range for outgoing connections, a port that is free now stays free until a
# server binds it: connect() never hands it out as a connection's local end. In that range, one
# of the many connections a test makes can take it first (the server then fails to bind).
LOWEST = 10000

_handed_out: set[int] = set()


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int = 1, *, attempts: int = 200) -> int:
    """The first of `count` consecutive TCP ports on loopback that nothing holds right now,
    none handed out before by this process; below the kernel's range for outgoing connections
    when there is room there."""
    span = ephemeral_range()
    top = span[0] if span else 32768
    if top - LOWEST < 1000:  # the kernel may take nearly every port: fall back to its own pick
        return _kernel_pick(count, attempts)
    for _ in range(attempts):
        first = random.randrange(LOWEST, top - count)
        block = range(first, first + count)
        if not _handed_out.intersection(block) and all(bindable(p) for p in block):
            _handed_out.update(block)
            return first
    raise RuntimeError(f"no {count} consecutive free ports in {LOWEST}-{top - 1}")


def _kernel_pick(count: int, attempts: int) -> int:
    for _ in range(attempts):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first: int = s.getsockname()[1]
        block = range(first, first + count)
        fits = first + count <= 65536 and not _handed_out.intersection(block)
        if fits and all(bindable(p) for p in block[1:]):
            _handed_out.update(block)
            return first
    raise RuntimeError(f"no {count} consecutive free ports")


def free_port() -> int:
    """A TCP port on loopback that nothing holds right now (see free_ports)."""
    return free_ports(1)
