"""The appliance's decisions, as pure functions of what was observed: no systemd, no clock.

`plan_switch`: what `b70ctl switch NAME` does, as steps that appliance.switch.apply applies, and
the steps that put the previous runtime back when a start, verification or gate fails.

`judge`: what the monitor does about a sample (appliance.watch.monitor applies it):
1. A hung runtime (alive, but /health or the probe completion times out) `hang_after` samples in
   a row is restarted through systemd.
2. A runtime that does not come back (its unit failed, or still unhealthy after `restart_tries`
   restarts) is replaced by the fallback runtime through the same path as `b70ctl switch`.
3. While a switch holds the lock the monitor only observes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# --- the switch -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Observed:
    """What the switch saw before it began."""

    serving: tuple[str, ...] = ()  # the runtimes whose units are active
    # Each runtime's cards (indices); a runtime not named here shares a card with every other.
    cards: Mapping[str, frozenset[int]] = field(default_factory=dict)

    def take_turns(self, a: str, b: str) -> bool:
        """Whether runtimes `a` and `b` share a card, so that one stops when the other starts."""
        cards_a, cards_b = self.cards.get(a), self.cards.get(b)
        return cards_a is None or cards_b is None or bool(cards_a & cards_b)

    def displaced_by(self, target: str) -> tuple[str, ...]:
        """The serving runtimes that starting `target` stops (Conflicts=): those on its cards."""
        return tuple(s for s in self.serving if s != target and self.take_turns(s, target))


@dataclass(frozen=True)
class Options:
    """How a switch was asked for: --restart, --gate, the drain's limit."""

    restart: bool = False  # start the target again even when it serves
    gate: bool = False  # run the validity gates before the switch counts
    drain_s: float = 60.0  # how long the old runtime may take to finish what it answers
    # Why: "by hand" (b70ctl switch), "failover" (the monitor), or the switch on demand's reason
    # (appliance.switch.demand.policy): kept in the switch's record
    reason: str = "by hand"


@dataclass(frozen=True)
class Step:
    """One step. `kind` is one of the names below; `runtime` the runtime it acts on."""

    kind: str
    runtime: str | None = None
    seconds: float | None = None  # Drain: the longest wait

    def __str__(self) -> str:
        return self.kind + (f" {self.runtime}" if self.runtime else "")


VERIFY = "verify"  # a completion through the proxy's port, past the hold
ENABLE = "enable"  # the runtime becomes the one started at boot, and no other
HOLD = "hold"  # new requests wait at the proxy until the switch ends
DRAIN = "drain"  # wait until the serving runtime has nothing in flight
COMMIT = "commit"  # from here on a signal finishes the switch instead of stopping it
STOP = "stop"  # stop the runtime's unit and wait
START = "start"  # one StartUnit (Conflicts= stops the other runtime); wait until active
GATE = "gate"  # JSON mode and canaries through the proxy

# Steps whose failure is rolled back. The ones before COMMIT change nothing; a STOP that hangs
# and the ENABLE after the hold are errors of their own.
ROLLED_BACK = frozenset({START, VERIFY, GATE})


@dataclass(frozen=True)
class Plan:
    """A switch's steps, the runtimes it stops, and how to put them back."""

    steps: tuple[Step, ...]
    rollback: tuple[Step, ...]  # when a step in ROLLED_BACK fails
    already: bool = False  # the target serves already: nothing changes
    # The serving runtimes the switch stops (the target itself on --restart): drained first,
    # put back by the rollback. Runtimes on other cards are not touched.
    stopping: tuple[str, ...] = ()


def plan_switch(observed: Observed, target: str, options: Options) -> Plan:
    """The steps of a switch to `target`, and how to roll it back."""
    serves = target in observed.serving
    if serves and not options.restart:
        return Plan((Step(VERIFY, target), Step(ENABLE, target)), rollback=(), already=True)
    stopping = (target,) if serves else observed.displaced_by(target)
    steps = [Step(HOLD, target)]
    steps += [Step(DRAIN, name, seconds=options.drain_s) for name in stopping]
    steps.append(Step(COMMIT))
    if serves:  # --restart: the unit must stop before it can start again
        steps.append(Step(STOP, target))
    steps += [Step(START, target), Step(VERIFY, target)]
    if options.gate:
        steps.append(Step(GATE, target))
    steps.append(Step(ENABLE, target))
    return Plan(tuple(steps), plan_rollback(stopping, target), stopping=stopping)


def plan_rollback(stopping: tuple[str, ...], target: str) -> tuple[Step, ...]:
    """Back to the runtimes that served before on the target's cards, each started and verified
    the same way; with none before, the target is stopped so that nothing half-started lingers."""
    if not stopping:
        return (Step(STOP, target),)
    return tuple(step for name in stopping for step in (Step(START, name), Step(VERIFY, name)))


# --- the monitor ------------------------------------------------------------------------------


@dataclass
class Observation:
    """One runtime as the monitor saw it in one sample."""

    at: float
    runtime: str | None  # the runtime whose unit is active or activating
    active_state: str | None  # its unit's ActiveState
    sub_state: str | None
    main_pid: int | None
    healthy: bool
    detail: str
    switching: bool
    in_flight: int | None = None
    generated: float | None = None  # tokens the runtime generated since it started


@dataclass
class Memory:
    """What the policy remembers between samples."""

    failures: int = 0
    restarts: int = 0
    runtime: str | None = None
    last_failure: dict[str, Any] | None = None
    last_action: dict[str, Any] | None = None
    restarts_by_monitor: int = 0
    failovers: int = 0
    started_at: float = field(default_factory=time.time)
    hold_until: float = 0.0  # after a failed failover: observe only, until then
    unsaved: str | None = None  # why the monitor's record could not be written, while it cannot
    generated: float | None = None  # the runtime's generated tokens at the last sample


@dataclass(frozen=True)
class Action:
    """What the monitor does about a runtime: restart it, or fail over."""

    kind: str  # "restart" or "failover"
    runtime: str
    reason: str


def judge(
    m: Memory, o: Observation, hang_after: int, restart_tries: int, fallback: str | None
) -> Action | None:
    """The policy, as numbered in the module docstring. Mutates `m`; returns what to do."""
    if o.switching or o.at < m.hold_until:  # 3.
        m.failures = 0
        return None
    if o.runtime != m.runtime:
        m.runtime, m.failures, m.restarts = o.runtime, 0, 0
    if o.runtime is None:
        return None
    if o.active_state == "failed":  # 2. systemd gave up on it
        m.last_failure = {
            "at": o.at,
            "runtime": o.runtime,
            "reason": f"unit failed ({o.sub_state})",
        }
        return _failover(m, o, fallback, "its unit failed and systemd gave up restarting it")
    if o.active_state != "active":  # starting, or systemd is restarting it: wait, and count anew
        m.failures = 0
        return None
    progressed = o.generated is not None and m.generated is not None and o.generated > m.generated
    m.generated = o.generated
    if o.healthy:
        m.failures = 0
        m.restarts = 0
        return None
    if progressed and o.detail.startswith("probe completion"):
        # Busy, not hung: every place runs (64 on a B70's vLLM, minutes each), so the probe
        # waits its turn past its timeout, while the runtime goes on generating.
        m.failures = 0
        return None
    m.failures += 1
    m.last_failure = {"at": o.at, "runtime": o.runtime, "reason": o.detail}
    if m.failures < hang_after:
        return None
    m.failures = 0
    if m.restarts >= restart_tries:  # 2. restarts did not help
        return _failover(m, o, fallback, f"still unhealthy after {m.restarts} restarts: {o.detail}")
    m.restarts += 1  # 1.
    return Action("restart", o.runtime, f"hung: {o.detail} ({hang_after} samples in a row)")


def _failover(m: Memory, o: Observation, fallback: str | None, why: str) -> Action | None:
    if not fallback or fallback == o.runtime:
        return None
    return Action("failover", fallback, f"{o.runtime} {why}")
