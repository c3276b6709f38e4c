"""The rules tried for switching on demand, each against the collated order on the same simulated
traces (b70tools.demand_sim), at the demo's swap costs and a B70's (run through
scripts/sim-demand-rules). Prints, per load and rule, the swaps over all seeds and each model's
mean p95 latency as a ratio to the collated order's.

The rules, as variations of appliance.switch.demand.policy.decide:
- policy: the appliance's order;
- replaced: the policy this replaced (stay 2 x the swap's cost, a batch of 8, a request that
  waited 120 s from its arrival goes first);
- linger: stay 0.25 x the swap's cost after the serving runtime's queue empties;
- wait 120: a request that waited 120 s, once it could be served, goes first;
- defer: a swap waits until 3 requests wait for it, or the oldest has waited 0.1 x its cost;
- gated: swap once what waited at the swap in is served, newcomers or not;
- early drain: swap as soon as nothing waits for the serving runtime, in flight or not.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from appliance.switch.demand.policy import (
    COLLATED,
    DEMAND,
    STARVING,
    Card,
    Decision,
    Policy,
    Waiting,
    decide,
)
from b70tools.demand_sim import B70, DEMO, Runtime, percentile, simulate, trace

Rule = Callable[[Card, list[Waiting], dict[str, float], Policy], Decision]
LOADS = {  # mean seconds between requests for llama.cpp and for vLLM
    "light": {"llamacpp": 20.0, "vllm": 40.0},
    "busy": {"llamacpp": 6.0, "vllm": 10.0},
    "heavy": {"llamacpp": 3.0, "vllm": 5.0},
}


def _oldest(card: Card, waiting: list[Waiting]) -> Waiting | None:
    others = [w for w in waiting if w.count and w.runtime != card.serving]
    return max(others, key=lambda w: w.oldest_s) if others else None


def replaced(card: Card, waiting: list[Waiting], cost: dict[str, float], p: Policy) -> Decision:
    first = _oldest(card, waiting)
    if first is not None and card.serving is not None and first.oldest_s >= 120:
        return Decision(first.runtime, STARVING)  # from its arrival, before the stay
    return decide(card, waiting, cost, replace(p, stay_factor=2, batch=8))


def linger(card: Card, waiting: list[Waiting], cost: dict[str, float], p: Policy) -> Decision:
    d = decide(card, waiting, cost, p)
    stay = 0.25 * cost.get(str(card.serving), 0.0)
    if d.target and d.reason == DEMAND and card.serving and card.idle_s < stay:
        return Decision(None, "lingers")
    return d


def wait_120(card: Card, waiting: list[Waiting], cost: dict[str, float], p: Policy) -> Decision:
    return decide(card, waiting, cost, replace(p, max_wait_s=120))


def defer(card: Card, waiting: list[Waiting], cost: dict[str, float], p: Policy) -> Decision:
    d = decide(card, waiting, cost, p)
    if d.target and d.reason == DEMAND and card.serving:
        w = next(x for x in waiting if x.runtime == d.target)
        if w.count < 3 and w.oldest_s < 0.1 * cost[d.target]:
            return Decision(None, "defers")
    return d


def gated(card: Card, waiting: list[Waiting], cost: dict[str, float], p: Policy) -> Decision:
    first = _oldest(card, waiting)
    own = [w for w in waiting if w.count and w.runtime == card.serving]
    if card.serving and first and not any(w.oldest_s >= card.since_s for w in own):
        return Decision(first.runtime, DEMAND)
    return decide(card, waiting, cost, p)


def early(card: Card, waiting: list[Waiting], cost: dict[str, float], p: Policy) -> Decision:
    d = decide(card, waiting, cost, p)
    first = _oldest(card, waiting)
    own = [w for w in waiting if w.count and w.runtime == card.serving]
    if d.target is None and d.reason == "busy" and first is not None and not own:
        return Decision(first.runtime, DEMAND)
    return d


RULES: dict[str, Rule] = {
    "policy": decide, "replaced": replaced, "linger": linger, "wait 120": wait_120,
    "defer": defer, "gated": gated, "early drain": early,
}  # fmt: skip


def compare(
    costs: dict[str, Runtime], gaps: dict[str, float], seeds: range, hold_s: float
) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for name, rule in {"collated": decide, **RULES}.items():
        policy = Policy(order=COLLATED) if name == "collated" else Policy(hold_s=hold_s)
        swaps, failed, p95 = 0, 0, {m: 0.0 for m in costs}
        for seed in seeds:
            arrivals = trace(seed, 3600, gaps)
            r = simulate(arrivals, costs, policy, "llamacpp", decider=rule, hold_s=hold_s)
            swaps, failed = swaps + r.swaps, failed + r.failed
            for m in costs:
                p95[m] += percentile(r.latencies[m], 95) / len(seeds)
        figures[name] = {"swaps": swaps, "failed": failed, "p95": p95}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--hold", type=float, default=900.0, help="the proxy's hold_s")
    args = parser.parse_args()
    for label, costs in (("demo", DEMO), ("B70", B70)):
        for load, gaps in LOADS.items():
            f = compare(costs, gaps, range(1, args.seeds + 1), args.hold)
            base = f["collated"]
            print(f"{label}, {load} (llama.cpp every {gaps['llamacpp']:g} s, vLLM every "
                  f"{gaps['vllm']:g} s; {args.seeds} hours; collated: {base['swaps']} swaps, "
                  f"p95 {base['p95']['llamacpp']:.1f} s and {base['p95']['vllm']:.1f} s, "
                  f"{base['failed']} failed)")  # fmt: skip
            for name in RULES:
                r = f[name]
                ratios = ", ".join(f"{m} {r['p95'][m] / base['p95'][m]:.2f}" for m in costs)
                print(f"  {name:<12} swaps {r['swaps']:>5}  p95 / collated: {ratios}  "
                      f"failed {r['failed']}")  # fmt: skip


if __name__ == "__main__":
    main()
