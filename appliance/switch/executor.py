"""One runtime's switch under the lock: preflight, the plan, and its steps applied.

What to do is decided by appliance.switch.plans.plan_switch from what was observed. `Executor`
applies the plan's steps through `Edges` (appliance.switch.edges.SystemEdges on a real
appliance) with a `Clock`, so that the executor runs in tests without systemd and without
waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol

from appliance.config import Config
from appliance.engines import lasting
from appliance.errors import ApplianceError
from appliance.hold import Mark
from appliance.host import failures
from appliance.layout import Layout, runtime_unit
from appliance.switch import plans
from appliance.switch.edges import SystemEdges
from appliance.switch.interrupts import Interrupts, SwitchInterrupted
from appliance.switch.lock import SwitchLock
from appliance.switch.preflight import preflight
from appliance.units import systemd
from appliance.units.serving import SUB_STATE_PHASE, serving_runtimes


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class SystemClock:
    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


class Edges(Protocol):
    """What a switch does to the world, one method per kind of step (and the record)."""

    def hold(self, target: str, stopping: tuple[str, ...]) -> AbstractContextManager[Mark]: ...

    def note(self, **fields: Any) -> None: ...  # the lock's note of the phase, for recovery

    def drain(self, runtime: str, timeout_s: float, stop: Callable[[], bool]) -> int | None: ...

    def stop(self, runtime: str, wait: bool) -> None: ...

    def start(self, runtime: str) -> dict[str, float]: ...  # seconds per sub-state

    def verify(self, runtime: str, token: str | None) -> str: ...

    def gate(self, runtime: str, token: str | None) -> None: ...

    def enable(self, runtime: str) -> None: ...

    def journal(self, runtime: str, since: float | None) -> str | None: ...

    # what a start that succeeded said of its compile cache (appliance.engines.lasting)
    def start_cache(self, runtime: str, since: float | None) -> dict[str, Any] | None: ...

    def journal_command(self, runtime: str) -> str: ...

    def record(self, record: dict[str, Any]) -> str | None: ...  # why it was not written


@dataclass
class SwitchResult:
    """What a switch did: its phases, notes, answer and outcome."""

    target: str
    previous: str | None
    ok: bool
    seconds: float
    phases: dict[str, float]
    notes: list[str]
    answer: str | None = None
    rolled_back: bool = False
    error: str | None = None
    journal: str | None = None
    stopped: list[str] = field(default_factory=list)  # the runtimes it stopped (the plan's)
    start: dict[str, Any] | None = None  # its start, warm or cold (appliance.engines.lasting)

    def record(self, at: float) -> dict[str, Any]:
        return {
            "at": at,
            "from": self.previous,
            "to": self.target,
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "phases": {k: round(v, 3) for k, v in self.phases.items()},
            "rolled_back": self.rolled_back,
            "error": self.error,
            **({"start": self.start} if self.start else {}),
        }


@dataclass
class Switch:
    """One runtime's switch, under the lock: preflight, the plan, its steps."""

    config: Config
    lay: Layout
    sd: systemd.Systemd
    lock: SwitchLock
    interrupts: Interrupts
    clock: Clock
    options: plans.Options

    def __call__(self, name: str, options: plans.Options | None = None) -> SwitchResult:
        config, clock = self.config, self.clock
        t0 = clock.monotonic()
        self.lock.note(target=name, phase="preflight")
        self.interrupts.committed = False
        notes = preflight(config, self.lay, self.sd, config.runtime(name))
        plan = plans.plan_switch(observe(config, self.sd), name, options or self.options)
        previous = ", ".join(plan.stopping) or (name if plan.already else None)
        edges = SystemEdges(config, self.lay, self.sd, self.lock, self.interrupts.progress)
        run = Executor(edges, clock, self.interrupts, name, previous, config.proxy.port, t0)
        run.reason = (options or self.options).reason
        run.notes += notes
        run.phases["preflight"] = clock.monotonic() - t0
        return run.run(plan)


def observe(config: Config, sd: systemd.Systemd) -> plans.Observed:
    """What a switch plans from: the runtimes serving, and each runtime's cards."""
    cards = {name: frozenset(rt.card_indices) for name, rt in config.runtimes.items()}
    return plans.Observed(tuple(serving_runtimes(config, sd)), cards)


class Executor:
    """One switch: the steps of its plan applied through the edges, and the plan's rollback
    when a start, verification or gate fails; it keeps what the record needs (phases, notes,
    the answer)."""

    def __init__(
        self,
        edges: Edges,
        clock: Clock,
        interrupts: Interrupts,
        target: str,
        previous: str | None,
        port: int,
        t0: float,
    ) -> None:
        self.edges, self.clock, self.interrupts = edges, clock, interrupts
        self.target, self.previous, self.port, self.t0 = target, previous, port, t0
        self.progress = interrupts.progress
        self.phases: dict[str, float] = {}
        self.notes: list[str] = []
        self.answer: str | None = None
        self.token: str | None = None  # the hold mark's: the switch's own requests pass it
        self.started_at: float | None = None  # the failed start's journal begins here
        self.hold = ExitStack()
        self.current: plans.Step | None = None  # the step being applied
        self.stopping: tuple[str, ...] = ()  # the plan's: their requests are held too
        self.drain_ends: float | None = None  # when every drain's time is up
        self.unenabled: str | None = None  # why the verified target is not enabled for boot
        self.reason = "by hand"  # why the switch was asked for (plans.Options.reason)
        self.started: dict[str, Any] | None = None  # what the target's start said of its cache

    def result(self, ok: bool, **fields: Any) -> SwitchResult:
        seconds = self.clock.monotonic() - self.t0
        return SwitchResult(
            self.target, self.previous, ok, seconds, self.phases, self.notes, self.answer,
            stopped=list(self.stopping), start=self.started, **fields,
        )  # fmt: skip

    def record(self, result: SwitchResult, interrupted: bool) -> str | None:
        """The switch's record in the history; why it could not be written, or None."""
        record = result.record(self.clock.time())
        return self.edges.record({**record, "interrupted": interrupted, "reason": self.reason})

    def run(self, plan: plans.Plan) -> SwitchResult:
        self.stopping = plan.stopping
        if plan.already:
            self.apply(plan.steps)
            self.notes.append(f"{self.target} is already serving")
            return self.result(ok=True)
        try:
            self.interrupts.check("preflight")
            return self.switch(plan)
        except SwitchInterrupted as e:
            if e.recorded:
                raise
            unrecorded = self.record(self.result(ok=False, error=e.message), interrupted=True)
            if unrecorded:
                e.message += f"; {unrecorded}"
            raise

    def switch(self, plan: plans.Plan) -> SwitchResult:
        """Steps 3-7: the plan's steps, and its rollback if a start, verify or gate fails."""
        with self.hold:
            try:
                self.apply(plan.steps)
            except ApplianceError as failure:
                if self.current is None or self.current.kind not in plans.ROLLED_BACK:
                    raise  # before the commit nothing changed; a stop that hangs is its own error
                return self.roll_back(plan, failure)
        # What the start found in its lasting cache, read from its journal once the held
        # requests went on (the hold ends with the enable step)
        self.started = self.edges.start_cache(self.target, self.started_at)
        if self.started:
            self.notes.append(lasting.start_note(self.target, self.started))
        received = self.interrupts.received
        done = self.result(ok=True, error=self.unenabled)
        unrecorded = self.record(done, interrupted=received is not None)
        if unrecorded:
            self.notes.append(unrecorded)
        if self.unenabled is not None:
            raise ApplianceError(
                self.unenabled + (f"; {unrecorded}" if unrecorded else ""),
                hint=f"after a reboot another runtime would start: `b70ctl switch {self.target}` "
                "again enables it",
                code="enable_failed",
                details={"switch": done.record(self.clock.time())},
            )
        if received:
            raise SwitchInterrupted(
                f"interrupted by {received} after {self.target} had begun to start; the "
                f"switch was finished: {self.target} is serving",
                recorded=True,
            )
        return self.result(ok=True)

    def apply(self, steps: tuple[plans.Step, ...], rolling_back: bool = False) -> None:
        for step in steps:
            self.current = step
            self.step(step, rolling_back)

    def step(self, step: plans.Step, rolling_back: bool = False) -> None:
        edges, progress, rt = self.edges, self.progress, step.runtime or self.target
        t0 = self.clock.monotonic()
        if step.kind == plans.HOLD:
            self.token = self.hold.enter_context(edges.hold(rt, self.stopping)).token
            edges.note(previous=self.previous, phase="hold")
            progress("holding", f"new requests wait at port {self.port}")
        elif step.kind == plans.DRAIN:
            edges.note(phase="drain")
            # The runtimes a switch stops drain at once (their requests were all let through
            # before the hold): the limit is one for all of them, from the first drain on.
            if self.drain_ends is None:
                self.drain_ends = t0 + (step.seconds or 0.0)
            timeout = max(0.0, self.drain_ends - t0)
            left = edges.drain(rt, timeout, lambda: self.interrupts.received is not None)
            self.phases["drained"] = self.phases.get("drained", 0.0) + self.clock.monotonic() - t0
            self.interrupts.check("the drain")
            if left:
                self.notes.append(
                    f"drain: {left} request(s) still in flight after {step.seconds or 0:g} s; "
                    f"{rt} was given its stop timeout to finish them"
                )
            elif left is None:
                self.notes.append(f"drain: {rt} did not report its requests in flight")
        elif step.kind == plans.COMMIT:
            self.interrupts.check("the drain")
            self.interrupts.committed = True
            edges.note(phase="start")
        elif step.kind == plans.STOP:
            edges.stop(rt, wait=not rolling_back)
        elif step.kind == plans.START:
            self.start(rt, rolling_back)
        elif step.kind == plans.VERIFY:
            if not rolling_back and self.token is not None:
                edges.note(phase="verify")
            progress("verifying", f"a completion through port {self.port}")
            answer = edges.verify(rt, self.token)
            progress("verified", f"{rt} answers through port {self.port}")
            if not rolling_back:
                self.phases["verified"], self.answer = self.clock.monotonic() - t0, answer
        elif step.kind == plans.GATE:
            edges.note(phase="gate")
            progress("gating", "JSON mode and canaries")
            edges.gate(rt, self.token)
            self.phases["gated"] = self.clock.monotonic() - t0
        elif step.kind == plans.ENABLE:
            self.hold.close()  # the held requests go on now; the rest is bookkeeping
            try:
                edges.enable(rt)
            except ApplianceError as e:  # it serves, verified: no rollback, but said and kept
                self.unenabled = f"{rt} serves, but could not be enabled for boot: {e.message}"
        else:  # pragma: no cover - a plan names only the steps above
            raise AssertionError(f"unknown step {step}")

    def start(self, runtime: str, rolling_back: bool) -> None:
        t0 = self.clock.monotonic()
        if rolling_back:
            self.progress("rolling back", f"starting {runtime} again")
        elif self.started_at is None:
            self.started_at = self.clock.time()
        timings = self.edges.start(runtime)
        if not rolling_back:
            self.phases.update({SUB_STATE_PHASE.get(k, k): v for k, v in timings.items()})
            self.phases["unit"] = self.clock.monotonic() - t0

    def roll_back(self, plan: plans.Plan, failure: ApplianceError) -> SwitchResult:
        """The plan's rollback, still held; then the error, recorded."""
        self.edges.note(phase="rollback")
        target = self.target
        journal = self.edges.journal(target, self.started_at)
        reason = f"switch to {target} failed: {failure.message}"
        found = failures.diagnose(journal)
        if found is not None:
            reason += "\n  " + failures.one_line(*found, runtime=target)
        if journal:
            tail = "\n".join("    " + line for line in journal.splitlines()[-12:])
            reason += f"\n  last lines of {runtime_unit(target)}:\n{tail}"
        rolled_back = False
        try:
            self.apply(plan.rollback, rolling_back=True)
        except ApplianceError as second:
            reason += f"\n  rolling back to {self.previous} failed as well: {second.message}"
        else:
            if self.previous is None:
                reason += "\n  no runtime was serving before, so none is serving now"
            else:
                rolled_back = True
                are = "are" if len(self.stopping) > 1 else "is"
                reason += f"\n  rolled back: {self.previous} {are} serving again"
        result = self.result(ok=False, rolled_back=rolled_back, error=reason, journal=journal)
        self.hold.close()
        unrecorded = self.record(result, interrupted=self.interrupts.received is not None)
        raise ApplianceError(
            reason + (f"\n{unrecorded}" if unrecorded else ""),
            hint=f"journal: {self.edges.journal_command(target)}",
            code="switch_failed",
            details={"switch": result.record(self.clock.time()), "journal": journal},
        ) from failure
