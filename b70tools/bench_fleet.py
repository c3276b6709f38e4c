"""Two boxes behind one front door (scripts/bench-fleet): tokens/s through the front door's
:8000 against the sum of both boxes' runtimes loaded directly, in one run, alternated A B A B.

Box B is the demo appliance; box A is the demo appliance with B in [peers], sharing B's key.
"Direct" is N/2 streams on each box's runtime port at once, "front door" N streams on A's
:8000, which LiteLLM's router spreads over both boxes. Both boxes run on this one machine, so
they share its cores: the ratio is what the front door costs, not what a second box adds.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
from typing import Any

from b70tools import stream_client
from b70tools.demo_appliance import demo_appliance

MODEL = "smollm2"


async def both(loads: list[tuple[int, int]], key: str, tokens: int, seconds: float) -> float:
    """Chunks per second of steady loads on several ports at once: (port, streams) each."""
    runs = await asyncio.gather(
        *(stream_client.steady_run(port, key, MODEL, n, tokens, seconds) for port, n in loads)
    )
    failed = sum(r["failed"] for r in runs)
    if failed:
        raise SystemExit(f"{failed:g} requests failed during the load")
    return sum(r["chunks"] / r["wall_s"] for r in runs)


def main() -> None:
    cache, streams, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    tokens = 128
    with demo_appliance(cache, prefix="b70-fleet-b.") as b:
        peers = f'\n[peers]\nurls = ["http://127.0.0.1:{b.proxy_port}"]\n'
        with demo_appliance(cache, peers, "b70-fleet-a.", key_from=b.key_file) as a:
            key = a.key
            half = streams // 2
            figures: dict[str, list[float]] = {"direct": [], "front": []}
            asyncio.run(both([(a.proxy_port, 2)], key, 16, 3))  # warm both ways up
            for round_ in range(2):
                direct = [(a.backend_port, half), (b.backend_port, streams - half)]
                figures["direct"].append(asyncio.run(both(direct, key, tokens, seconds)))
                front = [(a.proxy_port, streams)]
                figures["front"].append(asyncio.run(both(front, key, tokens, seconds)))
                print(
                    f"round {round_ + 1}: both boxes direct {figures['direct'][-1]:.1f} tok/s, "
                    f"through the front door {figures['front'][-1]:.1f} tok/s",
                    flush=True,
                )
    show(figures, streams, seconds)


def show(figures: dict[str, Any], streams: int, seconds: float) -> None:
    direct, front = statistics.mean(figures["direct"]), statistics.mean(figures["front"])
    print(f"{streams} streams, {seconds:g} s per window, 2 rounds A B A B")
    print(f"sum of both boxes direct     {direct:8.1f} tok/s")
    print(f"through the front door :8000 {front:8.1f} tok/s")
    print(f"ratio front door / direct    {front / direct:8.3f}")


if __name__ == "__main__":
    main()
