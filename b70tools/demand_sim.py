"""Switching on demand, simulated: one card, runtimes that take turns on it, a trace of requests,
and the order that decides (appliance.switch.demand.policy.decide, asked as the monitor asks it,
every half second). The quick loop beside scripts/bench-demand, which replays the same traces on
the real appliance: the tests hold the orders against each other on hours of simulated traffic
in a second.

What is simulated, per runtime: what its swap in costs (the other runtime's stop, its start,
its first answer), how many requests it serves at once, and how long one takes. A swap first
lets the requests in flight end (the switch's drain) and holds every new one; the card then
serves nothing for the swap's cost. With the strict first-come order the proxy keeps each
request behind the oldest one waiting for another runtime, as appliance.proxy.waiting does.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from appliance.switch.demand.policy import FCFS, Card, Decision, Policy, Waiting, decide

LOOK_S = 0.5  # the monitor's look (appliance.switch.demand.runner.LOOK_S)


@dataclass(frozen=True)
class Runtime:
    cost_s: float  # its swap in
    places: int  # requests at once
    service_s: float  # one request, start to last token


# The demo on this machine's CPU: llama.cpp with --parallel 2, CPU vLLM with two places; the
# swap costs the switch records show for them (5 s and about 40 s).
DEMO = {"llamacpp": Runtime(5.0, 2, 1.0), "vllm": Runtime(40.0, 2, 3.0)}
# A B70 as its owners' logs put it: llama.cpp's start 30 s, vLLM's 3 minutes, vLLM's 64 places,
# 64 tokens at the seed's time per token.
B70 = {"llamacpp": Runtime(30.0, 1, 1.2), "vllm": Runtime(180.0, 64, 1.5)}


@dataclass
class Result:
    swaps: int = 0
    latencies: dict[str, list[float]] = field(default_factory=dict)
    # swaps out of a runtime before it served every request that waited for its swap in
    undone: int = 0
    failed: int = 0  # answered 503: held longer than the proxy's hold before a runtime took it
    end_s: float = 0.0


def trace(
    seed: int, duration_s: float, gaps_s: dict[str, float], burst: float = 0.1
) -> list[tuple[float, str]]:
    """(seconds from the start, runtime) of every request: for each, Poisson arrivals with a
    mean gap, and one arrival in ten (`burst`) a burst of 3 to 6 at once."""
    rng = random.Random(seed)
    out: list[tuple[float, str]] = []
    for name, gap in sorted(gaps_s.items()):
        t = rng.expovariate(1 / gap)
        while t < duration_s:
            count = rng.randint(3, 6) if rng.random() < burst else 1
            out += [(t, name)] * count
            t += rng.expovariate(1 / gap)
    return sorted(out)


def simulate(
    arrivals: list[tuple[float, str]],
    runtimes: dict[str, Runtime],
    policy: Policy,
    start: str,
    dt: float = 0.05,
    decider: Callable[..., Decision] = decide,
    hold_s: float | None = None,
) -> Result:
    """Replay `arrivals` on one card that serves `start` at first; a request held `hold_s`
    without a runtime taking it is answered 503 (failed). `decider`: decide's signature, for
    trying another rule."""
    costs = {name: rt.cost_s for name, rt in runtimes.items()}
    result = Result(latencies={name: [] for name in runtimes})
    waiting: list[tuple[float, str, int]] = []  # arrived, runtime, id; in order of arrival
    running: list[tuple[float, float, str]] = []  # ends, arrived, runtime
    serving: str | None = start
    since, last_end, look = 0.0, 0.0, 0.0
    swap: list[object] | None = None  # [target, ready at (None while draining)]
    owed: set[int] = set()  # requests that waited for the serving runtime at its swap in
    now, i = 0.0, 0
    while i < len(arrivals) or waiting or running or swap:
        if not waiting and not running and swap is None and i < len(arrivals):
            now = max(now, arrivals[i][0])  # nothing happens until the next request comes
        while i < len(arrivals) and arrivals[i][0] <= now:
            waiting.append((arrivals[i][0], arrivals[i][1], i))
            i += 1
        if hold_s is not None:
            for entry in [w for w in waiting if now - w[0] >= hold_s]:
                waiting.remove(entry)
                owed.discard(entry[2])
                result.failed += 1
        for ends, arrived, name in [r for r in running if r[0] <= now]:
            result.latencies[name].append(ends - arrived)
            running.remove((ends, arrived, name))
            last_end = ends
        if swap is not None:
            target = str(swap[0])
            if swap[1] is None and not running:
                swap[1] = now + runtimes[target].cost_s
            if swap[1] is not None and now >= float(swap[1]):  # type: ignore[arg-type]
                serving, since, swap = target, now, None
                result.swaps += 1
                owed = {n for _, rt, n in waiting if rt == serving}
        elif now >= look:
            look = now + LOOK_S
            card = Card(serving, since_s=now - since, in_flight=len(running),
                        idle_s=0.0 if running else now - last_end)  # fmt: skip
            decision = decider(card, queues(waiting, now), costs, policy)
            if decision.target is not None and decision.target != serving:
                if owed:
                    result.undone += 1
                swap, serving = [decision.target, None], None
        if swap is None and serving is not None:
            free = runtimes[serving].places - len(running)
            for entry in list(waiting):
                if entry[1] != serving:
                    if policy.order == FCFS:
                        break  # the proxy keeps it behind the older one for another runtime
                    continue
                if free <= 0:
                    break
                waiting.remove(entry)
                owed.discard(entry[2])
                running.append((now + runtimes[serving].service_s, entry[0], serving))
                free -= 1
        now += dt
    result.end_s = now
    return result


def queues(waiting: list[tuple[float, str, int]], now: float) -> list[Waiting]:
    """The proxy's queues as the runner reads them: per runtime, how many and the oldest's wait."""
    out: dict[str, Waiting] = {}
    for arrived, name, _ in waiting:
        w = out.get(name)
        out[name] = Waiting(
            name, 1 + (w.count if w else 0), max(now - arrived, w.oldest_s if w else 0)
        )
    return list(out.values())


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, nearest rank; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]
