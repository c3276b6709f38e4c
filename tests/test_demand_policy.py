"""The policy of switching on demand (appliance.switch.demand.policy): each rule alone, then the
policy against first-come-first-served swapping on simulated traffic for two models, in
milliseconds. The benchmark on the real demo is scripts/bench-demand's."""

from __future__ import annotations

import random

import pytest

from appliance.switch.demand.policy import (
    DEMAND,
    IDLE_RETURN,
    STARVING,
    Card,
    Decision,
    Policy,
    Waiting,
    cost_of,
    decide,
)

COST = {"llamacpp": 5.0, "vllm": 40.0}
POLICY = Policy(max_wait_s=120, stay_factor=2, batch=8)


def test_a_swap_costs_what_its_runtime_last_took_else_its_engines_default() -> None:
    assert cost_of("vllm-tp4", "vllm", {"vllm-tp4": 212.5}) == 212.5
    assert cost_of("vllm-tp4", "vllm", {}) == 60.0
    assert cost_of("llamacpp", "llamacpp", {}) == 10.0


def test_no_demand_no_swap_and_nothing_serving_starts_the_one_asked_for() -> None:
    assert decide(Card("llamacpp", since_s=500), [], COST, POLICY).target is None
    queued = [Waiting("llamacpp", 1, 0.1), Waiting("vllm", 3, 2.0)]
    assert decide(Card(None), queued, COST, POLICY) == Decision("vllm", DEMAND)
    # requests for what serves are not demand for a swap
    assert decide(Card("vllm", 500), [Waiting("vllm", 9, 1)], COST, POLICY).target is None


def test_a_runtime_stays_at_least_twice_its_swaps_cost_after_it_swapped_in() -> None:
    waiting = [Waiting("llamacpp", 1, 10.0)]
    early = decide(Card("vllm", since_s=30), waiting, COST, POLICY)
    assert early.target is None and early.reason == "stays after its swap in"
    assert early.recheck_s == 50.0  # 2 x 40 s - 30 s
    assert decide(Card("vllm", since_s=80), waiting, COST, POLICY).target == "llamacpp"
    # a cheap runtime is cheap to leave
    assert decide(Card("llamacpp", since_s=10), [Waiting("vllm", 1, 1)], COST, POLICY).target


def test_a_busy_runtime_stays_until_a_batch_waits_for_another() -> None:
    card = Card("llamacpp", since_s=100, in_flight=2)
    few = decide(card, [Waiting("vllm", 7, 30.0)], COST, POLICY)
    assert few == Decision(None, "busy", 90.0)  # rechecked when the oldest would starve
    assert decide(card, [Waiting("vllm", 8, 1.0)], COST, POLICY) == Decision("vllm", DEMAND)
    assert decide(Card("llamacpp", 100), [Waiting("vllm", 1, 0)], COST, POLICY).target == "vllm"


def test_no_request_waits_past_max_wait_whatever_else_holds() -> None:
    card = Card("vllm", since_s=1, in_flight=5)  # just swapped in, and busy
    starved = decide(card, [Waiting("llamacpp", 1, 120.0)], COST, POLICY)
    assert starved == Decision("llamacpp", STARVING)
    soon = decide(card, [Waiting("llamacpp", 1, 100.0)], COST, POLICY)
    assert soon.target is None and soon.recheck_s == pytest.approx(20.0)
    # of several starving, the one that waited longest
    three = [Waiting("a", 50, 121), Waiting("b", 1, 300), Waiting("c", 2, 10)]
    assert decide(Card("x", 1), three, {}, POLICY).target == "b"


def test_a_pin_holds_against_any_demand() -> None:
    pinned = Card("vllm", since_s=1000, pinned_s=300)
    decision = decide(pinned, [Waiting("llamacpp", 99, 999)], COST, POLICY)
    assert decision == Decision(None, "pinned", 300)


def test_the_most_demand_goes_first() -> None:
    waiting = [Waiting("a", 2, 50), Waiting("b", 3, 1), Waiting("c", 3, 2)]
    assert decide(Card("x", since_s=1000), waiting, {}, POLICY).target == "c"


def test_an_idle_card_returns_to_its_default_runtime_when_asked_to() -> None:
    policy = Policy(idle_return_s=600, default_runtime="vllm")
    idle = Card("llamacpp", since_s=5000, idle_s=700)
    assert decide(idle, [], COST, policy) == Decision("vllm", IDLE_RETURN)
    assert decide(Card("llamacpp", 5000, idle_s=100), [], COST, policy).recheck_s == 500
    assert decide(Card("llamacpp", 5000, in_flight=1), [], COST, policy).target is None
    assert decide(Card("vllm", 5000, idle_s=9999), [], COST, policy).target is None
    assert decide(idle, [], COST, Policy()).target is None  # off by default


# --- on simulated traffic -------------------------------------------------------------------------


SLOTS = 8  # requests a runtime serves at once, each in SERVICE_S (a batch costs one's time)
SERVICE_S = 2.0


def trace(seed: int, minutes: float) -> list[tuple[float, str]]:
    """Two models' requests: Poisson arrivals, one in ten a burst of 3 to 6."""
    rng = random.Random(seed)
    arrivals: list[tuple[float, str]] = []
    for runtime, rate in (("llamacpp", 1 / 8), ("vllm", 1 / 12)):
        t = 0.0
        while t < minutes * 60:
            t += rng.expovariate(rate)
            burst = rng.randint(3, 6) if rng.random() < 0.1 else 1
            arrivals += [(t + i * 0.2, runtime) for i in range(burst)]
    return sorted(arrivals)


def first_come_first_served(seed: int, minutes: float = 30) -> tuple[int, dict[str, list[float]]]:
    """How llama-swap and llama.cpp's router behave: requests in the order they came; a request
    for the other model swaps as soon as those in flight end, and those behind it wait."""
    queue = trace(seed, minutes)
    now, serving, swaps = 0.0, "llamacpp", 0
    latencies: dict[str, list[float]] = {"llamacpp": [], "vllm": []}
    while queue:
        now = max(now, queue[0][0])
        if queue[0][1] != serving:
            serving, swaps = queue[0][1], swaps + 1
            now += COST[serving]
        batch = []  # those in line for what serves, up to the first for another, that came
        for request in queue:
            if request[1] != serving or request[0] > now or len(batch) == SLOTS:
                break
            batch.append(request)
        now += SERVICE_S
        for request in batch:
            latencies[serving].append(now - request[0])
        del queue[: len(batch)]
    return swaps, latencies


def simulate(policy: Policy, seed: int, minutes: float = 30) -> tuple[int, dict[str, list[float]]]:
    """The same trace under `policy`, one runtime at a time, which serves up to SLOTS requests
    at once. Returns the swaps and each model's latencies."""
    arrivals = trace(seed, minutes)
    now, serving, since, swaps = 0.0, "llamacpp", 0.0, 0
    queue: list[tuple[float, str]] = []
    latencies: dict[str, list[float]] = {"llamacpp": [], "vllm": []}
    i, last_end = 0, 0.0
    while i < len(arrivals) or queue:
        while i < len(arrivals) and arrivals[i][0] <= now:
            queue.append(arrivals[i])
            i += 1
        mine = [q for q in queue if q[1] == serving][:SLOTS]
        if mine:  # serve the oldest requests for what serves, together
            now += SERVICE_S
            for q in mine:
                queue.remove(q)
                latencies[serving].append(now - q[0])
            last_end = now
            continue
        waiting = [
            Waiting(r, sum(1 for q in queue if q[1] == r), now - min(q[0] for q in queue if q[1] == r))
            for r in {q[1] for q in queue}
        ]  # fmt: skip
        card = Card(serving, since_s=now - since, idle_s=now - last_end)
        decision = decide(card, waiting, COST, policy)
        if decision.target is not None:
            now += COST[decision.target]
            serving, since, swaps = decision.target, now, swaps + 1
            continue
        step = [arrivals[i][0] - now] if i < len(arrivals) else []
        step += [decision.recheck_s] if decision.recheck_s else []
        now += max(min(step, default=1.0), 0.01)
    return swaps, latencies


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.95 * (len(ordered) - 1))]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_on_simulated_traffic_the_policy_swaps_far_less_and_no_model_waits_longer(
    seed: int,
) -> None:
    fcfs_swaps, fcfs = first_come_first_served(seed)
    swaps, ours = simulate(POLICY, seed)
    figures = {m: (round(p95(fcfs[m])), round(p95(ours[m]))) for m in ("llamacpp", "vllm")}
    print(f"\nseed {seed}: {fcfs_swaps} swaps first-come-first-served, {swaps} by the policy; "
          f"p95 s (first-come, policy): {figures}")  # fmt: skip
    assert swaps * 3 <= fcfs_swaps, (swaps, fcfs_swaps)
    for model in ("llamacpp", "vllm"):
        assert p95(ours[model]) < p95(fcfs[model]), (model, p95(ours[model]), p95(fcfs[model]))
