"""Small network helpers shared by the tools and the tests."""

from __future__ import annotations

import random
import socket

from appliance.host.processes import ephemeral_range

# Below the kernel's range for outgoing connections, a port that is free now stays free until a
# server binds it: connect() never hands it out as a connection's local end. In that range, one
# of the many connections a test makes can take it first (the server then fails to bind).
LOWEST = 10000

_handed_out: set[int] = set()
# (i, n): ports come from the i-th of n equal slices of the range, so that n processes that each
# hand out ports (the test suite's workers) never hand out the same one.
_slice = (0, 1)


def take_slice(index: int, count: int) -> None:
    """From now on, hand out ports only from the `index`-th of `count` equal slices."""
    global _slice
    if not 0 <= index < count:
        raise ValueError(f"slice {index} of {count}")
    _slice = (index, count)


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
    when there is room there (else anywhere above 1023)."""
    span = ephemeral_range()
    low, top = LOWEST, span[0] if span else 32768
    if top - low < 1000:  # the kernel may take nearly every port: no range is safe from it
        low, top = 1024, 65536
    index, slices = _slice
    width = (top - low) // slices
    low, top = low + index * width, low + (index + 1) * width
    for _ in range(attempts):
        first = random.randrange(low, top - count + 1)
        block = range(first, first + count)
        if not _handed_out.intersection(block) and all(bindable(p) for p in block):
            _handed_out.update(block)
            return first
    raise RuntimeError(f"no {count} consecutive free ports in {low}-{top - 1}")


def free_port() -> int:
    """A TCP port on loopback that nothing holds right now (see free_ports)."""
    return free_ports(1)
