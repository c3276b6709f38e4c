"""Two boxes behind one front door (scripts/bench-fleet): tokens/s through the front door's
:8000 against the sum of both boxes' runtimes loaded directly, in one run, alternated A B A B.

Box B is the demo appliance; box A is the demo appliance with B in [peers], sharing B's key.
"Direct" is N/2 OpenAI-SDK clients on each box's runtime port at once, "front door" N clients
on A's :8000, which LiteLLM's router spreads over both boxes; each client streams one request
after another, and tokens are the runtimes' own count (usage). Both boxes run on this one
machine, so they share its cores: the ratio is what the front door costs, not what a second box
adds. llama-server runs on one thread in each box (demo_appliance).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from typing import Any

from b70tools.demo_appliance import demo_appliance

MODEL = "smollm2"
TOKENS = 64  # per request, generated to the end (ignore_eos)


async def one_client(base_url: str, key: str, deadline: float, totals: dict[str, float]) -> None:
    """Streamed requests one after another until the deadline; tokens as the server counts them."""
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as client:
        while time.monotonic() < deadline:
            try:
                stream = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
                    max_tokens=TOKENS, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                    timeout=300,
                )  # fmt: skip
                async for chunk in stream:
                    if chunk.usage:
                        totals["tokens"] += chunk.usage.completion_tokens
                totals["ok"] += 1
            except openai.APIError:
                totals["failed"] += 1


async def both(loads: list[tuple[str, int]], key: str, seconds: float) -> float:
    """Generated tokens per second of steady loads on several servers at once: (URL, clients)."""
    totals = {"tokens": 0.0, "ok": 0.0, "failed": 0.0}
    start = time.monotonic()
    await asyncio.gather(
        *(one_client(url, key, start + seconds, totals) for url, n in loads for _ in range(n))
    )
    if totals["failed"]:
        print(f"  {totals['failed']:g} requests failed during this window", flush=True)
    return totals["tokens"] / (time.monotonic() - start)


def main() -> None:
    cache, streams, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    with demo_appliance(cache, prefix="b70-fleet-b.", threads=1) as b:
        peers = f'\n[peers]\nurls = ["http://127.0.0.1:{b.proxy_port}"]\n'
        with demo_appliance(cache, peers, "b70-fleet-a.", b.key_file, threads=1) as a:
            key = a.key
            half = streams // 2
            figures: dict[str, list[float]] = {"direct": [], "front": []}
            url = "http://127.0.0.1:{}/v1".format
            asyncio.run(both([(url(a.proxy_port), 4)], key, 5))  # warm both boxes up
            for round_ in range(2):
                direct = [(url(a.backend_port), half), (url(b.backend_port), streams - half)]
                figures["direct"].append(asyncio.run(both(direct, key, seconds)))
                front = [(url(a.proxy_port), streams)]
                figures["front"].append(asyncio.run(both(front, key, seconds)))
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
