"""The orders of switching on demand (appliance.switch.demand.policy): each rule alone, then the
orders against each other on simulated traffic for two models (b70tools.demand_sim), at the
demo's swap costs and at a B70's. The benchmark on the real appliance is scripts/bench-demand's."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from appliance.switch.demand.policy import (
    COLLATED,
    DEMAND,
    FCFS,
    IDLE_RETURN,
    STARVING,
    Card,
    Decision,
    Policy,
    Waiting,
    cost_of,
    decide,
)
from b70tools.demand_sim import B70, DEMO, Runtime, percentile, simulate, trace

COST = {"llamacpp": 5.0, "vllm": 40.0}
POLICY = Policy()


def test_a_swap_costs_what_its_runtime_last_took_else_its_engines_default() -> None:
    assert cost_of("vllm-tp4", "vllm", {"vllm-tp4": 212.5}) == 212.5
    assert cost_of("vllm-tp4", "vllm", {}) == 60.0
    assert cost_of("llamacpp", "llamacpp", {}) == 10.0


def test_nothing_serving_starts_the_oldest_and_requests_for_what_serves_are_no_demand() -> None:
    assert decide(Card("llamacpp", since_s=500), [], COST, POLICY).target is None
    queued = [Waiting("llamacpp", 5, 0.1), Waiting("vllm", 1, 2.0)]
    assert decide(Card(None), queued, COST, POLICY) == Decision("vllm", DEMAND)
    # as old: more requests, then more tokens asked for
    assert (
        decide(Card(None), [Waiting("a", 2, 5, 20), Waiting("b", 2, 5, 400)], {}, POLICY).target
        == "b"
    )
    assert decide(Card("vllm", 500), [Waiting("vllm", 9, 1)], COST, POLICY).target is None


@pytest.mark.parametrize("order", [COLLATED, "policy"])
def test_the_serving_runtime_keeps_the_card_while_it_has_work_and_then_the_oldest_goes(
    order: str,
) -> None:
    policy = Policy(order=order)
    others = [Waiting("vllm", 3, 30.0), Waiting("other", 9, 10.0)]
    busy = decide(Card("llamacpp", 100, in_flight=1), others, COST, policy)
    assert busy.target is None and busy.reason == "busy"
    queued = decide(Card("llamacpp", 100), [*others, Waiting("llamacpp", 2, 1.0)], COST, policy)
    assert queued.target is None
    assert decide(Card("llamacpp", 100), others, COST, policy) == Decision("vllm", DEMAND)


def test_strict_first_come_swaps_at_once_for_any_request_for_another() -> None:
    card = Card("llamacpp", since_s=1, in_flight=2)
    assert decide(card, [Waiting("vllm", 1, 0.0)], COST, Policy(order=FCFS)).target == "vllm"


def test_a_runtime_serves_what_waited_for_its_swap_in_before_anything_swaps_it_out() -> None:
    """vLLM took 180 s to swap in; what waited for it goes first, even where llama.cpp's
    requests have waited past max_wait_s and their hold would end."""
    policy = Policy(max_wait_s=60, hold_s=200)
    owed = [Waiting("vllm", 40, 185.0), Waiting("llamacpp", 3, 190.0)]
    stays = decide(Card("vllm", since_s=5, in_flight=64), owed, B70_COST, policy)
    assert stays == Decision(None, "serves what waited for its swap in")


B70_COST = {"llamacpp": 30.0, "vllm": 180.0}


def test_waiting_counts_from_when_a_request_could_have_been_served() -> None:
    """A request that came during a 180 s swap has waited 5 s, not 185 s, when it ends: no
    swap straight back for it, with max_wait_s below the swap's cost."""
    policy = Policy(max_wait_s=60)
    came_during = [Waiting("llamacpp", 3, 185.0)]
    just_in = decide(Card("vllm", since_s=5, in_flight=10), came_during, B70_COST, policy)
    assert just_in == Decision(None, "busy", pytest.approx(55.0))
    later = decide(Card("vllm", since_s=61, in_flight=10), came_during, B70_COST, policy)
    assert later == Decision("llamacpp", STARVING)
    # of several, the one that waited longest once it could be served
    three = [Waiting("a", 50, 70), Waiting("b", 1, 300), Waiting("c", 2, 10)]
    assert decide(Card("x", 200, in_flight=1), three, {}, policy).target == "b"


def test_a_request_whose_hold_would_end_before_its_swap_goes_first() -> None:
    """The proxy answers 503 after hold_s; with a swap of 180 s, a request that waited 205 s
    of a 400 s hold is swapped for now (10 s to spare), one that waited 150 s in 55 s."""
    policy = Policy(hold_s=400)
    busy = Card("llamacpp", since_s=1000, in_flight=1)
    assert decide(busy, [Waiting("vllm", 1, 210.0)], B70_COST, policy) == Decision("vllm", STARVING)
    wait = decide(busy, [Waiting("vllm", 1, 155.0)], B70_COST, policy)
    assert wait.target is None and wait.recheck_s == pytest.approx(55.0)
    # the collated order has no such rule: the request waits out its hold
    assert (
        decide(busy, [Waiting("vllm", 1, 210.0)], B70_COST, Policy(order=COLLATED)).target is None
    )


def test_stay_and_batch_trade_latency_for_fewer_swaps_when_asked() -> None:
    waiting = [Waiting("llamacpp", 1, 10.0)]
    policy = Policy(stay_factor=2, batch=8)
    early = decide(Card("vllm", since_s=30), waiting, COST, policy)
    assert early == Decision(None, "stays after its swap in", 50.0)  # 2 x 40 s - 30 s
    assert decide(Card("vllm", since_s=80), waiting, COST, policy).target == "llamacpp"
    card = Card("llamacpp", since_s=100, in_flight=2)
    assert decide(card, [Waiting("vllm", 7, 30.0)], COST, policy).target is None
    assert decide(card, [Waiting("vllm", 8, 1.0)], COST, policy) == Decision("vllm", DEMAND)


def test_a_pin_holds_against_any_demand() -> None:
    pinned = Card("vllm", since_s=1000, pinned_s=300)
    decision = decide(pinned, [Waiting("llamacpp", 99, 999)], COST, Policy(hold_s=100))
    assert decision == Decision(None, "pinned", 300)


def test_an_idle_card_returns_to_its_default_runtime_when_asked_to() -> None:
    policy = Policy(idle_return_s=600, default_runtime="llamacpp")
    idle = Card("vllm", since_s=5000, idle_s=600)
    assert decide(idle, [], COST, policy) == Decision("llamacpp", IDLE_RETURN)
    waits = decide(Card("vllm", 5000, idle_s=100), [], COST, policy)
    assert waits == Decision(None, "no demand", 500)
    assert decide(Card("llamacpp", 5000, in_flight=1), [], COST, policy).target is None
    assert decide(idle, [], COST, Policy()).target is None  # off by default


# --- on simulated traffic -------------------------------------------------------------------------

LOADS = {  # mean seconds between requests: llama.cpp's, vLLM's
    "light": {"llamacpp": 20.0, "vllm": 40.0},
    "busy": {"llamacpp": 6.0, "vllm": 10.0},
    "heavy": {"llamacpp": 3.0, "vllm": 5.0},
}


def run(order: Policy, costs: dict[str, Runtime], gaps: dict[str, float], seed: int,
        minutes: float = 60, hold_s: float | None = None):  # type: ignore[no-untyped-def]  # fmt: skip
    return simulate(trace(seed, minutes * 60, gaps), costs, order, "llamacpp", hold_s=hold_s)


@pytest.mark.parametrize("costs", [DEMO, B70], ids=["demo", "b70"])
@pytest.mark.parametrize("load", sorted(LOADS))
def test_the_policy_is_no_slower_than_the_collated_order_with_no_more_swaps(
    costs: dict[str, Runtime], load: str
) -> None:
    """An hour of two models' traffic (Poisson, one arrival in ten a burst), three seeds: the
    policy's p95 latency per model within 5% of llama-swap's collated order, no more swaps,
    nothing failed at the bench's 900 s hold; strict first come, first served swaps more."""
    for seed in (1, 2, 3):
        collated = run(Policy(order=COLLATED), costs, LOADS[load], seed, hold_s=900)
        ours = run(Policy(hold_s=900), costs, LOADS[load], seed, hold_s=900)
        strict = run(Policy(order=FCFS), costs, LOADS[load], seed, minutes=10)
        assert ours.swaps <= collated.swaps and ours.failed == 0 and ours.undone == 0
        for model in costs:
            mine, theirs = ours.latencies[model], collated.latencies[model]
            assert percentile(mine, 95) <= 1.05 * percentile(theirs, 95), (model, seed)
        assert strict.swaps > run(Policy(order=COLLATED), costs, LOADS[load], seed, 10).swaps


@pytest.mark.parametrize("seed", range(6))
def test_while_no_request_nears_its_hold_the_policy_decides_as_the_collated_order(
    seed: int,
) -> None:
    """The policy adds to the collated order only what fires near the proxy's hold (and the
    settings off by default): on random cards and queues with a 900 s hold and waits far from
    it, each decision is the collated order's. So on the demo's bench, where no request comes
    near its hold, what separates the two orders is what separates two runs of one."""
    rng = random.Random(seed)
    for _ in range(500):
        serving = rng.choice(["llamacpp", "vllm", None])
        card = Card(serving, since_s=rng.uniform(0, 300), in_flight=rng.choice([0, 0, 1, 2]))
        waiting = [
            Waiting(r, rng.choice([0, 0, 1, 3]), rng.uniform(0, 400), rng.randint(0, 500))
            for r in ("llamacpp", "vllm")
        ]
        ours = decide(card, waiting, COST, Policy(hold_s=900))
        theirs = decide(card, waiting, COST, Policy(order=COLLATED, hold_s=900))
        assert ours.target == theirs.target, (card, waiting, ours, theirs)


def test_where_the_collated_order_waits_past_the_hold_the_policy_answers() -> None:
    """llama.cpp's one place under heavy traffic keeps the collated order on it while vLLM's
    requests wait out a 600 s hold (503); the policy swaps for them in time."""
    gaps = {"llamacpp": 2.5, "vllm": 30.0}
    failed = {"collated": 0, "policy": 0}
    for seed in (1, 2, 3):
        failed["collated"] += run(Policy(order=COLLATED), B70, gaps, seed, hold_s=600).failed
        failed["policy"] += run(Policy(hold_s=600), B70, gaps, seed, hold_s=600).failed
    assert failed["collated"] > 20 and failed["policy"] == 0, failed


@pytest.mark.parametrize("seed", range(12))
def test_no_swap_is_undone_before_it_served_on_random_traffic_and_costs(seed: int) -> None:
    """Random costs, places, loads and settings: a runtime that swapped in serves every
    request that waited for it before it swaps out."""
    rng = random.Random(seed)
    costs = {
        "llamacpp": Runtime(rng.uniform(2, 60), rng.choice([1, 2, 4]), rng.uniform(0.3, 3)),
        "vllm": Runtime(rng.uniform(20, 300), rng.choice([2, 16, 64]), rng.uniform(0.5, 4)),
    }
    gaps = {"llamacpp": rng.uniform(1.5, 30), "vllm": rng.uniform(2, 60)}
    policy = Policy(
        max_wait_s=rng.choice([None, 10.0, 60.0, 300.0]), stay_factor=rng.choice([0, 0.5, 2]),
        batch=rng.choice([0, 1, 8]), hold_s=rng.choice([None, 400.0, 900.0]),
    )  # fmt: skip
    result = run(policy, costs, gaps, seed, minutes=30, hold_s=policy.hold_s)
    assert result.undone == 0, (policy, costs, gaps)
    assert sum(map(len, result.latencies.values())) + result.failed == len(
        trace(seed, 30 * 60, gaps)
    )


def test_at_a_b70s_costs_waiting_from_arrival_would_ping_pong_and_the_policy_does_not() -> None:
    """vLLM's swap 3 minutes, llama.cpp's 30 s, max_wait_s 60: counting a request's wait from
    its arrival (the rule this replaced) swaps straight back after each swap to vLLM, before
    vLLM served what waited for it; counting from when it could be served does not."""

    def from_arrival(card, waiting, cost_s, policy):  # type: ignore[no-untyped-def]
        late = [w for w in waiting if w.runtime != card.serving and w.oldest_s >= 60]
        if card.serving is not None and late:
            return Decision(late[0].runtime, STARVING)
        return decide(card, waiting, cost_s, policy)

    gaps = LOADS["busy"]
    policy = Policy(max_wait_s=60)
    naive = simulate(trace(4, 3600, gaps), B70, policy, "llamacpp", decider=from_arrival)
    ours = simulate(trace(4, 3600, gaps), B70, policy, "llamacpp")
    assert naive.undone > 10
    assert ours.undone == 0 and ours.swaps < naive.swaps
    collated = simulate(trace(4, 3600, gaps), B70, replace(policy, order=COLLATED), "llamacpp")
    assert ours.swaps <= collated.swaps


def test_the_bench_pools_the_replays_of_an_order_and_shows_it_against_itself() -> None:
    """scripts/bench-demand --repeat 2: each replay's figures, the order's requests pooled for the
    comparison, and the collated order's second replay over its first (what two runs of one
    rule differ by)."""
    from b70tools.bench_demand import Outcome, Run, pooled, show

    def run(order: str, seconds: list[float]) -> Run:
        outcomes = [Outcome(m, 0.0, s, 16) for s in seconds for m in ("smollm2", "smollm2-vllm")]
        return Run(order, outcomes, [{"reason": "demand"}] * 3, wall_s=100.0)

    figures = pooled({
        "collated": [run("collated", [1.0] * 19 + [10.0]), run("collated", [1.0] * 19 + [20.0])],
        "policy": [run("policy", [1.0] * 39 + [12.0])],
    })  # fmt: skip
    every = [f for f in figures if f["policy"] == "collated" and f.get("replays")]
    assert [f.get("replay") for f in figures] == [1, 2, 0, None] and every[0]["swaps"] == 6
    assert every[0]["models"]["smollm2"]["requests"] == 40
    text = show(figures)
    assert "collated (all)" in text and "collated #2" in text
    assert "collated #2 / #1 (the same order twice): smollm2 p95" in text
    pooled_p95 = every[0]["models"]["smollm2"]["p95_s"]
    ours = next(f for f in figures if f["policy"] == "policy")["models"]["smollm2"]["p95_s"]
    assert f"policy / collated: smollm2 p95 {ours / pooled_p95:.2f}" in text


def test_the_benchs_figures_keep_each_swaps_time_and_each_requests_latency() -> None:
    """The JSON of scripts/bench-demand keeps what each swap took, by the runtime it brought in,
    and each answered request's latency, so two runs can be pooled and a swap's spread seen."""
    from b70tools.bench_demand import Outcome, Run, show, summary

    swaps = [
        {"to": "vllm", "seconds": 31.04, "reason": "demand"},
        {"to": "llamacpp", "seconds": 4.26, "reason": "demand"},
        {"to": "vllm", "seconds": 27.5, "reason": "demand"},
        {"to": "vllm", "reason": "demand"},  # a record without its time: left out, not 0
    ]
    outcomes = [Outcome("smollm2", 0.0, 1.2345, 16), Outcome("smollm2", 1.0, None, 0, "503")]
    figures = summary(Run("policy", outcomes, swaps, wall_s=10.0))
    assert figures["swap_s"] == {"vllm": [31.0, 27.5], "llamacpp": [4.3]}
    assert figures["models"]["smollm2"]["seconds"] == [1.234]
    assert figures["models"]["smollm2-vllm"]["seconds"] == []
    assert figures["swaps"] == 4 and figures["failed"] == 1
    assert "policy: its swaps took llamacpp 4 s, vllm 28-31 s" in show([figures])
