"""The appliance's decisions as tables (appliance.switch.plans): the switch's steps and their
rollback, and the monitor's policy. No systemd, no clock."""

from __future__ import annotations

import pytest

from appliance.switch.plans import (
    COMMIT,
    DRAIN,
    ENABLE,
    GATE,
    HOLD,
    START,
    STOP,
    VERIFY,
    Action,
    Memory,
    Observation,
    Observed,
    Options,
    Step,
    judge,
    plan_switch,
)

# --- the switch ---------------------------------------------------------------------------------


def steps(plan_steps: tuple[Step, ...]) -> list[str]:
    return [str(s) for s in plan_steps]


@pytest.mark.parametrize(
    ("serving", "target", "options", "expected", "rollback"),
    [
        # Already serving: verify it answers, make it the boot runtime; nothing stops or starts.
        ("a", "a", Options(), ["verify a", "enable a"], []),
        # The usual switch: hold, drain the old one, one start, verify, enable.
        ("a", "b", Options(), ["hold b", "drain a", "commit", "start b", "verify b", "enable b"],
         ["start a", "verify a"]),
        # Nothing served: nothing to drain; a failure leaves nothing half-started.
        (None, "b", Options(), ["hold b", "commit", "start b", "verify b", "enable b"],
         ["stop b"]),
        # --restart of the one serving: stopped first, and started again if the new start fails.
        ("a", "a", Options(restart=True),
         ["hold a", "drain a", "commit", "stop a", "start a", "verify a", "enable a"],
         ["start a", "verify a"]),
        # --gate: the gates run before the switch counts, and a failed gate rolls back.
        ("a", "b", Options(gate=True),
         ["hold b", "drain a", "commit", "start b", "verify b", "gate b", "enable b"],
         ["start a", "verify a"]),
        # --restart of a runtime that does not serve is a plain switch.
        ("a", "b", Options(restart=True),
         ["hold b", "drain a", "commit", "start b", "verify b", "enable b"],
         ["start a", "verify a"]),
    ],
)  # fmt: skip
def test_the_steps_of_a_switch_and_of_its_rollback(
    serving: str | None, target: str, options: Options, expected: list[str], rollback: list[str]
) -> None:
    plan = plan_switch(Observed((serving,) if serving else ()), target, options)
    assert steps(plan.steps) == expected
    assert steps(plan.rollback) == rollback
    assert plan.already == (expected == [f"verify {target}", f"enable {target}"])


@pytest.mark.parametrize("drain_s", [0.0, 5.0, 600.0])
def test_the_drain_waits_as_long_as_asked(drain_s: float) -> None:
    plan = plan_switch(Observed(("a",)), "b", Options(drain_s=drain_s))
    assert [s.seconds for s in plan.steps if s.kind == DRAIN] == [drain_s]


def test_nothing_changes_before_the_commit_and_everything_after_it_can_be_rolled_back() -> None:
    """A signal before COMMIT stops the switch with nothing changed: only the hold and the drain
    come before it. Every step after it that can fail has a rollback."""
    for serving in (None, "a", "b"):
        for options in (Options(), Options(restart=True), Options(gate=True)):
            plan = plan_switch(Observed((serving,) if serving else ()), "b", options)
            if plan.already:
                continue
            kinds = [s.kind for s in plan.steps]
            before = kinds[: kinds.index(COMMIT)]
            assert set(before) <= {HOLD, DRAIN}
            assert kinds[0] == HOLD and kinds[-1] == ENABLE
            after = set(kinds[kinds.index(COMMIT) + 1 : -1])
            assert after <= {STOP, START, VERIFY, GATE} and plan.rollback


# Four cards: tp on 0-1, vision on 2, small on 3, wide on 2-3.
CARDS = {
    "tp": frozenset({0, 1}),
    "vision": frozenset({2}),
    "small": frozenset({3}),
    "wide": frozenset({2, 3}),
    "one": frozenset({1}),
}


@pytest.mark.parametrize(
    ("serving", "target", "expected", "rollback"),
    [
        # On its own cards: nothing is drained or stopped, and a failure stops only the target.
        (("tp",), "vision", ["hold vision", "commit", "start vision", "verify vision",
                             "enable vision"], ["stop vision"]),
        # It needs the cards of two serving runtimes: both are drained, and both come back.
        (("tp", "vision", "small"), "wide",
         ["hold wide", "drain small", "drain vision", "commit", "start wide", "verify wide",
          "enable wide"],
         ["start small", "verify small", "start vision", "verify vision"]),
        # Only the one on its card: the runtime on cards 2 and 3 goes on.
        (("tp", "wide"), "one",
         ["hold one", "drain tp", "commit", "start one", "verify one", "enable one"],
         ["start tp", "verify tp"]),
        # Already serving beside others.
        (("tp", "vision"), "vision", ["verify vision", "enable vision"], []),
    ],
)  # fmt: skip
def test_a_switch_stops_exactly_the_runtimes_whose_cards_it_needs(
    serving: tuple[str, ...], target: str, expected: list[str], rollback: list[str]
) -> None:
    observed = Observed(tuple(sorted(serving)), CARDS)
    plan = plan_switch(observed, target, Options())
    assert steps(plan.steps) == expected
    assert steps(plan.rollback) == rollback
    assert plan.stopping == tuple(s.split()[1] for s in expected if s.startswith("drain"))


# --- the monitor --------------------------------------------------------------------------------


def obs(
    runtime: str | None = "a", unit: str = "active", healthy: bool = True, switching: bool = False
) -> Observation:
    return Observation(
        0.0,
        runtime,
        unit,
        "running",
        1,
        healthy,
        "ok" if healthy else "/health: no answer",
        switching,
    )


def run_policy(observations: list[Observation], fallback: str | None = "b") -> list[Action | None]:
    m = Memory()
    return [judge(m, o, hang_after=2, restart_tries=1, fallback=fallback) for o in observations]


def test_policy_restarts_a_hung_runtime_then_fails_over() -> None:
    sick = obs(healthy=False)
    actions = run_policy([obs(), sick, sick, sick, sick])
    assert [a.kind if a else None for a in actions] == [None, None, "restart", None, "failover"]
    assert actions[2] == Action("restart", "a", "hung: /health: no answer (2 samples in a row)")
    assert actions[4] == Action(
        "failover", "b", "a still unhealthy after 1 restarts: /health: no answer"
    )


def test_a_busy_runtime_whose_probe_waits_its_turn_is_not_taken_for_a_hang() -> None:
    """Every place of a B70's vLLM runs (64, minutes each): the probe completion waits past its
    timeout while the runtime goes on generating. That is busy, not hung; a runtime whose
    tokens stop, or whose /health does not answer, is."""
    from dataclasses import replace

    def busy(generated: float, detail: str = "probe completion: timed out") -> Observation:
        return replace(obs(healthy=False), detail=detail, generated=generated)

    going = [obs(), busy(100), busy(900), busy(1700), busy(2500)]
    assert run_policy(going) == [None] * 5
    stuck = [obs(), busy(100), busy(100), busy(100)]
    assert [a.kind if a else None for a in run_policy(stuck)] == [None, None, "restart", None]
    no_health = [obs(), busy(100, "/health: timed out"), busy(900, "/health: timed out")]
    assert [a.kind if a else None for a in run_policy(no_health)] == [None, None, "restart"]


def test_policy_forgets_failures_once_healthy_and_waits_while_starting() -> None:
    sick = obs(healthy=False)
    assert (
        run_policy([sick, obs(), sick, obs(unit="activating", healthy=False), sick]) == [None] * 5
    )


def test_policy_fails_over_from_a_failed_unit_but_not_during_a_switch_or_without_fallback() -> None:
    assert run_policy([obs(unit="failed", healthy=False)])[0] == Action(
        "failover", "b", "a its unit failed and systemd gave up restarting it"
    )
    assert run_policy([obs(unit="failed", healthy=False, switching=True)]) == [None]
    assert run_policy([obs(unit="failed", healthy=False)], fallback=None) == [None]
    assert run_policy([obs(runtime="b", unit="failed", healthy=False)]) == [
        None
    ]  # it is the fallback
