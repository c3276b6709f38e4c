"""The switch: preflight, one StartUnit, verify through the proxy, record, or roll back."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import gate, health, plans, runtimes, state, systemd
from appliance.config import Config, RuntimeConfig
from appliance.errors import ApplianceError
from appliance.interrupts import Interrupts, SwitchInterrupted
from appliance.layout import Layout, Scope, layout
from appliance.preflight import preflight
from appliance.proxy import hold as hold_mark
from appliance.recovery import recover_killed
from appliance.state import read_key
from appliance.units import (
    SUB_STATE_PHASE,
    Progress,
    enable_only,
    no_progress,
    serving_runtime,
    wait_started,
    wait_stopped,
)

POLL_S = 0.1
DRAIN_POLL_S = 0.2
# A request the proxy let through just before the hold was marked reaches the runtime a few
# milliseconds later: the drain counts only after this, and only two empty readings in a row.
DRAIN_SETTLE_S = 0.3
VERIFY_PROMPT = "Reply with one word: ready"


# --- switch ------------------------------------------------------------------------------------


@dataclass
class SwitchResult:
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

    def record(self) -> dict[str, Any]:
        return {
            "at": time.time(),
            "from": self.previous,
            "to": self.target,
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "phases": {k: round(v, 3) for k, v in self.phases.items()},
            "rolled_back": self.rolled_back,
            "error": self.error,
        }


def verify_through_proxy(
    config: Config, lay: Layout, token: str | None = None, timeout_s: float = 60
) -> str:
    """A real completion on the proxy port; retried briefly while the proxy reconnects.

    `token` is the hold mark's: the switch's own request passes the hold it set.
    """
    key = read_key(lay)
    headers = {hold_mark.BYPASS_HEADER: token} if token else {}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return health.chat_completion(
                runtimes.proxy_url(config), key, config.proxy.model, VERIFY_PROMPT, headers=headers
            )
        except ApplianceError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def start_unit(
    config: Config, sd: systemd.Systemd, rt: RuntimeConfig, progress: Progress
) -> dict[str, float]:
    """One StartUnit: Conflicts= stops the old runtime in the same transaction. Waits until the
    unit is active (its health gate passed); the seconds spent in each phase."""
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    if sd.state(rt.unit).sub_state == "auto-restart":  # a crash loop: end it, then start afresh
        sd.stop(rt.unit)
        wait_stopped(sd, rt.unit, runtimes.stop_timeouts(rt).unit_s + 30)
    sd.reset_failed(rt.unit)  # a manual switch is not a crash loop: clear the start limit
    sd.start(rt.unit)
    others = [o for o in config.runtimes.values() if o.name != rt.name]
    stop_budget = sum(runtimes.stop_timeouts(o).unit_s for o in others) + 30
    for sub, seconds in wait_started(
        sd, rt.unit, rt.start_timeout_s + stop_budget, progress
    ).items():
        timings[SUB_STATE_PHASE.get(sub, sub)] = seconds
    timings["unit"] = time.monotonic() - t0
    return timings


def verify_runtime(
    config: Config, lay: Layout, rt: RuntimeConfig, progress: Progress, token: str | None
) -> tuple[float, str]:
    """A real completion through the proxy's port; the seconds it took, and the answer."""
    t0 = time.monotonic()
    progress("verifying", f"a completion through port {config.proxy.port}")
    answer = verify_through_proxy(config, lay, token)
    progress("verified", f"{rt.name} answers through port {config.proxy.port}")
    return time.monotonic() - t0, answer


def drain(
    config: Config,
    timeout_s: float,
    progress: Progress,
    stop: Callable[[], bool] = lambda: False,
) -> tuple[float, int | None]:
    """Wait until the serving runtime has no request running or queued, up to `timeout_s`.

    Returns the seconds waited and what was still in flight at the end: 0 when drained, more
    when the time ran out, None when the runtime's metrics could not be read.
    """
    t0 = time.monotonic()
    time.sleep(DRAIN_SETTLE_S)
    url, empty, shown = runtimes.backend_url(config), 0, None
    while True:
        n = health.read_in_flight(url)
        if n is None or (n == 0 and empty >= 1) or stop():
            return time.monotonic() - t0, n
        empty = empty + 1 if n == 0 else 0
        if n and n != shown:
            progress("draining", f"{n} request{'s' if n > 1 else ''} in flight")
            shown = n
        if n and time.monotonic() - t0 >= timeout_s:
            return time.monotonic() - t0, n
        time.sleep(DRAIN_POLL_S)


def switch(
    config: Config,
    scope: Scope,
    target_name: str,
    restart: bool = False,
    progress: Progress = no_progress,
    gate: bool = False,
    drain_s: float | None = None,
) -> SwitchResult:
    """The switch of DESIGN.md, numbered as there:

    1. lock; 2. preflight; 3. hold new requests at the proxy; 4. drain the old runtime;
    5. one StartUnit (Conflicts= stops the old one); 6. verify through the proxy (and gate);
    7. release the hold, enable the target, record. A failure in 5 or 6 rolls back, still held.

    What to do is decided by appliance.plans.plan_switch from what was observed; this applies it.
    """
    lay = layout(scope)
    target = config.runtime(target_name)
    t0 = time.monotonic()
    with (
        state.switch_lock(lay.state_dir, target_name) as lock,
        systemd.connect(scope) as sd,
        Interrupts(progress) as interrupts,
    ):
        if lock.stale is not None:
            recover_killed(config, lay, sd, lock.stale, progress, wait=True)
        notes = preflight(config, lay, sd, target)
        run = _Run(config, lay, sd, target, serving_runtime(config, sd), lock, interrupts, t0)
        run.notes += notes
        run.phases["preflight"] = time.monotonic() - t0
        drain_for = config.proxy.drain_s if drain_s is None else drain_s
        plan = plans.plan_switch(
            plans.Observed(run.previous), target_name, plans.Options(restart, gate, drain_for)
        )
        if plan.already:
            run.apply(plan.steps)
            run.notes.append(f"{target_name} is already serving")
            return run.result(ok=True)
        try:
            interrupts.check("preflight")
            return run.switch(plan)
        except SwitchInterrupted as e:
            if e.recorded:
                raise
            result = run.result(ok=False, error=e.message)
            unrecorded = state.record_switch(
                lay.state_dir, {**result.record(), "interrupted": True}
            )
            if unrecorded:
                e.message += f"; {unrecorded}"
            raise


@contextmanager
def holding(state_dir: Path, target: str) -> Iterator[hold_mark.Mark]:
    """New requests held at the proxy for the block; a mark that cannot be written (a full
    file system) is refused here, before anything has changed."""
    with ExitStack() as stack:
        try:
            mark = stack.enter_context(hold_mark.marked(state_dir, target))
        except hold_mark.Unwritable as e:
            raise ApplianceError(
                f"cannot write the hold mark {e.path}: {e.why}; nothing was changed",
                hint=f"free space on the file system of {state_dir} (df -h {state_dir}), "
                "or fix its permissions; then switch again",
                code="state_unwritable",
            ) from None
        yield mark


class _Run:
    """One switch, applying the steps of its plan through systemd, the proxy and the state
    directory; it keeps what the record needs (phases, notes, the answer)."""

    def __init__(
        self,
        config: Config,
        lay: Layout,
        sd: systemd.Systemd,
        target: RuntimeConfig,
        previous: str | None,
        lock: state.SwitchLock,
        interrupts: Interrupts,
        t0: float,
    ) -> None:
        self.config, self.lay, self.sd, self.target = config, lay, sd, target
        self.previous, self.lock, self.interrupts, self.t0 = previous, lock, interrupts, t0
        self.progress = interrupts.progress
        self.phases: dict[str, float] = {}
        self.notes: list[str] = []
        self.answer: str | None = None
        self.token: str | None = None  # the hold mark's: the switch's own requests pass it
        self.started_at: float | None = None  # the failed start's journal begins here
        self.hold = ExitStack()
        self.current: plans.Step | None = None  # the step being applied

    def result(self, ok: bool, **fields: Any) -> SwitchResult:
        return SwitchResult(
            self.target.name,
            self.previous,
            ok,
            time.monotonic() - self.t0,
            self.phases,
            self.notes,
            self.answer,
            **fields,
        )

    def switch(self, plan: plans.Plan) -> SwitchResult:
        """Steps 3-7: the plan's steps, and its rollback if a start, verify or gate fails."""
        with self.hold:
            try:
                self.apply(plan.steps)
            except ApplianceError as failure:
                if self.current is None or self.current.kind not in plans.ROLLED_BACK:
                    raise  # before the commit nothing changed; a stop that hangs is its own error
                return self.roll_back(plan, failure)
        received = self.interrupts.received
        unrecorded = state.record_switch(
            self.lay.state_dir,
            {**self.result(ok=True).record(), "interrupted": received is not None},
        )
        if unrecorded:
            self.notes.append(unrecorded)
        if received:
            raise SwitchInterrupted(
                f"interrupted by {received} after {self.target.name} had begun to start; the "
                f"switch was finished: {self.target.name} is serving",
                recorded=True,
            )
        return self.result(ok=True)

    def apply(self, steps: tuple[plans.Step, ...], rolling_back: bool = False) -> None:
        for step in steps:
            self.current = step
            self.step(step, rolling_back)

    def step(self, step: plans.Step, rolling_back: bool = False) -> None:
        config, sd, progress = self.config, self.sd, self.progress
        rt = config.runtime(step.runtime) if step.runtime else self.target
        if step.kind == plans.HOLD:
            self.token = self.hold.enter_context(holding(self.lay.state_dir, rt.name)).token
            self.lock.note(previous=self.previous, phase="hold")
            progress("holding", f"new requests wait at port {config.proxy.port}")
        elif step.kind == plans.DRAIN:
            self.lock.note(phase="drain")
            timeout = step.seconds if step.seconds is not None else config.proxy.drain_s
            stop = lambda: self.interrupts.received is not None  # noqa: E731
            self.phases["drained"], left = drain(config, timeout, progress, stop)
            self.interrupts.check("the drain")
            if left:
                self.notes.append(
                    f"drain: {left} request(s) still in flight after {timeout:g} s; "
                    f"{rt.name} was given its stop timeout to finish them"
                )
            elif left is None:
                self.notes.append(f"drain: {rt.name} did not report its requests in flight")
        elif step.kind == plans.COMMIT:
            self.interrupts.check("the drain")
            self.interrupts.committed = True
            self.lock.note(phase="start")
        elif step.kind == plans.STOP:
            progress("stopping", rt.unit)
            sd.stop(rt.unit)
            if not rolling_back:
                wait_stopped(sd, rt.unit, runtimes.stop_timeouts(rt).unit_s + 30)
        elif step.kind == plans.START:
            if rolling_back:
                progress("rolling back", f"starting {rt.name} again")
            elif self.started_at is None:
                self.started_at = time.time()
            timings = start_unit(config, sd, rt, progress)
            if not rolling_back:
                self.phases.update(timings)
        elif step.kind == plans.VERIFY:
            if not rolling_back and self.token is not None:
                self.lock.note(phase="verify")
            took, answer = verify_runtime(config, self.lay, rt, progress, self.token)
            if not rolling_back:
                self.phases["verified"], self.answer = took, answer
        elif step.kind == plans.GATE:
            self.lock.note(phase="gate")
            t_gate = time.monotonic()
            progress("gating", "JSON mode and canaries")
            gate.require(gate.through_proxy(config, self.lay, rt.name, token=self.token))
            self.phases["gated"] = time.monotonic() - t_gate
        elif step.kind == plans.ENABLE:
            self.hold.close()  # the held requests go on now; the rest is bookkeeping
            enable_only(config, sd, rt.name)
        else:  # pragma: no cover - a plan names only the steps above
            raise AssertionError(f"unknown step {step}")

    def roll_back(self, plan: plans.Plan, failure: ApplianceError) -> SwitchResult:
        """The plan's rollback, still held; then the error, recorded."""
        self.lock.note(phase="rollback")
        target = self.target
        journal = systemd.journal_excerpt(self.lay.scope, target.unit, since=self.started_at)
        reason = f"switch to {target.name} failed: {failure.message}"
        if journal:
            tail = "\n".join("    " + line for line in journal.splitlines()[-12:])
            reason += f"\n  last lines of {target.unit}:\n{tail}"
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
                reason += f"\n  rolled back: {self.previous} is serving again"
        result = self.result(ok=False, rolled_back=rolled_back, error=reason, journal=journal)
        self.hold.close()
        unrecorded = state.record_switch(
            self.lay.state_dir,
            {**result.record(), "interrupted": self.interrupts.received is not None},
        )
        raise ApplianceError(
            reason + (f"\n{unrecorded}" if unrecorded else ""),
            hint=f"journal: {' '.join(systemd.journal_command(self.lay.scope, target.unit, 50))}",
            code="switch_failed",
            details={"switch": result.record(), "journal": journal},
        ) from failure
